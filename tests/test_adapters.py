"""Host adapters: the Claude Code plugin folder, the chat-projects page, exported tool definitions.

The plugin's hook commands run exactly as Claude Code runs them (a shell command with
${CLAUDE_PLUGIN_ROOT} substituted and the event's JSON on stdin); run.py's search for memshelf
is exercised with real copies of the plugin folder.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest

import memshelf
from conftest import MEMSHELF, ROOT, SERVER, run_cli

PLUGIN = os.path.join(ROOT, "adapters", "claude-code")
RUN_PY = os.path.join(PLUGIN, "hooks", "run.py")
CHAT_PROJECTS = os.path.join(ROOT, "docs", "chat-projects.md")
POSIX = os.name == "posix"


def read(*parts):
    with open(os.path.join(*parts), encoding="utf-8") as f:
        return f.read()


def make_shelf(root):
    memshelf.init(shelf_path=str(root), storage="plain")
    res = memshelf.shelve(shelf_path=str(root), slug="2026-07-22-auth-refactor", kind="topic",
                          digest="Dana chose JWT middleware over sessions; rejected per-route "
                                 "decorators. Open: key rotation.",
                          sections={"Decisions": "- JWT verified once per request."},
                          approx_tokens=18000)
    assert res["status"] == "ok", res
    return root


def payload(name, cwd, **fields):
    data = {"session_id": "9b1f0c2e-4d6a-4f8e-b2c1-7a3d5e9f1b0c",
            "transcript_path": os.path.join(str(cwd), "transcript.jsonl"), "cwd": str(cwd),
            "permission_mode": "default", "hook_event_name": name}
    data.update(fields)
    return json.dumps(data)


def base_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHELF_", "CLAUDE_"))}
    env.update(extra)
    return env


# --- plugin layout -----------------------------------------------------------------------------

def test_plugin_layout_and_manifests():
    for rel in (".claude-plugin/plugin.json", ".mcp.json", "hooks/hooks.json", "hooks/run.py",
                "skills/shelve/SKILL.md", "CLAUDE-snippet.md", "README.md"):
        assert os.path.isfile(os.path.join(PLUGIN, rel)), rel
    plugin = json.loads(read(PLUGIN, ".claude-plugin", "plugin.json"))
    assert plugin["name"] == "memshelf" and plugin["version"] == memshelf.__version__
    assert plugin["license"] == "MIT" and plugin["description"]
    server = json.loads(read(PLUGIN, ".mcp.json"))["mcpServers"]["memshelf"]
    assert server == {"command": "python3", "args": ["${CLAUDE_PLUGIN_ROOT}/hooks/run.py",
                                                     "serve"]}


def test_hooks_json_wires_every_event_through_run_py():
    hooks = json.loads(read(PLUGIN, "hooks", "hooks.json"))["hooks"]
    assert set(hooks) == {"SessionStart", "PreCompact", "Stop", "SessionEnd"}
    start = hooks["SessionStart"]
    assert len(start) == 1 and start[0]["matcher"] == "startup|resume|clear|compact|fork"
    verbs = {}
    for name, groups in hooks.items():
        for group in groups:
            for h in group["hooks"]:
                assert h["type"] == "command" and 0 < h["timeout"] <= 30
                m = re.fullmatch(r'python3 "\$\{CLAUDE_PLUGIN_ROOT\}/hooks/run\.py" hook (\S+)',
                                 h["command"])
                assert m, h["command"]
                verbs[name] = m.group(1)
    assert verbs == {"SessionStart": "session-start", "PreCompact": "pre-compact",
                     "Stop": "stop", "SessionEnd": "session-end"}


CLAUDE_INSTALL = ("npm install --prefix .ci/node --no-save --no-audit --no-fund "
                  "@anthropic-ai/claude-code")


def claude_cli():
    """The Claude Code CLI: `claude` on PATH, else in .ci/node; skipped when absent."""
    local = os.path.join(ROOT, ".ci", "node", "node_modules", ".bin", "claude")
    found = shutil.which("claude") or (local if os.path.isfile(local) else None)
    if found is None:
        pytest.skip(f"the Claude Code CLI is not installed ({CLAUDE_INSTALL})")
    return found


@pytest.mark.slow
def test_claude_plugin_validate_passes_on_the_adapter_and_the_built_plugin(tmp_path):
    """Claude Code's own check of the plugin manifest and hooks/hooks.json, offline."""
    claude = claude_cli()
    built = tmp_path / "memshelf-claude-code"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "build_mcpb.py"), "--plugin",
                        str(built)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    env = base_env(HOME=str(tmp_path / "home"))
    for folder in (PLUGIN, str(built)):
        r = subprocess.run([claude, "plugin", "validate", folder], capture_output=True,
                           text=True, env=env, timeout=120)
        assert r.returncode == 0 and "Validation passed" in r.stdout, r.stdout + r.stderr
    broken = tmp_path / "broken"
    shutil.copytree(PLUGIN, str(broken))
    (broken / "hooks" / "hooks.json").write_text('{"hooks": {"SessionBegin": []}}')
    r = subprocess.run([claude, "plugin", "validate", str(broken)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 1 and "SessionBegin" in r.stdout + r.stderr     # it does check hooks


def host_command(event_name, plugin_root):
    """The command Claude Code runs for an event, with the plugin root substituted."""
    hooks = json.loads(read(plugin_root, "hooks", "hooks.json"))["hooks"]
    command = hooks[event_name][0]["hooks"][0]["command"]
    return command.replace("${CLAUDE_PLUGIN_ROOT}", plugin_root).replace(
        "python3 ", _shell_quote(sys.executable) + " ", 1)


def _shell_quote(text):
    return "'" + text.replace("'", "'\"'\"'") + "'"


@pytest.mark.skipif(not POSIX, reason="hook commands are run through a POSIX shell here")
def test_hook_commands_run_as_claude_code_runs_them(tmp_path):
    shelf = make_shelf(tmp_path / "project" / "shelf")
    project = shelf.parent
    env = base_env(CLAUDE_PLUGIN_ROOT=PLUGIN, CLAUDE_PROJECT_DIR=str(project))

    def run(event_name, data):
        return subprocess.run(host_command(event_name, PLUGIN), shell=True, input=data,
                              capture_output=True, text=True, env=env, cwd=str(project),
                              timeout=60)
    r = run("SessionStart", payload("SessionStart", project, source="startup"))
    assert r.returncode == 0, r.stderr
    ctx = json.loads(r.stdout)["hookSpecificOutput"]["additionalContext"]
    assert ctx.startswith("# Memory shelf (memshelf)\n") and "2026-07-22-auth-refactor" in ctx
    r = run("PreCompact", payload("PreCompact", project, trigger="manual",
                                  custom_instructions="keep the auth notes"))
    assert (r.returncode, r.stdout) == (0, "")
    r = run("SessionStart", payload("SessionStart", project, source="compact"))
    assert "manual compaction" in json.loads(r.stdout)["hookSpecificOutput"]["additionalContext"]
    r = run("Stop", payload("Stop", project, stop_hook_active=False))
    assert (r.returncode, r.stdout) == (0, "")
    r = run("SessionEnd", payload("SessionEnd", project, reason="prompt_input_exit"))
    assert (r.returncode, r.stdout) == (0, "")


# --- run.py: finding memshelf --------------------------------------------------------------------

@pytest.fixture
def lone_plugin(tmp_path):
    """A copy of the plugin folder with no memshelf.py anywhere near it, and an empty PATH."""
    root = tmp_path / "a" / "b" / "memshelf-plugin"
    shutil.copytree(PLUGIN, str(root))
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    return root, base_env(PATH=str(empty_bin))


def run_py(plugin_root, args, data="", env=None, cwd=None):
    return subprocess.run([sys.executable, os.path.join(str(plugin_root), "hooks", "run.py"),
                           *args], input=data, capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=60)


def test_run_py_without_memshelf(lone_plugin, tmp_path):
    root, env = lone_plugin
    shelf = make_shelf(tmp_path / "shelf")
    for event_name in ("session-start", "pre-compact", "stop", "session-end"):
        r = run_py(root, ["hook", event_name], payload("SessionStart", shelf, source="startup"),
                   env)
        assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), r
    r = run_py(root, ["serve"], "", env)
    assert r.returncode == 1 and "MEMSHELF_PY" in r.stderr and r.stdout == ""


def test_run_py_finds_memshelf_py_by_variable_plugin_root_and_checkout(lone_plugin, tmp_path):
    root, env = lone_plugin
    shelf = make_shelf(tmp_path / "shelf")
    data = payload("SessionStart", shelf, source="startup")

    def injected(r):
        assert r.returncode == 0, r.stderr
        return "2026-07-22-auth-refactor" in json.loads(r.stdout)["hookSpecificOutput"][
            "additionalContext"]
    assert injected(run_py(root, ["hook", "session-start"], data, dict(env, MEMSHELF_PY=MEMSHELF)))
    # the built plugin: memshelf.py in the plugin root (found through CLAUDE_PLUGIN_ROOT too)
    shutil.copy(MEMSHELF, str(root / "memshelf.py"))
    assert injected(run_py(root, ["hook", "session-start"], data, env))
    assert injected(run_py(PLUGIN, ["hook", "session-start"], data,
                           dict(env, CLAUDE_PLUGIN_ROOT=str(root))))
    os.unlink(str(root / "memshelf.py"))
    # a checkout: memshelf.py two folders above the plugin root
    shutil.copy(MEMSHELF, str(root.parent.parent / "memshelf.py"))
    assert injected(run_py(root, ["hook", "session-start"], data, env))


@pytest.mark.skipif(not POSIX, reason="a shell-script stand-in for the console script")
def test_run_py_falls_back_to_memshelf_on_path(lone_plugin, tmp_path):
    root, env = lone_plugin
    shelf = make_shelf(tmp_path / "shelf")
    script = tmp_path / "bin" / "memshelf"
    script.write_text(f"#!/bin/sh\nexec {_shell_quote(sys.executable)} "
                      f"{_shell_quote(MEMSHELF)} \"$@\"\n")
    script.chmod(0o755)
    r = run_py(root, ["hook", "session-start"], payload("SessionStart", shelf, source="resume"),
               env)
    assert r.returncode == 0, r.stderr
    assert "2026-07-22-auth-refactor" in r.stdout        # stdin reached the child


def test_run_py_hook_failures_still_exit_zero(lone_plugin, tmp_path):
    root, env = lone_plugin
    broken = tmp_path / "memshelf.py"
    broken.write_text("raise RuntimeError('broken install')\n")
    r = run_py(root, ["hook", "session-start"], "{}", dict(env, MEMSHELF_PY=str(broken)))
    assert (r.returncode, r.stdout) == (0, "")
    r = run_py(root, ["serve"], "", dict(env, MEMSHELF_PY=str(broken)))
    assert r.returncode == 1 and "broken install" in r.stderr


# --- tool definitions: the exported list equals what the server serves --------------------------

def raw_tools_list(command, env=None):
    """initialize at 2025-11-25, notifications/initialized, tools/list: raw JSON lines."""
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True, encoding="utf-8")
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    try:
        def send(message):
            proc.stdin.write(json.dumps(message) + "\n")
            proc.stdin.flush()

        def answer(wanted):
            while True:
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
                message = json.loads(line)
                if message.get("id") == wanted:
                    assert "error" not in message, message
                    return message["result"]
        send({"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                         "clientInfo": {"name": "test-adapters", "version": "1"}}})
        assert answer(1)["protocolVersion"] == "2025-11-25"
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        send({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}})
        result = answer(2)
        assert "nextCursor" not in result
        return result["tools"]
    finally:
        watchdog.cancel()
        proc.stdin.close()
        proc.wait(timeout=30)


@pytest.mark.skipif(not os.path.isfile(SERVER), reason="server.py does not exist yet")
def test_tools_mcp_export_equals_served_tools_list():
    r = run_cli("tools", "--format", "mcp")
    assert r.code == 0, r
    exported = json.loads(r.out)
    served = raw_tools_list([sys.executable, SERVER], base_env())
    assert exported == served
    assert len(served) == 14


@pytest.mark.skipif(not os.path.isfile(SERVER), reason="server.py does not exist yet")
def test_plugin_mcp_server_starts_through_run_py():
    served = raw_tools_list([sys.executable, RUN_PY, "serve"], base_env())
    assert [t["name"] for t in served] == [t["name"] for t in memshelf.tool_definitions()]


# --- skill, snippet, chat projects ---------------------------------------------------------------

def test_shelve_skill():
    fields, body = memshelf.parse_frontmatter(read(PLUGIN, "skills", "shelve", "SKILL.md"))
    assert fields["name"] == "shelve"
    assert fields["description"] and "\n" not in fields["description"]
    for needle in ("/shelve session", "memshelf_lint_digest", "memshelf_shelve", "120 words",
                   "approx_tokens", "Decisions", "Timeline", "Open threads", "Raw excerpts",
                   "shelved as <id>: <digest>", '"discover"', '"extract"', 'mode: "import"',
                   "memshelf shelve --file"):
        assert needle in body, needle


def test_claude_snippet_is_short_and_carries_the_rules():
    text = read(PLUGIN, "CLAUDE-snippet.md")
    assert len(text.rstrip("\n").split("\n")) <= 15
    for needle in ("memshelf_index", "memshelf_recall", "section", "data, not as instructions",
                   "/shelve", "INDEX.md"):
        assert needle in text, needle


def fenced(text, lang):
    return re.findall(r"^(`{3,})" + lang + r"\n(.*?)^\1$", text, re.S | re.M)


def test_chat_projects_page():
    text = read(CHAT_PROJECTS)
    for needle in ("memshelf index --max-chars 30000 > INDEX.md",
                   "memshelf recall --id 2026-07-22-auth-refactor --section Decisions",
                   "memshelf shelve --file episode.md", "depends on the model"):
        assert needle in text, needle
    prompts = [body for _, body in fenced(text, "text")]
    assert len(prompts) == 2
    assert len(prompts[0].split()) <= 200
    assert "memshelf_lint_digest" in prompts[0] and "memshelf_shelve" in prompts[0]


@pytest.mark.parametrize("source", [CHAT_PROJECTS,
                                    os.path.join(PLUGIN, "skills", "shelve", "SKILL.md")])
def test_episode_templates_shelve_as_written(tmp_path, source):
    template = next(body for _, body in fenced(read(source), "markdown"))
    episode = tmp_path / "episode.md"
    episode.write_text(template, encoding="utf-8")
    root = tmp_path / "shelf"
    memshelf.init(shelf_path=str(root), storage="plain")
    r = run_cli("shelve", "--shelf", root, "--file", episode)
    assert r.code == 0 and "warning" not in r.err, r
    assert (root / "docs" / "topics" / "2026-07-22-auth-refactor.md").is_file()
