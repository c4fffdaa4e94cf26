"""server.py driven by the official MCP Python SDK client (test-only dependency: `mcp`).

The SDK checks what a real host checks: result shapes per protocol version, structuredContent
against each tool's outputSchema, and (in its `auto` mode) the server/discover negotiation of the
stateless 2026-07-28 era with fallback to initialize.
"""

import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.slow

mcp = pytest.importorskip("mcp", reason="the MCP Python SDK is not installed (pip install mcp)")
anyio = pytest.importorskip("anyio")

try:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters
    from mcp.shared.exceptions import MCPError
except ImportError as exc:      # an SDK older than the unified Client
    pytest.skip(f"this MCP SDK has no unified Client: {exc}", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SERVER = os.path.join(ROOT, "server.py")
MEMSHELF = os.path.join(ROOT, "memshelf.py")
PYCACHE = os.path.join(tempfile.gettempdir(), "memshelf-test-pycache")
DIGEST = ("Dana chose JWT middleware over server sessions; per-route decorators were rejected. "
          "Open: the key rotation schedule, owned by Dana.")
TOOL_NAMES = ["memshelf_index", "memshelf_recall", "memshelf_search", "memshelf_shelve",
              "memshelf_lint_digest", "memshelf_stats", "memshelf_advise", "memshelf_import",
              "memshelf_init", "memshelf_rebuild", "memshelf_rollup", "memshelf_purge",
              "memshelf_resolve", "memshelf_doctor"]


def _modes():
    """The connect modes this SDK offers: legacy always; auto and 2026-07-28 when present."""
    fields = getattr(Client, "__dataclass_fields__", {})
    if "mode" not in fields:
        return [("legacy", None), ("auto", "this SDK's Client has no mode= (no modern era)"),
                ("2026-07-28", "this SDK's Client has no mode= (no modern era)")]
    try:
        from mcp_types.version import MODERN_PROTOCOL_VERSIONS
    except ImportError:
        MODERN_PROTOCOL_VERSIONS = ()
    modern = None if "2026-07-28" in MODERN_PROTOCOL_VERSIONS else \
        "this SDK does not speak protocol 2026-07-28"
    return [("legacy", None), ("auto", modern), ("2026-07-28", modern)]


MODES = _modes()


def mode_kwargs(mode):
    return {"mode": mode} if "mode" in getattr(Client, "__dataclass_fields__", {}) else {}


def server_params(cwd, **env):
    base = {"PYTHONPYCACHEPREFIX": PYCACHE, "GIT_AUTHOR_NAME": "Test",
            "GIT_AUTHOR_EMAIL": "test@example.com", "GIT_COMMITTER_NAME": "Test",
            "GIT_COMMITTER_EMAIL": "test@example.com", "PATH": os.environ.get("PATH", "")}
    base.update(env)
    return StdioServerParameters(command=sys.executable, args=[SERVER], env=base, cwd=str(cwd))


def text_of(result):
    return "\n".join(getattr(b, "text", "") for b in result.content)


def check_schema(schema):
    try:
        from jsonschema import Draft202012Validator
    except ImportError:
        return      # no validator installed: the SDK's own checks still run
    Draft202012Validator.check_schema(schema)


async def scenario(mode, tmp_path):
    shelf = str(tmp_path / f"shelf-{mode}")
    slug = "2026-07-22-auth-middleware"
    async with Client(server_params(tmp_path, MEMSHELF_SHELF=shelf), **mode_kwargs(mode)) as client:
        expected = "2025-11-25" if mode == "legacy" else "2026-07-28"
        assert client.protocol_version == expected
        if mode != "2026-07-28":        # a pinned mode adopts a synthesized discover result
            assert client.instructions and len(client.instructions) <= 1000
            assert client.instructions.endswith("Default shelf: configured.")
        listed = await client.list_tools()
        assert [t.name for t in listed.tools] == TOOL_NAMES
        for tool in listed.tools:
            assert tool.input_schema["type"] == "object"
            check_schema(tool.input_schema)
            assert tool.output_schema is not None
            check_schema(tool.output_schema)

        # the SDK validates structuredContent against outputSchema on every call below
        init = await client.call_tool("memshelf_init", {})
        assert not init.is_error, text_of(init)
        shelved = await client.call_tool("memshelf_shelve", {
            "slug": slug, "kind": "topic", "digest": DIGEST,
            "sections": {"Decisions": "- JWT verified once per request.",
                         "Open threads": "- Key rotation (Dana)."}})
        assert not shelved.is_error, text_of(shelved)
        index = await client.call_tool("memshelf_index", {})
        assert not index.is_error and slug in text_of(index)
        assert index.structured_content["index"] == text_of(index)
        recalled = await client.call_tool("memshelf_recall",
                                          {"episode_id": slug, "section": "Decisions"})
        assert not recalled.is_error
        assert "<recalled-episode" in text_of(recalled) and "JWT verified" in text_of(recalled)
        lint = await client.call_tool("memshelf_lint_digest", {"digest": DIGEST})
        assert not lint.is_error
        bad = await client.call_tool("memshelf_recall", {"episode_id": "2020-01-01-none"})
        assert bad.is_error and bad.structured_content is None
        assert "code: episode-not-found" in text_of(bad)
        usage = await client.call_tool("memshelf_index", {"bogus": True})
        assert usage.is_error and "code: usage" in text_of(usage)

        steps = []

        async def on_progress(progress, total, message):
            steps.append(progress)
        rebuilt = await client.call_tool("memshelf_rebuild", {}, progress_callback=on_progress)
        assert not rebuilt.is_error, text_of(rebuilt)
        assert steps == sorted(set(steps))

        resources = await client.list_resources()
        uris = [str(r.uri) for r in resources.resources]
        assert uris[0] == "memshelf://index"
        if len(uris) > 1:               # episodes are listed once memshelf.list_episodes exists
            assert f"memshelf://episode/{slug}" in uris
        templates = await client.list_resource_templates()
        assert [t.uri_template for t in templates.resource_templates] == [
            "memshelf://episode/{id}", "memshelf://episode/{id}/{section}"]
        read = await client.read_resource("memshelf://index")
        assert slug in read.contents[0].text and read.contents[0].mime_type == "text/markdown"
        section = await client.read_resource(f"memshelf://episode/{slug}/open-threads")
        assert "Key rotation" in section.contents[0].text
        assert section.contents[0].text.startswith("<recalled-episode")
        with pytest.raises(MCPError) as missing:
            await client.read_resource("memshelf://episode/2020-01-01-none")
        assert missing.value.error.code == (-32002 if mode == "legacy" else -32602)

        prompts = await client.list_prompts()
        assert [p.name for p in prompts.prompts] == ["shelve", "recall", "close-session"]
        got = await client.get_prompt("recall", {"question": "Which auth scheme won?"})
        assert got.messages[0].role == "user"
        assert "Which auth scheme won?" in got.messages[0].content.text
        with pytest.raises(MCPError) as no_question:
            await client.get_prompt("recall", {})
        assert no_question.value.error.code == -32602
        with pytest.raises(MCPError) as no_tool:
            await client.call_tool("memshelf_nope", {})
        assert no_tool.value.error.code == -32602

        # an amend keeps what it is not given and says what changed (issue 18)
        amended = await client.call_tool("memshelf_shelve", {
            "slug": slug, "kind": "topic", "digest": DIGEST, "amend": True,
            "sections": {"Decisions": "- JWT verified once, in the middleware."},
            "drop_sections": ["Open threads"]})
        assert not amended.is_error, text_of(amended)
        report = amended.structured_content
        assert report["changed"] == {"fields": [], "sections": ["Decisions"],
                                     "dropped": ["Open threads"]}
        assert "agent" in report["kept"]["fields"]    # the author stays on amend


@pytest.mark.parametrize("mode, skip_reason", MODES, ids=[m for m, _ in MODES])
def test_sdk_client(tmp_path, mode, skip_reason):
    if skip_reason:
        pytest.skip(skip_reason)
    anyio.run(scenario, mode, tmp_path)


async def unset_default(tmp_path):
    shelf = str(tmp_path / "explicit")
    subprocess.run([sys.executable, MEMSHELF, "init", "--shelf", shelf], check=True,
                   stdout=subprocess.DEVNULL, env=dict(os.environ, GIT_AUTHOR_NAME="Test",
                                                      GIT_AUTHOR_EMAIL="test@example.com",
                                                      GIT_COMMITTER_NAME="Test",
                                                      GIT_COMMITTER_EMAIL="test@example.com"))
    params = server_params(tmp_path, MEMSHELF_SHELF="${user_config.shelf}")
    async with Client(params, **mode_kwargs("legacy")) as client:
        assert client.instructions.endswith("Default shelf: not configured — pass shelf_path.")
        result = await client.call_tool("memshelf_index", {})
        assert result.is_error
        assert "code: no-shelf" in text_of(result) and "MEMSHELF_SHELF" in text_of(result)
        works = await client.call_tool("memshelf_index", {"shelf_path": shelf})
        assert not works.is_error
        assert (await client.list_resources()).resources == []


def test_sdk_client_without_a_default_shelf(tmp_path):
    anyio.run(unset_default, tmp_path)
