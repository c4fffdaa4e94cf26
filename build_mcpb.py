#!/usr/bin/env python3
"""Build memshelf's Claude Desktop extension bundles (.mcpb), reproducibly, with the stdlib.

Pipeline:  read __version__ from memshelf.py (ast, no import)
        -> fill manifest.json: version, and tools + prompts from memshelf's verb table
        -> stage exactly what the server needs (manifest, server.py, memshelf.py, icon, LICENSE,
           a short README; plus a generated pyproject.toml in the uv bundle)
        -> validate: manifest keys, host variables, entry point, icon, versions, and the tool and
           prompt names that the staged server really serves (a short stdio probe)
        -> zip: sorted entries, 1980-01-01 timestamps, 0644 modes, deflate 9, no extra fields
        -> official check with the mcpb CLI when it is installed (validate, unpack, info)

Two bundles come out of one run:
  dist/memshelf-<version>.mcpb     manifest 0.3, server type "python": the system Python 3.9+
  dist/memshelf-<version>-uv.mcpb  manifest 0.4, server type "uv": the host provisions Python

    python3 build_mcpb.py [--out DIR] [--check] [--require-mcpb]
    python3 build_mcpb.py --plugin DIR       the self-contained Claude Code plugin folder
    python3 build_mcpb.py --sync-manifest    refresh manifest.json from the verb table
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.abspath(__file__))

# ==========================================================================================
# Constants
# ==========================================================================================

# Top-level keys the MCPB 0.3 and 0.4 manifest schemas allow (both are strict objects).
_MANIFEST_KEYS = frozenset((
    "$schema", "_meta", "author", "compatibility", "description", "display_name",
    "documentation", "dxt_version", "homepage", "icon", "icons", "keywords", "license",
    "localization", "long_description", "manifest_version", "name", "privacy_policies",
    "prompts", "prompts_generated", "repository", "screenshots", "server", "support", "tools",
    "tools_generated", "user_config", "version"))
_REQUIRED_KEYS = ("name", "version", "description", "author", "server")
_SERVER_KEYS = frozenset(("type", "entry_point", "mcp_config"))
_MCP_CONFIG_KEYS = frozenset(("command", "args", "env", "platform_overrides"))
_OVERRIDE_KEYS = frozenset(("command", "args", "env"))
_PLATFORMS = ("darwin", "win32", "linux")
_USER_CONFIG_KEYS = frozenset(("type", "title", "description", "required", "default",
                               "multiple", "sensitive", "min", "max"))
_USER_CONFIG_TYPES = ("string", "number", "boolean", "directory", "file")
# Variables Claude Desktop substitutes in mcp_config (MCPB manifest spec, "Variable Substitution").
_HOST_VARIABLES = ("__dirname", "HOME", "DESKTOP", "DOCUMENTS", "DOWNLOADS", "pathSeparator", "/")

_ICON_SIDE = 512
_ICON_MAX_BYTES = 64 * 1024
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_PROBE_PROTOCOL = "2025-11-25"
_MCPB_PACKAGE = "@anthropic-ai/mcpb"
_MCPB_INSTALL = "npm install --prefix .ci/node --no-save --no-audit --no-fund @anthropic-ai/mcpb@2.1.2"


class _Flavor:
    """One bundle variant: which manifest version and server type, which extra files."""

    def __init__(self, key, manifest_version, server_type, suffix, extra_files):
        self.key = key
        self.manifest_version = manifest_version
        self.server_type = server_type
        self.suffix = suffix
        self.files = ("manifest.json", "server.py", "memshelf.py", "icon.png", "LICENSE",
                      "README.md") + extra_files

    def file_name(self, version):
        return f"memshelf-{version}{self.suffix}.mcpb"


PYTHON = _Flavor("python", "0.3", "python", "", ())
UV = _Flavor("uv", "0.4", "uv", "-uv", ("pyproject.toml",))
FLAVORS = (PYTHON, UV)

_UV_PARAGRAPH = (
    "**Python.** This is the uv bundle: Claude Desktop provides a Python 3.9 or newer for it "
    "through uv, so nothing has to be installed first (memshelf has no dependencies; uv only "
    "supplies the interpreter). When the computer already has Python 3.9 or newer, the plain "
    "bundle is the simpler choice: it starts without a provisioning step.")


class BuildError(Exception):
    """A problem that stops the build: what is wrong and how to fix it."""

    def __init__(self, message, fix=""):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self):
        return self.message + (f"\n  fix: {self.fix}" if self.fix else "")


def _say(text):
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _warn(text):
    sys.stderr.write(f"build_mcpb: {text}\n")


# ==========================================================================================
# Sources: version, verb table, manifest template
# ==========================================================================================

def read_version(path):
    """__version__ of memshelf.py, read with ast so a broken import cannot fake it."""
    import ast
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__version__" \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return node.value.value
    raise BuildError(f"{path} has no literal __version__ = \"X.Y.Z\" at module level",
                     "add __version__ to memshelf.py")


def _import_memshelf(root):
    """The verb table lives in memshelf.py; import it from this tree, not from site-packages."""
    sys.dont_write_bytecode = True   # keep the source tree free of __pycache__ from the build
    if root not in sys.path:
        sys.path.insert(0, root)
    existing = sys.modules.get("memshelf")
    if existing is not None and os.path.dirname(os.path.abspath(existing.__file__)) != root:
        del sys.modules["memshelf"]
    import memshelf
    return memshelf


def verb_table_entries(memshelf):
    """(tools, prompts) for the manifest: tool names with titles, prompts with ${arguments.X}."""
    tools = [{"name": t["name"], "description": t["title"]}
             for t in memshelf.tool_definitions("2025-11-25")]
    prompts = []
    for p in memshelf.PROMPTS:
        prompts.append({"name": p["name"], "description": p["description"],
                        "arguments": [a["name"] for a in p["arguments"]], "text": p["text"]})
    return tools, prompts


def load_manifest_source(root):
    path = os.path.join(root, "manifest.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise BuildError(f"cannot read {path}: {e.strerror}", "restore manifest.json")
    except ValueError as e:
        raise BuildError(f"{path} is not valid JSON: {e}", "fix the JSON syntax")


def compose_manifest(source, flavor, version, tools, prompts):
    """The manifest of one bundle: the source with version, tools and prompts filled in."""
    m = json.loads(json.dumps(source))   # deep copy that keeps key order
    m["version"] = version
    m["tools"] = tools
    m["prompts"] = prompts
    m["manifest_version"] = flavor.manifest_version
    if flavor is UV:
        server = m.get("server") or {}
        env = dict((server.get("mcp_config") or {}).get("env") or {})
        entry = server.get("entry_point", "server.py")
        m["server"] = {
            "type": "uv",
            "entry_point": entry,
            "mcp_config": {
                # --directory makes uv find the generated pyproject.toml next to the server.
                "command": "uv",
                "args": ["run", "--directory", "${__dirname}", "${__dirname}/" + entry],
                "env": env,
            },
        }
        paragraphs = (m.get("long_description") or "").split("\n\n")
        kept = [p for p in paragraphs if p and not p.startswith("**Python.**")]
        m["long_description"] = "\n\n".join(kept + [_UV_PARAGRAPH])
    return m


def uv_pyproject(manifest):
    """pyproject.toml of the uv bundle: no dependencies; uv only supplies the interpreter."""
    requires = ((manifest.get("compatibility") or {}).get("runtimes") or {}).get("python", ">=3.9")
    return (
        "# Generated by build_mcpb.py for the uv bundle. memshelf uses only the Python standard\n"
        "# library, so uv has nothing to install: it only provides a matching interpreter.\n"
        "[project]\n"
        f"name = {json.dumps(manifest['name'])}\n"
        f"version = {json.dumps(manifest['version'])}\n"
        f"description = {json.dumps(manifest['description'], ensure_ascii=False)}\n"
        f"requires-python = {json.dumps(requires)}\n"
        "dependencies = []\n"
        "\n"
        "[tool.uv]\n"
        "# Run server.py from this folder; there is no package to build or install.\n"
        "package = false\n")


def bundle_readme(manifest, flavor):
    tools = ", ".join(t["name"] for t in manifest.get("tools", []))
    prompts = ", ".join(p["name"] for p in manifest.get("prompts", []))
    if flavor is UV:
        runtime = ("with a Python 3.9+ that Claude Desktop provides through uv (see "
                   "pyproject.toml: no dependencies)")
    else:
        runtime = ("with the Python 3.9+ already installed on this computer (`python3`; "
                   "`python` on Windows)")
    return (
        f"# memshelf {manifest['version']}: Claude Desktop extension\n"
        "\n"
        f"This bundle runs memshelf's MCP server (`server.py` and `memshelf.py`, standard library "
        f"only) {runtime}.\n"
        "\n"
        "- **Default shelf**: Settings → Extensions → memshelf → *Default shelf* (default "
        "`~/memshelf`, created on the first shelve). Cleared, every call must pass `shelf_path`.\n"
        f"- **Tools**: {tools}.\n"
        f"- **Prompts**: {prompts}.\n"
        f"- **Documentation**: {manifest.get('documentation') or manifest.get('homepage', '')}\n"
        "- **Licence**: MIT, see LICENSE.\n")


# ==========================================================================================
# Staging
# ==========================================================================================

def stage_bundle(root, stage, manifest, flavor):
    """Write exactly the bundle's files into an empty directory."""
    copies = {"server.py": "server.py", "memshelf.py": "memshelf.py", "LICENSE": "LICENSE",
              "icon.png": manifest.get("icon") or "icon.png"}
    for name, source_name in copies.items():
        src = os.path.join(root, source_name)
        if not os.path.isfile(src):
            raise BuildError(f"{source_name} is missing from {root}",
                             f"restore {source_name}; the bundle needs it")
        with open(src, "rb") as f:
            _write_file(os.path.join(stage, name), f.read())
    _write_file(os.path.join(stage, "manifest.json"),
                (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    _write_file(os.path.join(stage, "README.md"), bundle_readme(manifest, flavor).encode("utf-8"))
    if flavor is UV:
        _write_file(os.path.join(stage, "pyproject.toml"), uv_pyproject(manifest).encode("utf-8"))


def _write_file(path, data):
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, 0o644)


# ==========================================================================================
# Validation: the staged manifest and icon, before any bundle is written
# (docs/desktop-extension.md § For maintainers: building and checking the bundles)
# ==========================================================================================

def png_size(data):
    """(width, height, color type) from the IHDR chunk, or None when it is not a PNG."""
    import struct
    if len(data) < 33 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    width, height, _depth, color_type = struct.unpack(">IIBB", data[16:26])
    return width, height, color_type


def _variables(text):
    import re
    return re.findall(r"\$\{([^}]*)\}", text)


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)


def launch_configs(manifest):
    """{platform: {command, args, env}} after applying platform_overrides like the host."""
    cfg = (manifest.get("server") or {}).get("mcp_config") or {}
    out = {}
    for platform in _PLATFORMS:
        over = (cfg.get("platform_overrides") or {}).get(platform) or {}
        env = dict(cfg.get("env") or {})
        env.update(over.get("env") or {})
        out[platform] = {"command": over.get("command", cfg.get("command")),
                         "args": list(over.get("args", cfg.get("args") or [])), "env": env}
    return out


def validate_manifest(manifest, stage, flavor, version, tools, prompts):
    """Every problem of the staged manifest as a list of BuildError (empty when valid)."""
    problems = []

    def bad(message, fix=""):
        problems.append(BuildError(message, fix))

    if manifest.get("manifest_version") != flavor.manifest_version:
        bad(f"manifest_version is {manifest.get('manifest_version')!r}, expected "
            f"{flavor.manifest_version!r}")
    for key in sorted(set(manifest) - _MANIFEST_KEYS):
        bad(f"manifest key {key!r} is not allowed by the MCPB {flavor.manifest_version} schema",
            "remove it from manifest.json")
    for key in _REQUIRED_KEYS:
        if not manifest.get(key):
            bad(f"manifest key {key!r} is required", f"add {key} to manifest.json")
    if not isinstance(manifest.get("author"), dict) or not manifest["author"].get("name"):
        bad("author.name is required", "set author.name in manifest.json")

    # server: type, entry point, launch command
    server = manifest.get("server") if isinstance(manifest.get("server"), dict) else {}
    for key in sorted(set(server) - _SERVER_KEYS):
        bad(f"server key {key!r} is not allowed", "remove it from manifest.json")
    if server.get("type") != flavor.server_type:
        bad(f"server.type is {server.get('type')!r}, expected {flavor.server_type!r}")
    entry = server.get("entry_point")
    if not isinstance(entry, str) or not entry:
        bad("server.entry_point is missing", "set it to server.py")
        entry = "server.py"
    elif not os.path.isfile(os.path.join(stage, entry)):
        bad(f"server.entry_point {entry!r} is not in the bundle", "stage server.py")
    cfg = server.get("mcp_config") if isinstance(server.get("mcp_config"), dict) else None
    if cfg is None:
        bad("server.mcp_config is missing", "add command, args and env")
        cfg = {}
    for key in sorted(set(cfg) - _MCP_CONFIG_KEYS):
        bad(f"server.mcp_config key {key!r} is not allowed", "remove it")
    for platform, over in (cfg.get("platform_overrides") or {}).items():
        if platform not in _PLATFORMS:
            bad(f"platform_overrides names unknown platform {platform!r}",
                "use darwin, win32 or linux")
        for key in sorted(set(over) - _OVERRIDE_KEYS):
            bad(f"platform_overrides.{platform} key {key!r} is not allowed", "remove it")
    for platform, launch in launch_configs(manifest).items():
        if not isinstance(launch["command"], str) or not launch["command"]:
            bad(f"no command to start the server on {platform}", "set mcp_config.command")
        if not all(isinstance(a, str) for a in launch["args"]):
            bad(f"mcp_config.args on {platform} must be strings")
        if "${__dirname}/" + entry not in launch["args"]:
            bad(f"the launch args on {platform} do not reference the entry point as "
                f"${{__dirname}}/{entry}",
                "the host sets no working directory; every bundle path needs ${__dirname}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in launch["env"].items()):
            bad(f"mcp_config.env on {platform} must map strings to strings")

    # variables: host variables or declared settings only
    user_config = manifest.get("user_config") or {}
    for value in _strings(cfg):
        for var in _variables(value):
            if var in _HOST_VARIABLES:
                continue
            if var.startswith("user_config.") and var[len("user_config."):] in user_config:
                continue
            bad(f"mcp_config uses ${{{var}}}, which is neither a host variable nor a declared "
                "user_config key", "declare the setting under user_config or fix the name")
    referenced = " ".join(_strings(cfg))
    for key, spec in user_config.items():
        if not isinstance(spec, dict):
            bad(f"user_config.{key} must be an object")
            continue
        for k in sorted(set(spec) - _USER_CONFIG_KEYS):
            bad(f"user_config.{key} key {k!r} is not allowed", "remove it")
        if spec.get("type") not in _USER_CONFIG_TYPES:
            bad(f"user_config.{key}.type {spec.get('type')!r} is not one of "
                f"{', '.join(_USER_CONFIG_TYPES)}")
        for k in ("title", "description"):
            if not spec.get(k):
                bad(f"user_config.{key}.{k} is required")
        for value in _strings(spec.get("default", "")):
            for var in _variables(value):
                if var not in _HOST_VARIABLES:
                    bad(f"user_config.{key}.default uses ${{{var}}}, not a host variable")
        if "${user_config." + key + "}" not in referenced:
            bad(f"user_config.{key} never reaches the server",
                f"reference ${{user_config.{key}}} in mcp_config.env or args")

    # tools and prompts: exactly the verb table
    names = [t.get("name") for t in manifest.get("tools") or []]
    if names != [t["name"] for t in tools]:
        bad(f"manifest tools {names} differ from the verb table {[t['name'] for t in tools]}")
    for p in manifest.get("prompts") or []:
        for var in _variables(p.get("text", "")):
            if not (var.startswith("arguments.") and
                    var[len("arguments."):] in (p.get("arguments") or [])):
                bad(f"prompt {p.get('name')!r} uses ${{{var}}}, which is not one of its "
                    "arguments")
    pnames = [p.get("name") for p in manifest.get("prompts") or []]
    if pnames != [p["name"] for p in prompts]:
        bad(f"manifest prompts {pnames} differ from the verb table {[p['name'] for p in prompts]}")

    # icon
    icon = manifest.get("icon")
    if icon:
        path = os.path.join(stage, icon)
        data = b""
        if os.path.isfile(path):
            with open(path, "rb") as f:
                data = f.read()
        size = png_size(data)
        if size is None:
            bad(f"icon {icon!r} is missing or not a PNG", "commit a 512x512 RGBA icon.png")
        else:
            if size[:2] != (_ICON_SIDE, _ICON_SIDE):
                bad(f"icon is {size[0]}x{size[1]}, expected {_ICON_SIDE}x{_ICON_SIDE}")
            if size[2] != 6:
                bad(f"icon PNG color type is {size[2]}, expected 6 (RGBA)")
            if len(data) > _ICON_MAX_BYTES:
                bad(f"icon is {len(data)} bytes, more than {_ICON_MAX_BYTES}")

    # versions and staged files
    if manifest.get("version") != version:
        bad(f"manifest version {manifest.get('version')!r} differs from memshelf.py "
            f"__version__ {version!r}")
    staged = sorted(os.listdir(stage))
    if staged != sorted(flavor.files):
        bad(f"the stage holds {staged}, expected exactly {sorted(flavor.files)}")
    if flavor is UV:
        with open(os.path.join(stage, "pyproject.toml"), encoding="utf-8") as f:
            pyproject = f.read()
        if f"version = {json.dumps(version)}" not in pyproject or \
                "dependencies = []" not in pyproject:
            bad("the uv bundle's pyproject.toml must carry the version and no dependencies")
    return problems


def probe_server(stage, entry):
    """What the staged server really serves: (tool names, prompt names, server version)."""
    import subprocess
    requests = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize",
         "params": {"protocolVersion": _PROBE_PROTOCOL, "capabilities": {},
                    "clientInfo": {"name": "build_mcpb", "version": "1"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
        {"jsonrpc": "2.0", "id": 3, "method": "prompts/list"},
    ]
    payload = "".join(json.dumps(r) + "\n" for r in requests).encode("utf-8")
    env = {k: os.environ[k] for k in ("HOME", "PATH", "SYSTEMROOT", "USERPROFILE")
           if k in os.environ}
    env["PYTHONDONTWRITEBYTECODE"] = "1"   # the stage is zipped next; leave no caches in it
    with tempfile.TemporaryDirectory(prefix="memshelf-probe-") as cwd:
        try:
            proc = subprocess.run([sys.executable, os.path.join(stage, entry)], input=payload,
                                  capture_output=True, cwd=cwd, env=env, timeout=60)
        except subprocess.TimeoutExpired:
            raise BuildError("the staged server did not answer within 60 s",
                             "run python3 server.py by hand and send an initialize line")
    answers = {}
    for line in proc.stdout.decode("utf-8", "replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            raise BuildError(f"the staged server wrote a non-JSON line on stdout: {line[:120]!r}",
                             "stdout must carry only protocol messages")
        if isinstance(msg, dict) and "id" in msg:
            answers[msg["id"]] = msg
    missing = [i for i in (1, 2, 3) if "result" not in answers.get(i, {})]
    if missing:
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        raise BuildError("the staged server did not answer initialize, tools/list and "
                         f"prompts/list (exit {proc.returncode}): {' | '.join(tail)}",
                         "run python3 server.py by hand to see the error")
    return ([t["name"] for t in answers[2]["result"].get("tools", [])],
            [p["name"] for p in answers[3]["result"].get("prompts", [])],
            answers[1]["result"].get("serverInfo", {}).get("version"))


# ==========================================================================================
# Reproducible zip
# ==========================================================================================

def write_bundle(stage, names, path):
    """Zip the stage: same files in, same bytes out. Returns (size, sha256)."""
    import hashlib
    import zipfile
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w") as zf:
        for name in sorted(names):
            with open(os.path.join(stage, name), "rb") as f:
                data = f.read()
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3                     # Unix, so the mode bits mean 0644 everywhere
            info.external_attr = (0o100644 & 0xFFFF) << 16
            info.extra = b""
            zf.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    os.replace(tmp, path)
    with open(path, "rb") as f:
        data = f.read()
    return len(data), hashlib.sha256(data).hexdigest()


# ==========================================================================================
# The official mcpb CLI
# ==========================================================================================

def find_mcpb():
    """argv prefix of the mcpb CLI: on PATH, in .ci/node, or installed for npx; else None."""
    import subprocess
    found = shutil.which("mcpb")
    if found:
        return [found]
    local = os.path.join(ROOT, ".ci", "node", "node_modules", ".bin",
                         "mcpb.cmd" if os.name == "nt" else "mcpb")
    if os.path.isfile(local) and shutil.which("node"):   # the local CLI is a node script
        return [local]
    npx = shutil.which("npx")
    if npx:
        try:
            r = subprocess.run([npx, "--no-install", _MCPB_PACKAGE, "--version"],
                               capture_output=True, timeout=60, cwd=ROOT)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if r.returncode == 0:
            return [npx, "--no-install", _MCPB_PACKAGE]
    return None


def _run_mcpb(mcpb, *args):
    import subprocess
    r = subprocess.run(mcpb + list(args), capture_output=True, text=True, timeout=120)
    return r.returncode, (r.stdout + r.stderr).strip()


def official_check(mcpb, stage, bundle):
    """mcpb validate on the stage and on an unpack of the bundle, then mcpb info."""
    problems = []
    code, out = _run_mcpb(mcpb, "validate", os.path.join(stage, "manifest.json"))
    if code != 0:
        problems.append(BuildError(f"mcpb validate rejected the staged manifest:\n{out}"))
    with tempfile.TemporaryDirectory(prefix="memshelf-unpack-") as unpacked:
        code, out = _run_mcpb(mcpb, "unpack", bundle, unpacked)
        if code != 0:
            problems.append(BuildError(f"mcpb unpack failed:\n{out}"))
        else:
            code, out = _run_mcpb(mcpb, "validate", os.path.join(unpacked, "manifest.json"))
            if code != 0:
                problems.append(BuildError(f"mcpb validate rejected the unpacked bundle:\n{out}"))
    code, out = _run_mcpb(mcpb, "info", bundle)
    if code != 0:
        problems.append(BuildError(f"mcpb info failed:\n{out}"))
    return problems


# ==========================================================================================
# Build
# ==========================================================================================

def build(out_dir, *, check=False, require_mcpb=False, root=ROOT):
    """Build (or with check=True only verify) both bundles. Returns [(path, size, sha256)]."""
    version = read_version(os.path.join(root, "memshelf.py"))
    memshelf = _import_memshelf(root)
    if memshelf.__version__ != version:
        raise BuildError(f"memshelf imported as {memshelf.__version__}, but memshelf.py says "
                         f"{version}", "remove stale copies of memshelf from sys.path")
    tools, prompts = verb_table_entries(memshelf)
    source = load_manifest_source(root)
    drift = manifest_drift(source, version, tools, prompts)
    if drift:
        _warn(f"note: manifest.json lags the verb table ({', '.join(drift)}); the bundles use "
              "the verb table. Refresh it with: python3 build_mcpb.py --sync-manifest")
    mcpb = find_mcpb()
    if mcpb is None:
        if require_mcpb:
            raise BuildError("the mcpb CLI is not installed (--require-mcpb)",
                             f"install it: {_MCPB_INSTALL}")
        _warn(f"mcpb CLI not found; official validation skipped (install: {_MCPB_INSTALL})")
    results = []
    served = None
    with tempfile.TemporaryDirectory(prefix="memshelf-build-") as work:
        for flavor in FLAVORS:
            manifest = compose_manifest(source, flavor, version, tools, prompts)
            stage = os.path.join(work, "stage-" + flavor.key)
            os.mkdir(stage)
            stage_bundle(root, stage, manifest, flavor)
            problems = validate_manifest(manifest, stage, flavor, version, tools, prompts)
            if served is None and not problems:
                served = probe_server(stage, manifest["server"]["entry_point"])
            if served is not None:
                problems += _compare_served(served, tools, prompts, version)
            if problems:
                raise BuildFailed(flavor.file_name(version), problems)
            target_dir = os.path.join(work, "out") if check else out_dir
            os.makedirs(target_dir, exist_ok=True)
            path = os.path.join(target_dir, flavor.file_name(version))
            size, digest = write_bundle(stage, flavor.files, path)
            if mcpb is not None:
                problems = official_check(mcpb, stage, path)
                if problems:
                    raise BuildFailed(flavor.file_name(version), problems)
            official = "mcpb validate + info ok" if mcpb else "mcpb not run"
            if check:
                _say(f"ok {flavor.file_name(version)}: {size:,} bytes, sha256 {digest} "
                     f"({official}; --check: not written)")
            else:
                _say(f"wrote {os.path.relpath(path)} ({size:,} bytes, sha256 {digest}; "
                     f"{official})")
            results.append((path, size, digest))
    return results


def _compare_served(served, tools, prompts, version):
    tool_names, prompt_names, server_version = served
    problems = []
    if tool_names != [t["name"] for t in tools]:
        problems.append(BuildError(f"server.py serves tools {tool_names}, the verb table has "
                                   f"{[t['name'] for t in tools]}"))
    if prompt_names != [p["name"] for p in prompts]:
        problems.append(BuildError(f"server.py serves prompts {prompt_names}, the verb table "
                                   f"has {[p['name'] for p in prompts]}"))
    if server_version != version:
        problems.append(BuildError(f"server.py reports version {server_version!r}, memshelf.py "
                                   f"says {version!r}"))
    return problems


class BuildFailed(Exception):
    def __init__(self, bundle, problems):
        super().__init__(bundle)
        self.bundle = bundle
        self.problems = problems


def manifest_drift(source, version, tools, prompts):
    """Which generated fields of the committed manifest.json lag the verb table."""
    drift = []
    if source.get("version") != version:
        drift.append("version")
    if source.get("tools") != tools:
        drift.append("tools")
    if source.get("prompts") != prompts:
        drift.append("prompts")
    return drift


def sync_manifest(root=ROOT):
    """Rewrite manifest.json's version, tools and prompts from memshelf.py, keeping the rest."""
    version = read_version(os.path.join(root, "memshelf.py"))
    tools, prompts = verb_table_entries(_import_memshelf(root))
    source = load_manifest_source(root)
    drift = manifest_drift(source, version, tools, prompts)
    if not drift:
        _say("manifest.json is up to date")
        return
    source["version"], source["tools"], source["prompts"] = version, tools, prompts
    path = os.path.join(root, "manifest.json")
    with open(path + ".tmp", "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(source, indent=2, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)
    _say(f"updated manifest.json: {', '.join(drift)}")


# ==========================================================================================
# Claude Code plugin folder
# ==========================================================================================

_PLUGIN_SKIP = ("__pycache__", ".pytest_cache", ".DS_Store")


def build_plugin(dest, root=ROOT):
    """adapters/claude-code/ plus copies of memshelf.py and server.py: a self-contained plugin."""
    dest = os.path.abspath(dest)
    version = read_version(os.path.join(root, "memshelf.py"))
    if os.path.exists(dest):
        previous = all(os.path.isfile(os.path.join(dest, n)) for n in ("memshelf.py", "server.py"))
        if os.listdir(dest) and not previous:
            raise BuildError(f"{dest} exists and is not a previous plugin build",
                             "choose a new folder, or remove it first")
        shutil.rmtree(dest)
    os.makedirs(dest)
    adapter = os.path.join(root, "adapters", "claude-code")
    for name in ("memshelf.py", "server.py"):
        src = os.path.join(root, name)
        if not os.path.isfile(src):
            raise BuildError(f"{name} is missing from {root}", f"restore {name}")
        shutil.copyfile(src, os.path.join(dest, name))
    if not os.path.isdir(adapter):
        note = ("# memshelf plugin build (incomplete)\n\n"
                f"`adapters/claude-code/` was not found in {root} when this folder was built, so it "
                "holds only `memshelf.py` and `server.py`. Build it again from a checkout that "
                "has the adapter: `python3 build_mcpb.py --plugin DIR`.\n")
        with open(os.path.join(dest, "README.md"), "w", encoding="utf-8", newline="\n") as f:
            f.write(note)
        _warn(f"adapters/claude-code/ is missing; {dest} holds only memshelf.py, server.py and a "
              "note")
        return dest
    for dirpath, dirnames, filenames in os.walk(adapter):
        dirnames[:] = sorted(d for d in dirnames if d not in _PLUGIN_SKIP)
        rel = os.path.relpath(dirpath, adapter)
        target = os.path.normpath(os.path.join(dest, rel))
        os.makedirs(target, exist_ok=True)
        for name in sorted(filenames):
            if name in _PLUGIN_SKIP or name.endswith((".pyc", ".pyo")):
                continue
            shutil.copyfile(os.path.join(dirpath, name), os.path.join(target, name))
    manifest = os.path.join(dest, ".claude-plugin", "plugin.json")
    if os.path.isfile(manifest):
        with open(manifest, encoding="utf-8") as f:
            plugin = json.load(f)
        plugin["version"] = version
        with open(manifest, "w", encoding="utf-8", newline="\n") as f:
            f.write(json.dumps(plugin, indent=2, ensure_ascii=False) + "\n")
    _say(f"wrote the Claude Code plugin {version} to {dest}")
    return dest


# ==========================================================================================
# Command line
# ==========================================================================================

def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="build_mcpb.py",
        description="Build memshelf's Claude Desktop extension bundles: memshelf-<version>.mcpb "
                    "(system Python) and memshelf-<version>-uv.mcpb (Python provided by the "
                    "host through uv).")
    parser.add_argument("--out", default=os.path.join(ROOT, "dist"), metavar="DIR",
                        help="where the .mcpb files go (default: dist/ next to this script)")
    parser.add_argument("--check", action="store_true",
                        help="build and validate everything, write nothing")
    parser.add_argument("--require-mcpb", action="store_true",
                        help="fail when the official mcpb CLI is not installed")
    parser.add_argument("--plugin", metavar="DIR",
                        help="write the self-contained Claude Code plugin folder instead")
    parser.add_argument("--sync-manifest", action="store_true",
                        help="refresh version, tools and prompts in manifest.json, then stop")
    args = parser.parse_args(argv)
    try:
        if args.sync_manifest:
            sync_manifest()
        elif args.plugin:
            build_plugin(args.plugin)
        else:
            build(os.path.abspath(args.out), check=args.check, require_mcpb=args.require_mcpb)
    except BuildFailed as e:
        _warn(f"{e.bundle}: {len(e.problems)} problem(s)")
        for p in e.problems:
            sys.stderr.write(f"  - {p}\n")
        return 1
    except BuildError as e:
        _warn(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
