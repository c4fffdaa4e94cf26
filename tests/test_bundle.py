"""The Claude Desktop bundles, proven the way the host uses them (docs/desktop-extension.md).

Build both bundles twice (byte-identical), check their contents, validate them with the official
mcpb CLI, then install each one like Claude Desktop does: unzip into a read-only folder, build the
launch command from the manifest (${__dirname}, ${HOME}, ${user_config.shelf}, platform
overrides), start it from the home folder with only HOME, PATH and the manifest's env, and drive
it with the strict stdlib client (tests/mcp_client.py) and, when installed, the MCP Python SDK.
"""
import asyncio
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build_mcpb.py")
TESTS = os.path.dirname(os.path.abspath(__file__))
for _path in (ROOT, TESTS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import build_mcpb  # noqa: E402
import memshelf  # noqa: E402

pytestmark = pytest.mark.slow   # builds both bundles (module fixture): the full run only

VERSION = build_mcpb.read_version(os.path.join(ROOT, "memshelf.py"))
TOOL_NAMES = [t["name"] for t in memshelf.tool_definitions("2025-11-25")]
PROMPT_NAMES = [p["name"] for p in memshelf.PROMPTS]
PROTOCOLS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
SLUG = "2026-07-22-auth-refactor"
DIGEST = ("Dana chose JWT middleware over server sessions for the API; rejected per-route "
          "decorators because they duplicate checks. Open: key rotation schedule.")
PLATFORM = "win32" if sys.platform.startswith("win") else (
    "darwin" if sys.platform == "darwin" else "linux")
UNSET = object()


# ==========================================================================================
# Building
# ==========================================================================================

def run_build(*args, cwd=ROOT, env=None, script=BUILD):
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Both bundles, built twice into two folders."""
    base = tmp_path_factory.mktemp("bundles")
    out = {}
    for run, env in (("first", None), ("second", bare_env())):
        # the second build skips the official CLI: its checks cannot change the bytes
        r = run_build("--out", str(base / run), env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        out[run] = r.stdout
    return {"dir": base, "stdout": out["first"],
            "python": str(base / "first" / f"memshelf-{VERSION}.mcpb"),
            "uv": str(base / "first" / f"memshelf-{VERSION}-uv.mcpb")}


@pytest.fixture(scope="module")
def mcpb_cli():
    cli = build_mcpb.find_mcpb()
    if cli is None:
        pytest.skip("the mcpb CLI is not installed (" + build_mcpb._MCPB_INSTALL + ")")
    return cli


def read_zip(path):
    with zipfile.ZipFile(path) as zf:
        return zf.infolist(), {i.filename: zf.read(i) for i in zf.infolist()}


def test_second_build_is_byte_identical(built):
    for name in (f"memshelf-{VERSION}.mcpb", f"memshelf-{VERSION}-uv.mcpb"):
        with open(built["dir"] / "first" / name, "rb") as a, \
                open(built["dir"] / "second" / name, "rb") as b:
            assert a.read() == b.read(), name
    assert sorted(os.listdir(built["dir"] / "first")) == sorted(
        [f"memshelf-{VERSION}.mcpb", f"memshelf-{VERSION}-uv.mcpb"])
    import hashlib
    with open(built["python"], "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() in built["stdout"]


@pytest.mark.parametrize("flavor", ["python", "uv"])
def test_bundle_holds_exactly_the_server_files(built, flavor):
    infos, files = read_zip(built[flavor])
    expected = ["LICENSE", "README.md", "icon.png", "manifest.json", "memshelf.py", "server.py"]
    if flavor == "uv":
        expected.append("pyproject.toml")
    assert [i.filename for i in infos] == sorted(expected)   # sorted, nothing else
    for info in infos:
        assert info.date_time == (1980, 1, 1, 0, 0, 0), info.filename
        assert info.external_attr >> 16 == 0o100644, info.filename
        assert info.compress_type == zipfile.ZIP_DEFLATED
        assert info.extra == b"", info.filename
    for name in ("memshelf.py", "server.py", "LICENSE", "icon.png"):
        with open(os.path.join(ROOT, name), "rb") as f:
            assert files[name] == f.read(), name
    manifest = json.loads(files["manifest.json"])
    assert manifest["version"] == VERSION == memshelf.__version__
    assert manifest["tools"] == [{"name": t["name"], "description": t["title"]}
                                 for t in memshelf.tool_definitions("2025-11-25")]
    assert [p["name"] for p in manifest["prompts"]] == PROMPT_NAMES
    for p, source in zip(manifest["prompts"], memshelf.PROMPTS):
        assert p["text"] == source["text"]
        assert p["arguments"] == [a["name"] for a in source["arguments"]]
        for var in re.findall(r"\$\{([^}]*)\}", p["text"]):
            assert var.startswith("arguments.") and var[10:] in p["arguments"]
    assert VERSION in files["README.md"].decode()


def test_icon_is_a_clean_512_rgba_png():
    with open(os.path.join(ROOT, "icon.png"), "rb") as f:
        data = f.read()
    assert build_mcpb.png_size(data) == (512, 512, 6)
    assert len(data) <= 64 * 1024


def test_python_manifest_launches_the_system_interpreter(built):
    _, files = read_zip(built["python"])
    m = json.loads(files["manifest.json"])
    assert m["manifest_version"] == "0.3"
    server = m["server"]
    assert server["type"] == "python" and server["entry_point"] == "server.py"
    cfg = server["mcp_config"]
    assert cfg["command"] == "python3"
    assert cfg["args"] == ["${__dirname}/server.py"]
    assert cfg["platform_overrides"]["win32"]["command"] == "python"
    assert cfg["env"]["MEMSHELF_SHELF"] == "${user_config.shelf}"
    shelf = m["user_config"]["shelf"]
    assert shelf["type"] == "directory" and shelf["default"] == "${HOME}/memshelf"
    assert shelf["required"] is False
    assert m["compatibility"]["runtimes"]["python"] == ">=3.9"
    assert sorted(m["compatibility"]["platforms"]) == ["darwin", "linux", "win32"]
    assert m["privacy_policies"] == []


def test_uv_manifest_and_generated_pyproject(built):
    _, files = read_zip(built["uv"])
    m = json.loads(files["manifest.json"])
    _, plain_files = read_zip(built["python"])
    plain = json.loads(plain_files["manifest.json"])
    assert m["manifest_version"] == "0.4"
    assert m["server"]["type"] == "uv" and m["server"]["entry_point"] == "server.py"
    cfg = m["server"]["mcp_config"]
    assert cfg["command"] == "uv"
    assert cfg["args"] == ["run", "--directory", "${__dirname}", "${__dirname}/server.py"]
    assert cfg["env"] == plain["server"]["mcp_config"]["env"]
    assert "platform_overrides" not in cfg
    for key in ("tools", "prompts", "user_config", "compatibility", "version"):
        assert m[key] == plain[key], key
    text = files["pyproject.toml"].decode()
    try:
        import tomllib
    except ImportError:   # Python < 3.11: check the lines that matter
        assert "dependencies = []" in text and 'requires-python = ">=3.9"' in text
        assert f'version = "{VERSION}"' in text and "package = false" in text
    else:
        py = tomllib.loads(text)
        assert py["project"]["dependencies"] == []
        assert py["project"]["requires-python"] == ">=3.9"
        assert py["project"]["version"] == VERSION
        assert py["tool"]["uv"]["package"] is False
        assert "build-system" not in py


def test_committed_manifest_matches_the_verb_table():
    with open(os.path.join(ROOT, "manifest.json"), encoding="utf-8") as f:
        source = json.load(f)
    tools, prompts = build_mcpb.verb_table_entries(memshelf)
    assert build_mcpb.manifest_drift(source, VERSION, tools, prompts) == [], \
        "run: python3 build_mcpb.py --sync-manifest"


# ==========================================================================================
# The official mcpb CLI
# ==========================================================================================

def test_committed_manifest_passes_mcpb_validate(mcpb_cli):
    r = subprocess.run(mcpb_cli + ["validate", os.path.join(ROOT, "manifest.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("flavor", ["python", "uv"])
def test_mcpb_validate_and_info(built, mcpb_cli, flavor, tmp_path):
    unpacked = tmp_path / "unpacked"
    r = subprocess.run(mcpb_cli + ["unpack", built[flavor], str(unpacked)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(mcpb_cli + ["validate", str(unpacked / "manifest.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "validation passes" in r.stdout
    r = subprocess.run(mcpb_cli + ["info", built[flavor]], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.basename(built[flavor]) in r.stdout


# ==========================================================================================
# Build failures and the other modes, on a copy of the tree
# ==========================================================================================

def copy_tree(dest, manifest_edit=None, icon=None):
    os.makedirs(dest, exist_ok=True)
    for name in ("build_mcpb.py", "manifest.json", "icon.png", "memshelf.py", "server.py",
                 "LICENSE"):
        shutil.copyfile(os.path.join(ROOT, name), os.path.join(dest, name))
    if manifest_edit:
        with open(os.path.join(dest, "manifest.json"), encoding="utf-8") as f:
            m = json.load(f)
        manifest_edit(m)
        with open(os.path.join(dest, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(m, f, indent=2)
    if icon is not None:
        with open(os.path.join(dest, "icon.png"), "wb") as f:
            f.write(icon)
    return dest


def bare_env():
    """No mcpb CLI and no npx: only the directory of this Python on PATH."""
    env = {"PATH": os.path.dirname(sys.executable), "HOME": os.environ.get("HOME", "/")}
    if os.name == "nt":
        env["SYSTEMROOT"] = os.environ.get("SYSTEMROOT", "")
    return env


def test_check_writes_nothing(tmp_path):
    tree = copy_tree(str(tmp_path / "tree"))
    r = run_build("--check", cwd=tree, env=bare_env(), script=os.path.join(tree, "build_mcpb.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "not written" in r.stdout
    assert not os.path.exists(os.path.join(tree, "dist"))
    assert "mcpb CLI not found" in r.stderr


def test_require_mcpb_fails_without_the_cli(tmp_path):
    tree = copy_tree(str(tmp_path / "tree"))
    r = run_build("--require-mcpb", "--out", str(tmp_path / "out"), cwd=tree, env=bare_env(),
                  script=os.path.join(tree, "build_mcpb.py"))
    assert r.returncode == 1
    assert "mcpb CLI is not installed" in r.stderr and "npm install" in r.stderr
    assert not os.path.exists(tmp_path / "out" / f"memshelf-{VERSION}.mcpb")


def test_build_names_every_manifest_problem(tmp_path):
    def spoil(m):
        m["colour"] = "blue"
        m["server"]["mcp_config"]["env"]["EXTRA"] = "${user_config.missing}"
        m["server"]["mcp_config"]["args"] = ["server.py"]
        m["user_config"]["unused"] = {"type": "string", "title": "Unused",
                                      "description": "reaches nothing"}
    tiny_png = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + \
        (32).to_bytes(4, "big") * 2 + bytes([8, 6, 0, 0, 0]) + b"\x00" * 4
    tree = copy_tree(str(tmp_path / "tree"), spoil, icon=tiny_png)
    r = run_build("--check", cwd=tree, env=bare_env(), script=os.path.join(tree, "build_mcpb.py"))
    assert r.returncode == 1
    for needle in ("'colour' is not allowed", "${user_config.missing}",
                   "do not reference the entry point", "user_config.unused never reaches",
                   "icon is 32x32"):
        assert needle in r.stderr, needle


def test_missing_entry_point_fails(tmp_path):
    tree = copy_tree(str(tmp_path / "tree"))
    os.remove(os.path.join(tree, "server.py"))
    r = run_build("--check", cwd=tree, env=bare_env(), script=os.path.join(tree, "build_mcpb.py"))
    assert r.returncode == 1 and "server.py is missing" in r.stderr


def test_plugin_without_adapter_writes_the_two_files_and_a_note(tmp_path):
    tree = copy_tree(str(tmp_path / "tree"))
    dest = tmp_path / "plugin"
    r = run_build("--plugin", str(dest), cwd=tree, env=bare_env(),
                  script=os.path.join(tree, "build_mcpb.py"))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(dest)) == ["README.md", "memshelf.py", "server.py"]
    assert "adapters/claude-code/" in (dest / "README.md").read_text()


def test_plugin_copies_the_adapter_and_stamps_the_version(tmp_path):
    tree = copy_tree(str(tmp_path / "tree"))
    adapter = os.path.join(tree, "adapters", "claude-code")
    for rel, text in ((".claude-plugin/plugin.json", '{"name": "memshelf", "version": "0"}'),
                      (".mcp.json", "{}"), ("hooks/run.py", "print()\n"),
                      ("hooks/__pycache__/run.cpython-311.pyc", "x")):
        os.makedirs(os.path.dirname(os.path.join(adapter, rel)), exist_ok=True)
        with open(os.path.join(adapter, rel), "w") as f:
            f.write(text)
    dest = tmp_path / "plugin"
    for _ in range(2):   # a second build replaces the first
        r = run_build("--plugin", str(dest), cwd=tree, env=bare_env(),
                      script=os.path.join(tree, "build_mcpb.py"))
        assert r.returncode == 0, r.stderr
    assert json.loads((dest / ".claude-plugin" / "plugin.json").read_text())["version"] == VERSION
    assert (dest / ".mcp.json").exists() and (dest / "hooks" / "run.py").exists()
    assert not (dest / "hooks" / "__pycache__").exists()
    assert (dest / "memshelf.py").read_bytes() == open(os.path.join(ROOT, "memshelf.py"),
                                                       "rb").read()
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    r = run_build("--plugin", str(other), cwd=tree, env=bare_env(),
                  script=os.path.join(tree, "build_mcpb.py"))
    assert r.returncode == 1 and (other / "keep.txt").exists()


# ==========================================================================================
# Installing and launching like Claude Desktop
# ==========================================================================================

def host_substitute(text, variables):
    """Claude Desktop's ${…} substitution: known names are replaced, others stay literal."""
    return re.sub(r"\$\{([^}]*)\}",
                  lambda m: variables.get(m.group(1), m.group(0)), text)


def install(bundle, where):
    """Unzip into a fresh extension folder and make it read-only, like an installed bundle."""
    ext = os.path.join(where, "extension")
    with zipfile.ZipFile(bundle) as zf:
        zf.extractall(ext)
    for dirpath, dirnames, filenames in os.walk(ext):
        for n in filenames:
            if not os.path.islink(os.path.join(dirpath, n)):   # never chmod through a symlink
                os.chmod(os.path.join(dirpath, n), 0o444)
        os.chmod(dirpath, 0o555)
    return ext


def make_writable(ext):
    for dirpath, dirnames, filenames in os.walk(ext):
        os.chmod(dirpath, 0o755)
        for n in filenames:
            if not os.path.islink(os.path.join(dirpath, n)):   # never chmod through a symlink
                os.chmod(os.path.join(dirpath, n), 0o644)


def host_launch(ext, home, shelf_setting=UNSET, path=None):
    """(argv, env) exactly as the host builds them from the installed manifest."""
    with open(os.path.join(ext, "manifest.json"), encoding="utf-8") as f:
        m = json.load(f)
    variables = {"__dirname": ext, "HOME": home, "DESKTOP": os.path.join(home, "Desktop"),
                 "DOCUMENTS": os.path.join(home, "Documents"),
                 "DOWNLOADS": os.path.join(home, "Downloads"), "pathSeparator": os.sep,
                 "/": os.sep}
    if shelf_setting is not UNSET:
        # as written: the host does not expand ${HOME} inside the setting's default
        variables["user_config.shelf"] = shelf_setting
    cfg = m["server"]["mcp_config"]
    over = (cfg.get("platform_overrides") or {}).get(PLATFORM, {})
    command = over.get("command", cfg["command"])
    args = over.get("args", cfg.get("args", []))
    env = dict(cfg.get("env") or {})
    env.update(over.get("env") or {})
    base = {"HOME": home, "PATH": path if path is not None else os.environ.get("PATH", "")}
    if os.name == "nt":
        base["SYSTEMROOT"] = os.environ.get("SYSTEMROOT", "")
    base.update({k: host_substitute(v, variables) for k, v in env.items()})
    exe = shutil.which(command, path=base["PATH"])
    if exe is None:
        pytest.skip(f"{command!r} is not on PATH, so the host could not start this bundle")
    return [exe] + [host_substitute(a, variables) for a in args], base, m


def bundle_files(ext):
    out = set()
    for dirpath, dirnames, filenames in os.walk(ext):
        for n in filenames:
            out.add(os.path.relpath(os.path.join(dirpath, n), ext))
    return out


@pytest.fixture
def installed(tmp_path, built):
    """Install a bundle into tmp_path; yields (ext, home) and restores write bits after."""
    made = []

    def _install(flavor):
        home = tmp_path / "home"
        home.mkdir(exist_ok=True)
        ext = install(built[flavor], str(tmp_path / flavor))
        made.append(ext)
        return ext, str(home)
    yield _install
    for ext in made:
        make_writable(ext)


def strict_client(argv, env, home):
    from mcp_client import McpClient
    return McpClient(argv, env=env, cwd=home, timeout=60)


def check_handshakes(argv, env, home, manifest):
    """initialize with each protocol version; the lists equal the manifest at every version."""
    for version in PROTOCOLS:
        client = strict_client(argv, env, home)
        try:
            result = client.initialize(version)
            assert result["protocolVersion"] == version
            assert result["serverInfo"]["version"] == VERSION
            assert result["instructions"].endswith("Default shelf: configured.")
            assert [t["name"] for t in client.list_tools()] == \
                [t["name"] for t in manifest["tools"]]
            assert [p["name"] for p in client.request("prompts/list")["prompts"]] == \
                [p["name"] for p in manifest["prompts"]]
            client.assert_clean()
        finally:
            assert client.close() == 0, client.stderr


def shelve_arguments(**extra):
    args = {"slug": SLUG, "kind": "topic", "digest": DIGEST,
            "sections": {"Decisions": "- JWT is verified once per request in middleware."}}
    args.update(extra)
    return args


def text_of(result):
    return "\n".join(b.get("text", "") for b in result["content"] if b.get("type") == "text")


def smoke_default_shelf(argv, env, home, manifest):
    """Case A: the default setting, a fresh home; the first write creates the shelf."""
    shelf = os.path.join(home, "memshelf")
    assert env["MEMSHELF_SHELF"] == "${HOME}/memshelf"     # expanded by the server itself
    check_handshakes(argv, env, home, manifest)
    client = strict_client(argv, env, home)
    try:
        client.initialize("2025-11-25")
        client.list_tools()
        before = client.call_tool("memshelf_index", {})
        assert not before.get("isError"), text_of(before)
        assert not os.path.exists(shelf)     # reading does not create the shelf
        shelved = client.call_tool("memshelf_shelve", shelve_arguments())
        assert not shelved.get("isError"), text_of(shelved)
        result = shelved["structuredContent"]
        assert result["status"] == "ok" and result["id"] == SLUG
        assert result["initialized"] is True
        assert os.path.realpath(result["initialized_path"]) == os.path.realpath(shelf)
        assert os.path.isfile(os.path.join(shelf, "shelf.yml"))
        if shutil.which("git", path=env["PATH"]):
            assert os.path.isdir(os.path.join(shelf, ".git"))     # git-local when git exists
        again = client.call_tool("memshelf_init", {})
        assert not again.get("isError"), text_of(again)
        index = client.call_tool("memshelf_index", {})
        assert not index.get("isError") and SLUG in index["structuredContent"]["index"]
        recall = client.call_tool("memshelf_recall", {"episode_id": SLUG, "section": "Decisions"})
        assert not recall.get("isError"), text_of(recall)
        content = recall["structuredContent"]["content"]
        assert content.startswith(f'<recalled-episode id="{SLUG}" section="Decisions"')
        assert "JWT is verified once per request" in content
        assert content.rstrip().endswith("</recalled-episode>")
        read = client.request("resources/read", {"uri": "memshelf://index"})
        assert SLUG in read["contents"][0]["text"]
        client.assert_clean()
    finally:
        assert client.close() == 0, client.stderr


def smoke_setting_cleared(argv, env, home, manifest):
    """Case B: the user cleared the setting; the host passes the placeholder text."""
    assert env["MEMSHELF_SHELF"] == "${user_config.shelf}"
    client = strict_client(argv, env, home)
    try:
        hello = client.initialize("2025-11-25")
        assert hello["instructions"].endswith("Default shelf: not configured — pass shelf_path.")
        assert [t["name"] for t in client.list_tools()] == [t["name"] for t in manifest["tools"]]
        failed = client.call_tool("memshelf_index", {})
        assert failed["isError"] is True and "structuredContent" not in failed
        assert "code: no-shelf" in text_of(failed) and "MEMSHELF_SHELF" in text_of(failed)
        missing = client.request_raw("resources/read", {"uri": "memshelf://index"})
        assert missing["error"]["code"] == -32002
        assert "MEMSHELF_SHELF" in missing["error"]["message"]
        explicit = os.path.join(home, "named-shelf")
        made = client.call_tool("memshelf_init", {"shelf_path": explicit})
        assert not made.get("isError"), text_of(made)
        shelved = client.call_tool("memshelf_shelve", shelve_arguments(shelf_path=explicit))
        assert not shelved.get("isError"), text_of(shelved)
        assert "initialized" not in shelved["structuredContent"]
        index = client.call_tool("memshelf_index", {"shelf_path": explicit})
        assert not index.get("isError") and SLUG in index["structuredContent"]["index"]
        client.assert_clean()
    finally:
        assert client.close() == 0, client.stderr
    assert not os.path.exists(os.path.join(home, "memshelf"))


def assert_bundle_untouched(ext, before, allowed=()):
    added = bundle_files(ext) - before
    stray = sorted(p for p in added if "__pycache__" not in p.split(os.sep)
                   and not any(p == a or p.startswith(a + os.sep) for a in allowed))
    assert stray == [], f"the server wrote into the bundle: {stray}"


def test_python_bundle_case_a_default_shelf(installed):
    ext, home = installed("python")
    before = bundle_files(ext)
    with open(os.path.join(ext, "manifest.json"), encoding="utf-8") as f:
        default = json.load(f)["user_config"]["shelf"]["default"]
    argv, env, manifest = host_launch(ext, home, default)
    assert os.path.basename(argv[0]).startswith("python")
    assert argv[1:] == [ext + "/server.py"]
    smoke_default_shelf(argv, env, home, manifest)
    assert_bundle_untouched(ext, before)


def test_python_bundle_case_b_setting_cleared(installed):
    ext, home = installed("python")
    argv, env, manifest = host_launch(ext, home)
    smoke_setting_cleared(argv, env, home, manifest)


def test_uv_bundle_launches_like_the_host(installed):
    ext, home = installed("uv")
    path = os.environ.get("PATH", "")
    if shutil.which("uv", path=path) is None:
        # `pip install uv` puts it next to this interpreter, which need not be on PATH (pyenv)
        import sysconfig
        scripts = sysconfig.get_path("scripts")
        if not scripts or shutil.which("uv", path=scripts) is None:
            pytest.skip("uv is not installed (pip install uv), so the uv bundle cannot be "
                        "launched; its manifest and pyproject are checked above")
        path = scripts + os.pathsep + path
    before = bundle_files(ext)
    with open(os.path.join(ext, "manifest.json"), encoding="utf-8") as f:
        default = json.load(f)["user_config"]["shelf"]["default"]
    argv, env, manifest = host_launch(ext, home, default, path=path)
    assert os.path.basename(argv[0]).startswith("uv")
    smoke_default_shelf(argv, env, home, manifest)
    # uv keeps its environment and lock next to pyproject.toml, inside the extension folder.
    assert_bundle_untouched(ext, before, allowed=(".venv", "uv.lock"))


# ==========================================================================================
# The same with the official MCP Python SDK client
# ==========================================================================================

def sdk_session(argv, env, home, steps):
    """Run `steps(session)` against the server through the SDK; skipped without the SDK."""
    mcp = pytest.importorskip("mcp")
    from mcp import StdioServerParameters
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=home)

    async def main():
        if hasattr(mcp, "Client"):        # SDK 2.x
            async with mcp.Client(params, mode="legacy") as client:
                return await steps(client)
        from mcp import ClientSession     # SDK 1.x
        from mcp.client.stdio import stdio_client
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await steps(session)
    return asyncio.run(main())


def dump(model):
    return model.model_dump(by_alias=True, exclude_none=True) if hasattr(model, "model_dump") \
        else model


def test_python_bundle_with_the_sdk_client(installed):
    ext, home = installed("python")
    with open(os.path.join(ext, "manifest.json"), encoding="utf-8") as f:
        default = json.load(f)["user_config"]["shelf"]["default"]
    argv, env, manifest = host_launch(ext, home, default)

    async def case_a(session):
        tools = dump(await session.list_tools())["tools"]
        assert [t["name"] for t in tools] == [t["name"] for t in manifest["tools"]]
        prompts = dump(await session.list_prompts())["prompts"]
        assert [p["name"] for p in prompts] == [p["name"] for p in manifest["prompts"]]
        shelved = dump(await session.call_tool("memshelf_shelve", shelve_arguments()))
        assert not shelved.get("isError"), shelved
        assert shelved["structuredContent"]["initialized"] is True
        index = dump(await session.call_tool("memshelf_index", {}))
        assert SLUG in index["structuredContent"]["index"]
        recall = dump(await session.call_tool("memshelf_recall",
                                              {"episode_id": SLUG, "section": "Decisions"}))
        assert recall["structuredContent"]["content"].startswith(f'<recalled-episode id="{SLUG}"')
        read = dump(await session.read_resource("memshelf://index"))
        assert SLUG in read["contents"][0]["text"]
    sdk_session(argv, env, home, case_a)

    argv, env, manifest = host_launch(ext, home)     # case B: the setting cleared

    async def case_b(session):
        failed = dump(await session.call_tool("memshelf_index", {}))
        assert failed["isError"] is True
        text = " ".join(b.get("text", "") for b in failed["content"])
        assert "no-shelf" in text and "MEMSHELF_SHELF" in text
        ok = dump(await session.call_tool("memshelf_index",
                                          {"shelf_path": os.path.join(home, "memshelf")}))
        assert not ok.get("isError") and SLUG in ok["structuredContent"]["index"]
    sdk_session(argv, env, home, case_b)


# ==========================================================================================
# The launch config from mcpb's own builder (what Claude Desktop calls), then the SDK client
# ==========================================================================================

MCPB_JS = os.path.join(ROOT, ".ci", "node", "node_modules", "@anthropic-ai", "mcpb", "dist",
                       "index.js")
MCPB_CONFIG = r"""
const [entry, ext, home, userConfig] = process.argv.slice(2);
const fs = require("fs"), path = require("path"), url = require("url");
import(url.pathToFileURL(entry).href).then(async (mcpb) => {
  const manifest = JSON.parse(fs.readFileSync(path.join(ext, "manifest.json"), "utf8"));
  const systemDirs = {HOME: home, DESKTOP: path.join(home, "Desktop"),
                      DOCUMENTS: path.join(home, "Documents"),
                      DOWNLOADS: path.join(home, "Downloads")};
  const config = await mcpb.getMcpConfigForManifest({manifest, extensionPath: ext, systemDirs,
      userConfig: JSON.parse(userConfig), pathSeparator: path.sep});
  process.stdout.write(JSON.stringify(config));
});
"""


def mcpb_launch(ext, home, user_config, where):
    """(argv, env) from mcpb's getMcpConfigForManifest; the env holds only HOME and PATH else."""
    node = shutil.which("node")
    if node is None or not os.path.isfile(MCPB_JS):
        pytest.skip("node or the mcpb package is missing (" + build_mcpb._MCPB_INSTALL + ")")
    script = os.path.join(where, "mcpb-config.cjs")
    with open(script, "w", encoding="utf-8") as f:
        f.write(MCPB_CONFIG)
    r = subprocess.run([node, script, MCPB_JS, ext, home, json.dumps(user_config)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    config = json.loads(r.stdout)
    env = {"HOME": home, "PATH": os.environ.get("PATH", "")}
    if os.name == "nt":
        env["SYSTEMROOT"] = os.environ.get("SYSTEMROOT", "")
    env.update(config.get("env") or {})
    exe = shutil.which(config["command"], path=env["PATH"])
    if exe is None:
        pytest.skip(f"{config['command']!r} is not on PATH, so the host could not start it")
    return [exe] + config["args"], env


@pytest.mark.parametrize("setting", ["default", "chosen", "cleared"])
def test_desktop_launch_from_mcpbs_config_builder(installed, tmp_path, setting):
    """The setting left at its default reaches the server as the literal ${HOME}/memshelf;
    the server expands it and the first shelve creates $HOME/memshelf."""
    ext, home = installed("python")
    chosen = os.path.join(home, "Documents", "chosen shelf")
    user_config = {"default": {}, "chosen": {"shelf": chosen}, "cleared": {"shelf": ""}}[setting]
    argv, env = mcpb_launch(ext, home, user_config, str(tmp_path))
    assert argv[1:] == [os.path.join(ext, "server.py")]
    expected = {"default": "${HOME}/memshelf", "chosen": chosen, "cleared": ""}[setting]
    assert env["MEMSHELF_SHELF"] == expected
    shelf = {"default": os.path.join(home, "memshelf"), "chosen": chosen, "cleared": None}[setting]

    async def steps(session):
        shelved = dump(await session.call_tool("memshelf_shelve", shelve_arguments()))
        index = dump(await session.call_tool("memshelf_index", {}))
        return shelved, index
    shelved, index = sdk_session(argv, env, home, steps)
    if shelf is None:
        text = " ".join(b.get("text", "") for b in shelved["content"])
        assert shelved["isError"] is True and "no-shelf" in text and "MEMSHELF_SHELF" in text
        assert not os.path.exists(os.path.join(home, "memshelf"))
        return
    assert not shelved.get("isError"), shelved
    assert shelved["structuredContent"]["initialized"] is True
    assert os.path.realpath(shelved["structuredContent"]["initialized_path"]) == \
        os.path.realpath(shelf)
    assert os.path.isfile(os.path.join(shelf, "docs", "topics", SLUG + ".md"))
    assert SLUG in index["structuredContent"]["index"]
    assert os.listdir(home) == [os.path.relpath(shelf, home).split(os.sep)[0]]
