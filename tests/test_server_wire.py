"""server.py on the raw wire: framing, the JSON-RPC rules, lifecycle, versions, eras, tools,
resources, prompts, logging, progress, cancellation and the default shelf (server.py).

Every test drives the real server as a subprocess through tests/mcp_client.py and real shelves
made with `python3 memshelf.py init --shelf DIR`.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SERVER = os.path.join(ROOT, "server.py")
MEMSHELF = os.path.join(ROOT, "memshelf.py")
sys.path.insert(0, HERE)

from mcp_client import McpClient, clean_env, schema_problems, validate  # noqa: E402
from conftest import copy_of_template  # noqa: E402

VERSIONS = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"]
MODERN = "2026-07-28"
TOOLS = [  # name, title, readOnly, destructive, idempotent, openWorld (docs/tools.md)
    ("memshelf_index", "Read the shelf INDEX", True, False, True, False),
    ("memshelf_recall", "Recall an episode or one section", True, False, True, False),
    ("memshelf_search", "Search the shelf", True, False, True, False),
    ("memshelf_shelve", "Shelve a closed topic", False, False, True, True),
    ("memshelf_lint_digest", "Check a digest, writing nothing", True, False, True, False),
    ("memshelf_stats", "Token accounting", True, False, True, False),
    ("memshelf_advise", "Where did the context window go?", True, False, True, False),
    ("memshelf_import", "Prepare an exported transcript", False, False, True, False),
    ("memshelf_init", "Create or complete a shelf", False, False, True, False),
    ("memshelf_rebuild", "Regenerate derived files", False, False, True, False),
    ("memshelf_rollup", "Fold a period into one rollup", False, False, False, False),
    ("memshelf_purge", "Delete episodes past retain_until", False, True, True, False),
    ("memshelf_resolve", "Finish a shelf merge", False, False, True, False),
    ("memshelf_doctor", "Check shelf integrity", True, False, True, True),
]
DIGEST = ("Dana chose JWT middleware over server sessions; per-route decorators were rejected. "
          "Open: the key rotation schedule, owned by Dana.")
PYCACHE = os.path.join(tempfile.gettempdir(), "memshelf-test-pycache")


# --- helpers -------------------------------------------------------------------------------

def server_env(**extra):
    """The environment for a spawned server: no MEMSHELF_* leaking in, a git identity."""
    env = clean_env(**extra)
    # Bytecode cached outside the repository only makes spawns faster.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = PYCACHE
    for key, value in (("GIT_AUTHOR_NAME", "Test"), ("GIT_AUTHOR_EMAIL", "test@example.com"),
                       ("GIT_COMMITTER_NAME", "Test"),
                       ("GIT_COMMITTER_EMAIL", "test@example.com")):
        env.setdefault(key, value)
    return env


def spawn(tmp_path=None, **env):
    return McpClient([sys.executable, SERVER], env=server_env(**env),
                     cwd=str(tmp_path) if tmp_path else None)


def make_shelf(path):
    subprocess.run([sys.executable, MEMSHELF, "init", "--shelf", str(path)], check=True,
                   env=server_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return str(path)


def text_of(result):
    return "\n".join(b["text"] for b in result["content"] if b["type"] == "text")


def shelve_args(slug, **extra):
    args = {"slug": slug, "kind": "topic", "digest": DIGEST,
            "sections": {"Decisions": "- JWT verified once per request in the middleware."}}
    args.update(extra)
    return args


def modern_meta(version=MODERN, **extra):
    meta = {"io.modelcontextprotocol/protocolVersion": version,
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "modern-test", "version": "1"}}
    meta.update(extra)
    return meta


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the tests that leave no state behind (2025-11-25, no default shelf)."""
    c = spawn(tmp_path_factory.mktemp("shared"))
    c.initialize()
    c.list_tools()
    yield c
    assert c.close() == 0


@pytest.fixture
def client(shared):
    """The shared server with a fresh record; still healthy and protocol-clean afterwards."""
    shared.reset()
    yield shared
    shared.assert_clean()
    assert shared.request("ping", rid="teardown-ping") == {}


@pytest.fixture(scope="module")
def shelf(tmp_path_factory):
    """A shelf for tests that only read it (or regenerate its derived files)."""
    return make_shelf(tmp_path_factory.mktemp("read-shelf") / "shelf")


@pytest.fixture
def fresh_shelf(tmp_path, tmp_path_factory):
    """A shelf of this test's own, for tests that write episodes (one init, copied)."""
    return str(copy_of_template(tmp_path_factory, tmp_path / "shelf", "wire", make_shelf))


# --- process: --version, EOF, watchdog, SIGTERM ----------------------------------------------

def test_version_flag():
    out = subprocess.run([sys.executable, SERVER, "--version"], capture_output=True, text=True,
                         env=server_env(), timeout=30)
    assert out.returncode == 0
    assert re.fullmatch(r"memshelf-mcp \d+\.\d+\.\d+\S* \([0-9a-f]{12}\)\n", out.stdout)


def test_unknown_argument_is_a_usage_error():
    out = subprocess.run([sys.executable, SERVER, "--bogus"], capture_output=True, text=True,
                         env=server_env(), timeout=30)
    assert out.returncode == 2 and out.stdout == ""


def test_memshelf_serve_runs_this_server(tmp_path):
    c = McpClient([sys.executable, MEMSHELF, "serve"], env=server_env(), cwd=str(tmp_path))
    assert c.initialize()["serverInfo"]["name"] == "memshelf"
    assert len(c.list_tools()) == 14
    c.assert_clean()
    assert c.close() == 0


def test_eof_exits_zero(tmp_path):
    c = spawn(tmp_path)
    c.initialize()
    assert c.request("ping") == {}
    assert c.close() == 0
    c.assert_clean()


def test_eof_before_anything_exits_zero(tmp_path):
    c = spawn(tmp_path)
    assert c.close() == 0
    assert c.lines == []


@pytest.mark.slow
def test_watchdog_exits_3_without_initialize(tmp_path):
    c = spawn(tmp_path, MEMSHELF_HANDSHAKE_TIMEOUT="1")
    assert c.proc.wait(30) == 3
    assert "MEMSHELF_HANDSHAKE_TIMEOUT" in c.stderr
    c.assert_clean()


@pytest.mark.slow
def test_watchdog_disarmed_by_initialize_or_a_modern_request(tmp_path):
    classic = spawn(tmp_path, MEMSHELF_HANDSHAKE_TIMEOUT="1")
    modern = spawn(tmp_path, MEMSHELF_HANDSHAKE_TIMEOUT="1")
    classic.initialize()
    modern.request("server/discover", {"_meta": modern_meta()})
    with pytest.raises(subprocess.TimeoutExpired):
        classic.proc.wait(2)
    assert modern.proc.poll() is None
    assert classic.request("ping") == {}
    assert "tools" in modern.request("tools/list", {"_meta": modern_meta()})
    for c in (classic, modern):
        c.assert_clean()
        assert c.close() == 0


@pytest.mark.skipif(os.name != "posix", reason="SIGTERM delivery is POSIX")
def test_sigterm_exits_zero(tmp_path):
    c = spawn(tmp_path)
    c.initialize()
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(30) == 0
    c.assert_clean()


def test_startup_line_on_stderr(tmp_path):
    c = spawn(tmp_path)
    c.initialize()
    assert c.close() == 0
    assert re.search(r"^memshelf-mcp: info: memshelf-mcp \S+ \([0-9a-f]{12}\).*default shelf: "
                     r"not configured", c.stderr, re.M)
    assert all(line.startswith("memshelf-mcp: ") for line in c.stderr.splitlines())


# --- framing -------------------------------------------------------------------------------

def test_every_line_is_one_compact_message(client):
    client.list_tools()
    client.request("prompts/list")
    client.request("ping", rid="s")
    for line in client.lines:
        msg = json.loads(line)
        assert line == json.dumps(msg, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def test_crlf_and_blank_lines(client):
    client.expect_id(1000000041)
    client.send_raw(b"\n\r\n   \n" + b'{"jsonrpc":"2.0","id":1000000041,"method":"ping"}\r\n')
    assert client.wait_response(1000000041)["result"] == {}
    assert client.null_id_errors() == []


def test_id_type_is_echoed(client):
    assert client.request_raw("ping", rid="7")["id"] == "7"
    assert client.request_raw("ping", rid=7)["id"] == 7
    assert client.request_raw("ping", rid=0)["id"] == 0
    assert client.request_raw("ping", rid=-3)["id"] == -3
    assert client.request_raw("ping", rid="")["id"] == ""


def test_pipelined_requests_answered_in_order(client):
    ids = list(range(2000000100, 2000000130))
    methods = ["ping", "tools/list", "prompts/list", "resources/templates/list", "resources/list"]
    lines = b"".join(json.dumps({"jsonrpc": "2.0", "id": i, "method": methods[i % 5]}).encode() +
                     b"\n" for i in ids)
    for i in ids:
        client.expect_id(i)
    client.send_raw(lines)
    for i in ids:
        client.wait_response(i)
    order = [json.loads(l).get("id") for l in client.lines]
    order = [i for i in order if isinstance(i, int) and i >= ids[0]]
    assert order == ids


# --- the JSON-RPC rules table --------------------------------------------------------------

@pytest.mark.parametrize("line", [
    b"not json", b"{", b'{"jsonrpc":"2.0","id":1,"method":"ping"} trailing',
    b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":NaN}}',
    b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":Infinity}}',
    b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":-Infinity}}',
    b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":' + b"9" * 4301 + b"}}",
    b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":1e400}}',
])
def test_parse_errors(client, line):
    client.send_raw(line + b"\n")
    error = client.wait_null_id_errors(1)[0]["error"]
    assert error["code"] == -32700
    assert client.request("ping") == {}


def nested(depth):
    """A ping whose message nests exactly `depth` containers (the message object is 1)."""
    inner = "[" * (depth - 2) + "]" * (depth - 2)
    return ('{"jsonrpc":"2.0","id":"deep","method":"ping","params":{"x":%s}}' % inner).encode()


def test_nesting_limit(client):
    client.expect_id("deep")
    client.send_raw(nested(512) + b"\n")
    assert client.wait_response("deep")["result"] == {}
    client.send_raw(nested(513) + b"\n")
    assert client.wait_null_id_errors(1)[0]["error"]["code"] == -32700
    client.send_raw(b"[" * 200000 + b"]" * 200000 + b"\n")
    assert client.wait_null_id_errors(2)[1]["error"]["code"] == -32700
    assert client.request("ping") == {}


def test_big_integer_within_limit_is_fine(client):
    client.expect_id(1000000905)
    client.send_raw(b'{"jsonrpc":"2.0","id":1000000905,"method":"ping","params":{"x":' +
                    b"9" * 4300 + b"}}\n")
    assert client.wait_response(1000000905)["result"] == {}


@pytest.mark.parametrize("message, echoed", [
    ({"id": 1000000901, "method": "ping"}, 1000000901),                 # no jsonrpc
    ({"jsonrpc": "1.0", "id": "a", "method": "ping"}, "a"),             # wrong jsonrpc
    ({"jsonrpc": 2.0, "id": 1000000902, "method": "ping"}, 1000000902),
    ({"jsonrpc": "2.0", "id": 1000000903, "method": 42}, 1000000903),   # method not a string
    ({"jsonrpc": "2.0", "id": 1000000904}, 1000000904),                 # no method
    ({"jsonrpc": "2.0", "id": None, "method": "ping"}, None),
    ({"jsonrpc": "2.0", "id": True, "method": "ping"}, None),
    ({"jsonrpc": "2.0", "id": 1.5, "method": "ping"}, None),
    ({"jsonrpc": "2.0", "id": 2.0, "method": "ping"}, None),
    ({"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}, None),
    ({"jsonrpc": "2.0", "id": [1], "method": "ping"}, None),
    ({"jsonrpc": "2.0", "method": 7}, None),                            # bad notification
    (42, None), ("ping", None), (None, None),
])
def test_invalid_requests(client, message, echoed):
    if echoed is not None:
        client.expect_id(echoed)
    client.send_raw(json.dumps(message).encode() + b"\n")
    if echoed is None:
        answer = client.wait_null_id_errors(1)[0]
    else:
        answer = client.wait_response(echoed)
    assert answer["id"] == echoed and type(answer["id"]) is type(echoed)
    assert answer["error"]["code"] == -32600
    assert client.request("ping") == {}


def test_batch_refused_outside_2025_03_26(client):
    client.send([{"jsonrpc": "2.0", "id": 1000000961, "method": "ping"}])
    assert client.wait_null_id_errors(1)[0]["error"]["code"] == -32600
    assert not client.answered(1000000961)
    assert client.request("ping") == {}


def test_batch_follows_the_negotiated_version(tmp_path):
    c = spawn(tmp_path)
    for n, version in enumerate(["2024-11-05", "2025-06-18", "2025-03-26", "2025-11-25"]):
        c.initialize(version)
        rid = 1000001000 + n
        before = len(c.null_id_errors())
        c.send([{"jsonrpc": "2.0", "id": rid, "method": "ping"}])
        if version == "2025-03-26":
            assert c.wait_batch(1) == [{"jsonrpc": "2.0", "id": rid, "result": {}}]
        else:
            assert c.wait_null_id_errors(before + 1)[-1]["error"]["code"] == -32600
            assert not c.answered(rid)
    c.assert_clean()
    assert c.close() == 0


def test_batch_on_2025_03_26(tmp_path):
    c = spawn(tmp_path)
    c.initialize("2025-03-26")
    c.send([{"jsonrpc": "2.0", "id": 1, "method": "ping"},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": "two", "method": "tools/list"},
            {"jsonrpc": "2.0", "id": 3, "method": "no/such"},
            {"jsonrpc": "2.0", "id": 4, "method": "prompts/get",
             "params": {"name": "recall", "arguments": {"question": "why JWT?"}}},
            17])
    answers = c.wait_batch(1)
    by_id = {json.dumps(a["id"]): a for a in answers}
    assert len(answers) == 5
    assert by_id["1"]["result"] == {}
    assert len(by_id['"two"']["result"]["tools"]) == 14
    assert by_id["3"]["error"]["code"] == -32601
    assert "why JWT?" in by_id["4"]["result"]["messages"][0]["content"]["text"]
    assert by_id["null"]["error"]["code"] == -32600
    # only notifications: no answer at all
    c.send([{"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "method": "notifications/whatever"}])
    c.send([])
    assert c.wait_null_id_errors(1)[0]["error"]["code"] == -32600
    assert c.request("ping") == {}
    assert len(c.batches) == 1
    c.assert_clean()
    assert c.close() == 0


UNKNOWN = ["no/such/method", "server/discover", "completion/complete", "resources/subscribe",
           "shutdown", "", "notifications/initialized"]


def test_unknown_methods_before_and_after_initialize(tmp_path):
    c = spawn(tmp_path)
    for method in UNKNOWN:
        assert c.request_raw(method)["error"]["code"] == -32601, method
    c.initialize()
    for method in UNKNOWN:
        assert c.request_raw(method, {})["error"]["code"] == -32601, method
    c.assert_clean()
    assert c.close() == 0


@pytest.mark.parametrize("method, params", [
    ("tools/list", []), ("tools/list", "x"), ("tools/list", 5),
    ("tools/list", {"cursor": "abc"}),
    ("tools/call", {}), ("tools/call", {"name": 5}),
    ("tools/call", {"name": "memshelf_index", "arguments": []}),
    ("tools/call", {"name": "memshelf_index", "arguments": "x"}),
    ("tools/call", {"name": "memshelf_nope"}),
    ("prompts/list", {"cursor": "x"}),
    ("prompts/get", {"name": "nope"}), ("prompts/get", {}),
    ("prompts/get", {"name": "recall"}),
    ("prompts/get", {"name": "recall", "arguments": {"question": 5}}),
    ("prompts/get", {"name": "recall", "arguments": []}),
    ("logging/setLevel", {"level": "loud"}), ("logging/setLevel", {}),
    ("resources/read", {}), ("resources/read", {"uri": 5}),
    ("resources/read", {"uri": "https://example.com/x"}),
    ("resources/read", {"uri": "memshelf://episode/"}),
    ("resources/read", {"uri": "memshelf://episode/a/b/c"}),
    ("resources/read", {"uri": "memshelf://episode/%zz"}),
    ("resources/list", {"cursor": "not-a-cursor"}), ("resources/list", {"cursor": 5}),
    ("resources/templates/list", {"cursor": "x"}),
    ("initialize", {"protocolVersion": 5}), ("initialize", {}),
    ("initialize", {"protocolVersion": "2025-11-25", "clientInfo": "x"}),
])
def test_malformed_params(client, method, params):
    rid = client.new_id()
    message = {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}
    client.send(message)
    assert client.wait_response(rid)["error"]["code"] == -32602
    assert client.request("ping") == {}


@pytest.mark.slow
def test_null_params_and_null_arguments_are_absent(client, shelf):
    rid = client.new_id()
    client.send({"jsonrpc": "2.0", "id": rid, "method": "tools/list", "params": None})
    assert [t["name"] for t in client.wait_response(rid)["result"]["tools"]] == \
        [t[0] for t in TOOLS]
    rid = client.new_id()
    client.send({"jsonrpc": "2.0", "id": rid, "method": "ping", "params": None})
    assert client.wait_response(rid)["result"] == {}
    rid = client.new_id()
    client.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                 "params": {"name": "memshelf_index", "arguments": None}})
    assert "no-shelf" in text_of(client.wait_response(rid)["result"])   # arguments: {} then
    optional = client.call_tool("memshelf_index", {"shelf_path": shelf, "category": None,
                                                   "since": None, "offset": None})
    assert optional["isError"] is False, text_of(optional)
    required = client.call_tool("memshelf_recall", {"shelf_path": shelf, "episode_id": None})
    assert required["isError"] is True
    assert "argument 'episode_id' must be a string, not null" in text_of(required)


BIG = 16 * 1024 * 1024


@pytest.mark.slow
def test_huge_inputs_are_quoted_as_short_excerpts(client, shelf):
    """No answer to a bad input echoes it: a quoted value is cut to an excerpt and its length."""
    big = "A" * BIG
    calls = [("memshelf_index", {"shelf_path": big}),
             ("memshelf_index", {"shelf_path": "/" + big}),
             ("memshelf_index", {"shelf_path": shelf, "since": big}),
             ("memshelf_index", {"B" * (1024 * 1024): 1}),
             ("memshelf_recall", {"shelf_path": shelf, "episode_id": big}),
             ("memshelf_search", {"shelf_path": shelf, "query": "jwt", "mode": big}),
             ("memshelf_shelve", shelve_args(big, shelf_path=shelf)),
             ("memshelf_shelve", shelve_args("2026-07-22-big-tag", shelf_path=shelf, tags=[big]))]
    for name, arguments in calls:
        result = client.call_tool(name, arguments, timeout=120)
        assert result["isError"] is True and len(json.dumps(result)) < 2048, (name, result)
    first = client.call_tool("memshelf_index", {"shelf_path": big}, timeout=120)
    assert "the shelf path '" + "A" * 60 + "…' (16,777,216 characters) is relative" in \
        text_of(first)
    rid = client.new_id()
    client.send({"jsonrpc": "2.0", "id": rid, "method": "M" * (1024 * 1024)})
    error = client.wait_response(rid, timeout=120)["error"]
    assert error["code"] == -32601 and len(json.dumps(error)) < 1024
    assert error["message"] == "method not found: '" + "M" * 60 + "…' (1,048,576 characters)"
    for method, params in (("prompts/get", {"name": big}), ("resources/read", {"uri": big}),
                           ("tools/call", {"name": big})):
        answer = client.request_raw(method, params, timeout=120)
        assert answer["error"]["code"] == -32602 and len(json.dumps(answer)) < 2048, answer
    assert not os.path.exists(os.path.join(shelf, "docs", "topics", "2026-07-22-big-tag.md"))


@pytest.mark.slow
def test_the_cli_quotes_huge_input_the_same_way(shelf):
    big = "A" * 100000          # about the most one argv entry may carry
    for args in (["recall", "--shelf", shelf, "--id", big], ["index", "--shelf", "rel/" + big],
                 ["recall", "--shelf", shelf, "--id", "2026-07-22-x", "--section", big]):
        r = subprocess.run([sys.executable, MEMSHELF, *args], capture_output=True, text=True,
                           env=server_env(), cwd=os.path.dirname(shelf))
        assert r.returncode in (1, 2) and len(r.stderr) < 2048 and r.stdout == "", r.stderr
        assert re.search(r"…'? \(100,\d{3} characters\)", r.stderr), r.stderr
    error = __import__("memshelf").ShelfError("usage", "x " * BIG, "fix", {"path": "p" * BIG})
    assert len(error.message) < 1100 and error.message.endswith("(33,554,432 characters)")
    assert len(error.details["path"]) < 1100


def test_requests_before_initialize(tmp_path):
    c = spawn(tmp_path)
    for method in ("tools/list", "tools/call", "resources/list", "resources/read",
                   "resources/templates/list", "prompts/list", "prompts/get", "logging/setLevel"):
        error = c.request_raw(method, {})["error"]
        assert error == {"code": -32602, "message": "received a request before initialization"}
        assert c.request("ping") == {}
    c.notify("notifications/initialized")        # before initialize: accepted silently
    assert c.request("ping") == {}
    c.assert_clean()
    assert c.close() == 0


def test_initialized_notification_is_optional(tmp_path):
    c = spawn(tmp_path)
    c.initialize(initialized=False)
    assert len(c.list_tools()) == 14
    c.assert_clean()
    assert c.close() == 0


def test_notifications_are_never_answered(client):
    for method in ("notifications/initialized", "notifications/whatever", "ping", "tools/list",
                   "notifications/cancelled", "notifications/progress"):
        client.notify(method, {})
    client.notify("notifications/cancelled", {"requestId": 999999})
    client.notify("notifications/cancelled", "junk")
    client.notify("notifications/cancelled", {"requestId": [1]})
    assert client.request("ping", rid="after") == {}
    assert client.null_id_errors() == []
    assert [json.loads(l).get("id") for l in client.lines if b'"id"' in l][-1] == "after"


def test_responses_from_the_client_are_ignored(client):
    client.send_raw(b'{"jsonrpc":"2.0","id":1,"result":{}}\n'
                    b'{"jsonrpc":"2.0","id":"x","error":{"code":1,"message":"m"}}\n'
                    b'{"jsonrpc":"2.0","id":null,"error":{"code":1,"message":"m"}}\n')
    assert client.request("ping", rid="after") == {}
    assert client.null_id_errors() == []


# --- lifecycle and versions ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_initialize_echoes_supported_versions(tmp_path, version):
    c = spawn(tmp_path)
    result = c.initialize(version)
    assert result["protocolVersion"] == version
    assert result["serverInfo"]["name"] == "memshelf"
    assert result["serverInfo"]["title"] == "memshelf"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", result["serverInfo"]["version"])
    assert result["capabilities"] == {"tools": {"listChanged": False},
                                      "resources": {"subscribe": False, "listChanged": False},
                                      "prompts": {"listChanged": False}, "logging": {}}
    c.assert_clean()
    assert c.close() == 0


def test_initialize_unknown_version_answers_latest(client):
    for asked in ("1999-01-01", "2026-07-28", "2025-11-26", "latest", ""):
        result = client.initialize(asked, capabilities={"extensions": {"x/y": {}}, "roots": {}})
        assert result["protocolVersion"] == "2025-11-25"


def test_second_initialize_is_answered_again(tmp_path):
    c = spawn(tmp_path)
    first = c.initialize("2025-03-26")
    second = c.initialize("2024-11-05")
    assert first["protocolVersion"] == "2025-03-26"
    assert second["protocolVersion"] == "2024-11-05"
    assert "annotations" not in c.list_tools()[0]     # the new negotiation holds
    c.assert_clean()
    assert c.close() == 0


def test_ping_before_initialize(tmp_path):
    c = spawn(tmp_path)
    assert c.request("ping") == {}
    assert c.request("ping", {}) == {}
    c.assert_clean()
    assert c.close() == 0


def test_instructions(tmp_path, shelf):
    c = spawn(tmp_path)
    text = c.initialize()["instructions"]
    assert len(text) <= 1000
    assert "memshelf_index" in text and "memshelf_recall" in text
    assert text.endswith("Default shelf: not configured — pass shelf_path.")
    c.close()
    c = spawn(tmp_path, MEMSHELF_SHELF=shelf)
    text = c.initialize()["instructions"]
    assert len(text) <= 1000 and text.endswith("Default shelf: configured.")
    c.assert_clean()
    assert c.close() == 0


# --- tools/list per version ----------------------------------------------------------------

@pytest.fixture(scope="module")
def versions_server(tmp_path_factory):
    c = spawn(tmp_path_factory.mktemp("versions"))
    yield c
    c.assert_clean()
    assert c.close() == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_tool_fields_per_version(versions_server, version):
    c = versions_server
    c.initialize(version)
    tools = c.list_tools()
    assert [t["name"] for t in tools] == [row[0] for row in TOOLS]
    for tool, (name, title, ro, destructive, idem, open_world) in zip(tools, TOOLS):
        schema = tool["inputSchema"]
        assert schema["type"] == "object" and schema.get("additionalProperties") is False
        assert schema_problems(schema) == []
        assert isinstance(tool["description"], str) and tool["description"]
        if version == "2024-11-05":
            assert set(tool) == {"name", "description", "inputSchema"}
            continue
        hints = {"readOnlyHint": ro, "destructiveHint": destructive, "idempotentHint": idem,
                 "openWorldHint": open_world}
        if version == "2025-03-26":
            assert set(tool) == {"name", "description", "inputSchema", "annotations"}
            assert tool["annotations"] == {"title": title, **hints}
            continue
        assert set(tool) == {"name", "title", "description", "inputSchema", "outputSchema",
                             "annotations"}
        assert tool["title"] == title
        assert tool["annotations"] == hints
        out = tool["outputSchema"]
        assert out["type"] == "object" and out.get("additionalProperties") is True
        assert schema_problems(out) == []


def test_tools_list_is_deterministic_and_small(client):
    first = client.request_raw("tools/list")
    second = client.request_raw("tools/list")
    assert first["result"] == second["result"]
    size = len(json.dumps(first["result"], ensure_ascii=False, separators=(",", ":")))
    # 18,000 until issue 30 added shelve's append_sections and purge's episode_ids (~160) and
    # issue 29 search's matched/unmatched output (~40)
    assert size < 18300, f"tools/list is {size} characters at 2025-11-25"


# --- tool calls ------------------------------------------------------------------------------

@pytest.mark.slow
def test_tool_calls_on_a_real_shelf(tmp_path):
    shelf_dir = str(tmp_path / "made-by-mcp")
    c = spawn(tmp_path)
    c.initialize(client_name="pytest-client")
    c.list_tools()
    init = c.call_tool("memshelf_init", {"shelf_path": shelf_dir})
    assert init["isError"] is False, text_of(init)
    shelved = c.call_tool("memshelf_shelve", dict(shelve_args("2026-07-22-auth-middleware"),
                                                  shelf_path=shelf_dir))
    assert shelved["isError"] is False, text_of(shelved)
    index = c.call_tool("memshelf_index", {"shelf_path": shelf_dir})
    assert "2026-07-22-auth-middleware" in index["structuredContent"]["index"]
    assert text_of(index) == index["structuredContent"]["index"]
    recalled = c.call_tool("memshelf_recall", {"shelf_path": shelf_dir, "section": "Decisions",
                                               "episode_id": "2026-07-22-auth-middleware"})
    assert recalled["isError"] is False
    assert "<recalled-episode" in text_of(recalled) and "JWT verified" in text_of(recalled)
    assert text_of(recalled) == recalled["structuredContent"]["content"]
    lint = c.call_tool("memshelf_lint_digest", {"digest": DIGEST})
    assert lint["isError"] is False
    rejected = c.call_tool("memshelf_lint_digest", {"digest": "We did it."})
    assert rejected["isError"] is False       # a verdict is a result
    # provenance: agent comes from clientInfo.name
    episode = open(os.path.join(shelf_dir, "docs", "topics", "2026-07-22-auth-middleware.md"),
                   encoding="utf-8").read()
    assert re.search(r'^agent: "?pytest-client"?$', episode, re.M)
    c.assert_clean()
    assert c.close() == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_structured_content_from_2025_06_18(versions_server, version):
    c = versions_server
    c.initialize(version)
    c.list_tools()
    result = c.call_tool("memshelf_lint_digest", {"digest": DIGEST})
    assert result["isError"] is False
    assert ("structuredContent" in result) == (version >= "2025-06-18")
    prompts = c.request("prompts/list")["prompts"]
    assert all(("title" in p) == (version >= "2025-06-18") for p in prompts)


def test_argument_errors_are_tool_errors(client, shelf):
    client.list_tools()
    for args in ({"shelf_path": shelf, "bogus": 1}, {"shelf_path": shelf, "max_chars": "x"},
                 {"shelf_path": shelf, "max_chars": -1}, {"shelf_path": 5}):
        result = client.call_tool("memshelf_index", args)
        assert result["isError"] is True and "structuredContent" not in result
        lines = text_of(result).split("\n")
        assert len(lines) == 3 and lines[1] == "code: usage" and lines[2].startswith("fix: ")
    missing = client.call_tool("memshelf_recall", {"shelf_path": shelf})
    assert missing["isError"] is True and "episode_id" in text_of(missing)


def test_failures_are_tool_errors(client, shelf):
    result = client.call_tool("memshelf_recall", {"shelf_path": shelf, "episode_id": "nope"})
    assert result["isError"] is True and "code: episode-not-found" in text_of(result)
    assert "structuredContent" not in result


def test_nested_params_compatibility(client, shelf):
    result = client.call_tool("memshelf_index", {"params": {"shelf_path": shelf}})
    assert result["isError"] is False


def test_mcp_text_json(tmp_path):
    c = spawn(tmp_path, MEMSHELF_MCP_TEXT="json")
    c.initialize()
    c.list_tools()
    result = c.call_tool("memshelf_lint_digest", {"digest": DIGEST})
    assert json.loads(text_of(result)) == result["structuredContent"]
    c.assert_clean()
    assert c.close() == 0


# --- the default shelf -----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("value", [None, "", "   ", "${user_config.shelf}"])
def test_no_default_shelf(tmp_path, shelf, value):
    env = {} if value is None else {"MEMSHELF_SHELF": value}
    c = spawn(tmp_path, **env)
    result = c.initialize()
    assert result["instructions"].endswith("not configured — pass shelf_path.")
    warning = c.wait_notification("notifications/message")
    assert warning["params"]["level"] == "warning" and warning["params"]["logger"] == "memshelf"
    assert "MEMSHELF_SHELF" in warning["params"]["data"]["message"]
    out = c.call_tool("memshelf_index", {})
    assert out["isError"] is True
    assert "code: no-shelf" in text_of(out) and "MEMSHELF_SHELF" in text_of(out)
    assert c.call_tool("memshelf_index", {"shelf_path": shelf})["isError"] is False
    assert c.request("resources/list") == {"resources": []}
    error = c.request_raw("resources/read", {"uri": "memshelf://index"})["error"]
    assert error["code"] == -32002 and "MEMSHELF_SHELF" in error["message"]
    c.assert_clean()
    assert c.close() == 0


def test_alias_variables_and_tilde(tmp_path, shelf):
    home, name = os.path.split(shelf)
    c = spawn(tmp_path, HOME=home, MEMSHELF_SHELF_PATH="~/" + name)
    c.initialize()
    assert c.call_tool("memshelf_index", {})["isError"] is False
    c.close()
    c = spawn(tmp_path, MEMSHELF_ROOT=shelf)
    c.initialize()
    assert c.call_tool("memshelf_index", {})["isError"] is False
    c.assert_clean()
    assert c.close() == 0


@pytest.mark.slow
@pytest.mark.parametrize("value", ["${HOME}${/}shelf", "${DOCUMENTS}/../shelf",
                                   "${DESKTOP}${pathSeparator}..${/}shelf", "${DOWNLOADS}/../shelf"])
def test_host_variables_in_the_default_shelf(tmp_path, shelf, value):
    """A bundle default may arrive with the host's ${...} unexpanded; server and CLI expand it."""
    home = os.path.dirname(shelf)
    for name in ("Documents", "Desktop", "Downloads"):
        os.makedirs(os.path.join(home, name), exist_ok=True)
    c = spawn(tmp_path, HOME=home, MEMSHELF_SHELF=value)
    assert c.initialize()["instructions"].endswith("Default shelf: configured.")
    assert c.call_tool("memshelf_index", {})["isError"] is False
    c.assert_clean()
    assert c.close() == 0
    cli = subprocess.run([sys.executable, MEMSHELF, "index", "--json"], capture_output=True,
                         text=True, env=server_env(HOME=home, MEMSHELF_SHELF=value), cwd=home)
    assert cli.returncode == 0 and json.loads(cli.stdout)["status"] == "ok", cli.stderr
    unknown = subprocess.run([sys.executable, MEMSHELF, "index"], capture_output=True, text=True,
                             env=server_env(HOME=home, MEMSHELF_SHELF=value + "${APPDATA}"),
                             cwd=str(tmp_path))
    assert unknown.returncode == 2 and "no default shelf is set" in unknown.stderr


@pytest.mark.slow
def test_default_shelf_is_created_on_first_write(tmp_path):
    target = str(tmp_path / "fresh" / "shelf")
    c = spawn(tmp_path, MEMSHELF_SHELF=target)
    c.initialize()
    c.list_tools()
    empty = c.call_tool("memshelf_index", {})
    assert empty["isError"] is False and empty["structuredContent"]["entries_total"] == 0
    assert not os.path.exists(target)
    shelved = c.call_tool("memshelf_shelve", shelve_args("2026-07-22-first-write"))
    assert shelved["isError"] is False, text_of(shelved)
    assert shelved["structuredContent"]["initialized"] is True
    assert os.path.isfile(os.path.join(target, "shelf.yml"))
    again = c.call_tool("memshelf_shelve", shelve_args("2026-07-23-second-write"))
    assert not again["structuredContent"].get("initialized")
    index = c.call_tool("memshelf_index", {})
    assert "2026-07-22-first-write" in text_of(index)
    c.assert_clean()
    assert c.close() == 0


@pytest.mark.parametrize("path", ["relative/shelf", "./shelf", "shelf"])
def test_relative_shelf_path_refused(client, path):
    result = client.call_tool("memshelf_index", {"shelf_path": path})
    assert result["isError"] is True and "code: shelf-path-relative" in text_of(result)


def test_relative_default_shelf_refused(tmp_path):
    c = spawn(tmp_path, MEMSHELF_SHELF="relative/shelf")
    c.initialize()
    result = c.call_tool("memshelf_index", {})
    assert result["isError"] is True and "code: shelf-path-relative" in text_of(result)
    assert not os.path.exists(tmp_path / "relative")
    c.assert_clean()
    assert c.close() == 0


def test_explicit_path_that_is_not_a_shelf(client, tmp_path):
    result = client.call_tool("memshelf_index", {"shelf_path": str(tmp_path)})
    assert result["isError"] is True and "code: not-a-shelf" in text_of(result)


# --- resources -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stocked(tmp_path_factory):
    """A server whose default shelf holds two episodes."""
    base = tmp_path_factory.mktemp("stocked")
    shelf = make_shelf(base / "shelf")
    c = spawn(base, MEMSHELF_SHELF=shelf)
    c.initialize()
    c.list_tools()
    for slug in ("2026-07-20-older-topic", "2026-07-22-newer-topic"):
        result = c.call_tool("memshelf_shelve", shelve_args(slug, display_title=f"Title {slug}"))
        assert result["isError"] is False, text_of(result)
    yield c, shelf
    c.assert_clean()
    assert c.close() == 0


def test_resource_templates(client):
    templates = client.request("resources/templates/list")["resourceTemplates"]
    assert [t["uriTemplate"] for t in templates] == ["memshelf://episode/{id}",
                                                     "memshelf://episode/{id}/{section}"]
    assert all(t["mimeType"] == "text/markdown" for t in templates)


@pytest.mark.slow
def test_resources_list(stocked):
    stocked, _ = stocked
    resources = stocked.request("resources/list")["resources"]
    assert resources[0]["uri"] == "memshelf://index"
    assert all(r["mimeType"] == "text/markdown" for r in resources)
    import memshelf
    if hasattr(memshelf, "list_episodes"):
        episodes = [r for r in resources if r["uri"].startswith("memshelf://episode/")]
        assert [r["name"] for r in episodes] == ["2026-07-22-newer-topic",
                                                 "2026-07-20-older-topic"]
        assert episodes[0]["title"] == "Title 2026-07-22-newer-topic"
        assert all(isinstance(r["size"], int) and r["size"] > 0 for r in episodes)


def test_resources_read(stocked):
    stocked, shelf_dir = stocked
    index = stocked.request("resources/read", {"uri": "memshelf://index"})["contents"]
    assert index[0]["uri"] == "memshelf://index" and index[0]["mimeType"] == "text/markdown"
    assert "2026-07-22-newer-topic" in index[0]["text"]
    whole = stocked.request("resources/read",
                            {"uri": "memshelf://episode/2026-07-22-newer-topic"})["contents"][0]
    assert whole["text"].startswith("<recalled-episode") and DIGEST[:40] in whole["text"]
    for section in ("Decisions", "decisions", "%44ecisions"):
        part = stocked.request("resources/read", {
            "uri": f"memshelf://episode/2026-07-22-newer-topic/{section}"})["contents"][0]
        assert "JWT verified" in part["text"] and DIGEST[:40] not in part["text"]
    # reading a resource is not a recall: no recall-log row
    log = os.path.join(shelf_dir, "recall-log.tsv")
    assert not os.path.exists(log) or "newer-topic" not in open(log, encoding="utf-8").read()


@pytest.mark.parametrize("uri", ["memshelf://episode/2026-01-01-missing",
                                 "memshelf://episode/2026-07-22-newer-topic/No%20such",
                                 "memshelf://episode/..%2F..%2Fetc"])
def test_resources_read_not_found(stocked, uri):
    stocked, _ = stocked
    error = stocked.request_raw("resources/read", {"uri": uri})["error"]
    assert error["code"] in (-32002, -32602)
    if "missing" in uri or "such" in uri:
        assert error["code"] == -32002 and error["data"] == {"uri": uri}


def write_episode(shelf_dir, slug, body="- a decision"):
    """An episode file written by hand (as a person with an editor would), no tool involved."""
    path = os.path.join(shelf_dir, "docs", "topics", slug + ".md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# {slug}\n\n---\nid: {slug}\nkind: topic\ndate: {slug[:10]}\ntags: []\n"
                f"approx_tokens: 0\n---\n\n## Digest\n{DIGEST}\n\n## Decisions\n{body}\n")
    return path


@pytest.mark.slow
def test_resources_list_pages_and_big_episodes(tmp_path, fresh_shelf):
    import memshelf
    if not hasattr(memshelf, "list_episodes"):
        pytest.skip("memshelf.list_episodes is not there yet")
    for day in range(1, 29):
        for k in range(4):
            write_episode(fresh_shelf, f"2026-02-{day:02d}-topic-{k}")
    big = "- " + "\u00e9" * (1024 * 1024) + "\n"      # 2 MiB of two-byte characters
    write_episode(fresh_shelf, "2026-03-01-huge", big)
    c = spawn(tmp_path, MEMSHELF_SHELF=fresh_shelf)
    c.initialize()
    first = c.request("resources/list")
    names = [r["name"] for r in first["resources"] if r["uri"].startswith("memshelf://episode/")]
    assert len(names) == 100 and names[0] == "2026-03-01-huge"
    assert first["resources"][0]["uri"] == "memshelf://index"
    second = c.request("resources/list", {"cursor": first["nextCursor"]})
    rest = [r["name"] for r in second["resources"]]
    assert len(rest) == 13 and "nextCursor" not in second
    assert not set(rest) & set(names)
    assert sorted(names + rest, reverse=True) == names + rest
    text = c.request("resources/read", {"uri": "memshelf://episode/2026-03-01-huge"})[
        "contents"][0]["text"]
    assert len(text.encode("utf-8")) < 1024 * 1024 + 2000
    assert "memshelf_recall" in text.rsplit("\n", 1)[-1] and "offset=" in text
    c.assert_clean()
    assert c.close() == 0


@pytest.mark.slow
def test_archive_index_resource(tmp_path, fresh_shelf):
    c = spawn(tmp_path, MEMSHELF_SHELF=fresh_shelf)
    c.initialize()
    uris = [r["uri"] for r in c.request("resources/list")["resources"]]
    assert "memshelf://archive/index" not in uris
    error = c.request_raw("resources/read", {"uri": "memshelf://archive/index"})["error"]
    assert error["code"] == -32002
    os.makedirs(os.path.join(fresh_shelf, "archive", "docs", "topics"))
    uris = [r["uri"] for r in c.request("resources/list")["resources"]]
    assert uris[:2] == ["memshelf://index", "memshelf://archive/index"]
    archive = c.request("resources/read", {"uri": "memshelf://archive/index"})["contents"][0]
    assert archive["mimeType"] == "text/markdown" and isinstance(archive["text"], str)
    c.assert_clean()
    assert c.close() == 0


# --- prompts ---------------------------------------------------------------------------------

def test_prompts(client):
    prompts = client.request("prompts/list")["prompts"]
    assert [p["name"] for p in prompts] == ["shelve", "recall", "close-session"]
    by_name = {p["name"]: p for p in prompts}
    assert by_name["recall"]["arguments"][0] == {
        "name": "question", "description": by_name["recall"]["arguments"][0]["description"],
        "required": True}
    got = client.request("prompts/get", {"name": "recall",
                                         "arguments": {"question": "Which auth scheme?"}})
    message = got["messages"][0]
    assert message["role"] == "user" and "Which auth scheme?" in message["content"]["text"]
    assert "${" not in message["content"]["text"]
    for name in ("shelve", "close-session"):
        text = client.request("prompts/get", {"name": name})["messages"][0]["content"]["text"]
        assert "memshelf_shelve" in text and "${" not in text


# --- logging ---------------------------------------------------------------------------------

def test_set_level(client):
    for level in ("debug", "info", "notice", "warning", "error", "critical", "alert",
                  "emergency"):
        assert client.request("logging/setLevel", {"level": level}) == {}
    assert client.request_raw("logging/setLevel", {"level": "WARNING"})["error"]["code"] == -32602
    assert client.request("logging/setLevel", {"level": "warning"}) == {}


def test_default_shelf_warning_only_once(tmp_path):
    c = spawn(tmp_path)
    c.initialize()
    c.initialize()
    c.request("ping")
    assert len([n for n in c.notifications if n["method"] == "notifications/message"]) == 1
    c.assert_clean()
    assert c.close() == 0


# --- progress and cancellation ---------------------------------------------------------------

def test_progress_is_increasing_and_before_the_response(client, shelf):
    client.call_tool("memshelf_rebuild", {"shelf_path": shelf}, meta={"progressToken": "tok"},
                     validate_output=False)
    seen_response = False
    values = []
    for line in client.lines:
        msg = json.loads(line)
        if msg.get("method") == "notifications/progress" and \
                msg["params"]["progressToken"] == "tok":
            assert not seen_response
            values.append(msg["params"]["progress"])
        elif "result" in msg and isinstance(msg["result"], dict) and "content" in msg["result"]:
            seen_response = True
    assert values == sorted(set(values))


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="holds the shelf lock with fcntl")
def test_cancel_a_request_waiting_for_the_shelf_lock(tmp_path, fresh_shelf):
    shelf = fresh_shelf
    import fcntl
    c = spawn(tmp_path, MEMSHELF_LOCK_TIMEOUT="60")
    c.initialize()
    os.makedirs(os.path.join(shelf, ".memshelf"), exist_ok=True)
    fd = os.open(os.path.join(shelf, ".memshelf", "lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        slow = c.start_request("tools/call", {
            "name": "memshelf_shelve", "_meta": {"progressToken": 77},
            "arguments": dict(shelve_args("2026-07-22-cancelled"), shelf_path=shelf)})
        c.wait_notification("notifications/progress",
                            lambda n: n["params"]["progressToken"] == 77)
        c.notify("notifications/cancelled", {"requestId": slow, "reason": "test"})
        assert c.request("ping") == {}
        kept = c.start_request("tools/call", {"name": "memshelf_shelve", "arguments": dict(
            shelve_args("2026-07-22-kept"), shelf_path=shelf)})
    finally:
        os.close(fd)      # releases the lock
    assert c.wait_response(kept)["result"]["isError"] is False
    assert c.request("ping") == {}
    assert not c.answered(slow)
    assert not os.path.exists(os.path.join(shelf, "docs", "topics", "2026-07-22-cancelled.md"))
    assert os.path.exists(os.path.join(shelf, "docs", "topics", "2026-07-22-kept.md"))
    c.assert_clean()
    assert c.close() == 0


# --- the stateless 2026-07-28 era ------------------------------------------------------------

def check_modern(result, cacheable=True):
    assert result["resultType"] == "complete"
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "memshelf"
    if cacheable:
        assert isinstance(result["ttlMs"], int) and result["ttlMs"] >= 0
        assert result["cacheScope"] == "private"


@pytest.mark.parametrize("after_initialize", [False, True])
def test_server_discover(tmp_path, after_initialize):
    c = spawn(tmp_path)
    if after_initialize:
        c.initialize("2025-03-26")
    assert c.request_raw("server/discover")["error"]["code"] == -32601     # classic: unknown
    found = c.request("server/discover", {"_meta": modern_meta()})
    check_modern(found)
    assert MODERN in found["supportedVersions"]
    assert found["capabilities"]["tools"] == {"listChanged": False}
    assert found["instructions"].endswith("pass shelf_path.")
    c.assert_clean()
    assert c.close() == 0


@pytest.mark.slow
def test_modern_requests_are_stateless(tmp_path, fresh_shelf):
    shelf = fresh_shelf
    c = spawn(tmp_path, MEMSHELF_SHELF=shelf)
    meta = modern_meta()
    tools = c.request("tools/list", {"_meta": meta})
    check_modern(tools)
    assert [t["name"] for t in tools["tools"]] == [row[0] for row in TOOLS]
    assert all("outputSchema" in t and "title" in t for t in tools["tools"])
    call = c.request("tools/call", {"_meta": meta, "name": "memshelf_shelve",
                                    "arguments": shelve_args("2026-07-22-modern")})
    check_modern(call, cacheable=False)
    assert call["isError"] is False and call["structuredContent"]["status"]
    schema = {t["name"]: t for t in tools["tools"]}["memshelf_shelve"]["outputSchema"]
    assert validate(call["structuredContent"], schema) == []
    episode = open(os.path.join(shelf, "docs", "topics", "2026-07-22-modern.md"),
                   encoding="utf-8").read()
    assert re.search(r'^agent: "?modern-test"?$', episode, re.M)
    read = c.request("resources/read", {"_meta": meta, "uri": "memshelf://index"})
    check_modern(read)
    assert "2026-07-22-modern" in read["contents"][0]["text"]
    for method in ("resources/list", "resources/templates/list", "prompts/list"):
        check_modern(c.request(method, {"_meta": meta}))
    got = c.request("prompts/get", {"_meta": meta, "name": "close-session"})
    check_modern(got, cacheable=False)
    missing = c.request_raw("resources/read", {"_meta": meta,
                                               "uri": "memshelf://episode/2020-01-01-x"})
    assert missing["error"]["code"] == -32602 and missing["error"]["data"]["uri"]
    # the classic session was never initialized
    assert c.request_raw("tools/list")["error"]["message"] == \
        "received a request before initialization"
    c.assert_clean()
    assert c.close() == 0


def test_modern_envelope_errors(client):
    meta = modern_meta()
    del meta["io.modelcontextprotocol/clientCapabilities"]
    assert client.request_raw("tools/list", {"_meta": meta})["error"]["code"] == -32602
    error = client.request_raw("tools/list", {"_meta": modern_meta("2099-01-01")})["error"]
    assert error["code"] == -32022
    assert error["data"]["requested"] == "2099-01-01" and MODERN in error["data"]["supported"]
    assert client.request_raw("tools/list", {"_meta": modern_meta(5)})["error"]["code"] == -32602
    bad_level = modern_meta(**{"io.modelcontextprotocol/logLevel": "loud"})
    assert client.request_raw("tools/list", {"_meta": bad_level})["error"]["code"] == -32602
    for method in ("ping", "logging/setLevel", "no/such", "completion/complete"):
        assert client.request_raw(method, {"_meta": modern_meta(), "level": "info"})["error"][
            "code"] == -32601
    assert client.request("ping") == {}


def test_modern_logging_is_per_request(tmp_path):
    c = spawn(tmp_path)
    c.request("tools/list", {"_meta": modern_meta()})
    c.request("ping")
    assert [n for n in c.notifications if n["method"] == "notifications/message"] == []
    c.assert_clean()
    assert c.close() == 0


# --- two servers, one shelf ------------------------------------------------------------------

@pytest.mark.slow
def test_two_servers_lose_no_write(tmp_path, fresh_shelf):
    shelf = fresh_shelf
    servers = [spawn(tmp_path, MEMSHELF_LOCK_TIMEOUT="120") for _ in range(2)]
    for c in servers:
        c.initialize()
    ids = {}
    for n, c in enumerate(servers):
        for k in range(3):
            slug = f"2026-07-{10 + k:02d}-server{n}-topic{k}"
            ids[slug] = (c, c.start_request("tools/call", {
                "name": "memshelf_shelve",
                "arguments": dict(shelve_args(slug), shelf_path=shelf)}))
    for slug, (c, rid) in ids.items():
        result = c.wait_response(rid, timeout=120)["result"]
        assert result["isError"] is False, text_of(result)
    for slug in ids:
        assert os.path.isfile(os.path.join(shelf, "docs", "topics", slug + ".md"))
    index = servers[0].call_tool("memshelf_index", {"shelf_path": shelf, "max_chars": 0})
    for slug in ids:
        assert slug in text_of(index)
    if os.path.isdir(os.path.join(shelf, ".git")):
        log = subprocess.run(["git", "-C", shelf, "log", "--format=%s"], capture_output=True,
                             text=True, check=True).stdout.split("\n")
        assert sorted(s for s in log if s.startswith("shelve: ")) == \
            sorted(f"shelve: {slug}" for slug in ids)
    for c in servers:
        c.assert_clean()
        assert c.close() == 0


def test_parallel_calls_in_one_server(client, shelf):
    client.list_tools()
    rids = [client.start_request("tools/call", {"name": "memshelf_recall", "arguments": {
        "shelf_path": shelf, "episode_id": f"missing-{k}"}}) for k in range(12)]
    pings = [client.start_request("ping") for _ in range(5)]
    for rid in rids:
        assert client.wait_response(rid)["result"]["isError"] is True
    for rid in pings:
        assert client.wait_response(rid)["result"] == {}
