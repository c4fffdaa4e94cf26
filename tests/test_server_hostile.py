"""server.py under hostile input: after every malformed line or argument the server answers with a
JSON-RPC error or an isError tool result, keeps running, and still answers a ping."""

import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SERVER = os.path.join(ROOT, "server.py")
MEMSHELF = os.path.join(ROOT, "memshelf.py")
sys.path.insert(0, HERE)

from mcp_client import McpClient, clean_env  # noqa: E402

PYCACHE = os.path.join(tempfile.gettempdir(), "memshelf-test-pycache")
DIGEST = ("Dana chose JWT middleware over server sessions; per-route decorators were rejected. "
          "Open: the key rotation schedule, owned by Dana.")


def server_env(**extra):
    env = clean_env(**extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)     # bytecode cached outside the repo: faster spawns
    env["PYTHONPYCACHEPREFIX"] = PYCACHE
    for key, value in (("GIT_AUTHOR_NAME", "Test"), ("GIT_AUTHOR_EMAIL", "test@example.com"),
                       ("GIT_COMMITTER_NAME", "Test"),
                       ("GIT_COMMITTER_EMAIL", "test@example.com")):
        env.setdefault(key, value)
    return env


def spawn(cwd, **env):
    return McpClient([sys.executable, SERVER], env=server_env(**env), cwd=str(cwd))


def text_of(result):
    return "\n".join(b["text"] for b in result["content"] if b["type"] == "text")


def tree(path):
    """Every path under path, for "nothing was written outside the shelf" checks."""
    found = set()
    for base, dirs, files in os.walk(path):
        for name in dirs + files:
            found.add(os.path.relpath(os.path.join(base, name), path))
    return found


@pytest.fixture(scope="module")
def area(tmp_path_factory):
    """A directory with a shelf in it; the shelf is the only place a write may land."""
    base = tmp_path_factory.mktemp("hostile")
    shelf = base / "inner" / "shelf"
    subprocess.run([sys.executable, MEMSHELF, "init", "--shelf", str(shelf)], check=True,
                   env=server_env(), stdout=subprocess.DEVNULL)
    return base, str(shelf)


@pytest.fixture(scope="module")
def server(area):
    c = spawn(area[0])
    c.initialize()
    c.list_tools()
    yield c
    assert c.proc.poll() is None, "the server died"
    assert c.close() == 0


@pytest.fixture
def client(server):
    server.reset()
    yield server
    server.assert_clean()
    assert server.proc.poll() is None, "the server exited"
    assert server.request("ping", rid="alive?") == {}


# --- malformed lines -----------------------------------------------------------------------

def deep(depth):
    return b"[" * depth + b"]" * depth


PARSE_ERRORS = {
    "not json": b"hello there",
    "truncated": b'{"jsonrpc":"2.0","id":',
    "two objects": b'{"jsonrpc":"2.0","id":1,"method":"ping"}{"x":1}',
    "trailing comma": b'{"jsonrpc":"2.0","id":1,"method":"ping",}',
    "single quotes": b"{'jsonrpc':'2.0','id':1,'method':'ping'}",
    "NaN": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":NaN}}',
    "Infinity": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":Infinity}}',
    "-Infinity": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":-Infinity}}',
    "huge integer": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":' + b"7" * 100000 +
                    b"}}",
    "huge negative integer": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":-' +
                             b"7" * 5000 + b"}}",
    "huge integer id": b'{"jsonrpc":"2.0","id":' + b"1" * 4301 + b',"method":"ping"}',
    "huge exponent": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":1e999999}}',
    "deep arrays": deep(100000),
    "deep arrays, unbalanced": b"[" * 300000,
    "deep objects": b'{"a":' * 5000 + b"1" + b"}" * 5000,
    "deep inside a request": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":' +
                             deep(600) + b"}}",
    "invalid UTF-8": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\xff\xfe"}}',
    "overlong UTF-8": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\xc0\xaf"}}',
    "encoded surrogate": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"\xed\xa0\x80"}}',
    "UTF-16": '{"jsonrpc":"2.0","id":1,"method":"ping"}'.encode("utf-16"),
    "NUL bytes": b"\x00\x00\x00",
    "raw NUL in a string": b'{"jsonrpc":"2.0","id":1,"method":"pi\x00ng"}',
    "raw control character": b'{"jsonrpc":"2.0","id":1,"method":"ping\x01"}',
    "bad escape": b'{"jsonrpc":"2.0","id":1,"method":"\\q"}',
    "half an escape": b'{"jsonrpc":"2.0","id":1,"method":"\\u12"}',
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PARSE_ERRORS))
def test_parse_errors_keep_the_server_alive(client, name):
    client.send_raw(PARSE_ERRORS[name] + b"\n")
    answers = client.wait_null_id_errors(1)
    assert answers[0]["error"]["code"] == -32700
    assert isinstance(answers[0]["error"]["message"], str)


INVALID = {
    "true": b"true", "null": b"null", "number": b"123", "string": b'"ping"', "empty object": b"{}",
    "array on 2025-11-25": b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]',
    "empty array": b"[]",
    "id null": b'{"jsonrpc":"2.0","id":null,"method":"ping"}',
    "id true": b'{"jsonrpc":"2.0","id":true,"method":"ping"}',
    "id false": b'{"jsonrpc":"2.0","id":false,"method":"ping"}',
    "id float": b'{"jsonrpc":"2.0","id":1.25,"method":"ping"}',
    "id exponent": b'{"jsonrpc":"2.0","id":1e3,"method":"ping"}',
    "id object": b'{"jsonrpc":"2.0","id":{},"method":"ping"}',
    "id array": b'{"jsonrpc":"2.0","id":[],"method":"ping"}',
    "method null, no id": b'{"jsonrpc":"2.0","method":null}',
    "jsonrpc as number, no id": b'{"jsonrpc":2,"method":"ping"}',
    "broken response": b'{"jsonrpc":"1.0","id":5,"result":{}}',
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_requests_keep_the_server_alive(client, name):
    client.send_raw(INVALID[name] + b"\n")
    answer = client.wait_null_id_errors(1)[0]
    assert answer["error"]["code"] == -32600


@pytest.mark.parametrize("line, rid, code", [
    (b'{"jsonrpc":"2.0","id":"h1","method":5}', "h1", -32600),
    (b'{"jsonrpc":"2.0","id":"h2","method":["ping"]}', "h2", -32600),
    (b'{"jsonrpc":"2.1","id":"h3","method":"ping"}', "h3", -32600),
    (b'{"id":"h4","method":"ping"}', "h4", -32600),
    (b'{"jsonrpc":"2.0","id":"h5","method":"ping","params":"x"}', "h5", -32602),
    (b'{"jsonrpc":"2.0","id":"h6","method":"ping","params":[1]}', "h6", -32602),
    (b'{"jsonrpc":"2.0","id":"h7","method":"tools/call","params":{"name":null}}', "h7", -32602),
    (b'{"jsonrpc":"2.0","id":"h8","method":"tools/call","params":{"name":"memshelf_index",'
     b'"arguments":[1,2]}}', "h8", -32602),
    (b'{"jsonrpc":"2.0","id":"h9","method":"\\ud800"}', "h9", -32601),
    (b'{"jsonrpc":"2.0","id":"h10","method":"' + b"m" * 100000 + b'"}', "h10", -32601),
    (b'{"jsonrpc":"2.0","id":"h11","method":"resources/read","params":{"uri":"\\udfff"}}',
     "h11", -32602),
    (b'{"jsonrpc":"2.0","id":"h12","method":"logging/setLevel","params":{"level":["x"]}}',
     "h12", -32602),
    (b'{"jsonrpc":"2.0","id":"h13","method":"prompts/get","params":{"name":{"a":1}}}',
     "h13", -32602),
])
def test_wrong_types_get_error_answers(client, line, rid, code):
    client.expect_id(rid)
    client.send_raw(line + b"\n")
    error = client.wait_response(rid)["error"]
    assert error["code"] == code
    assert "\n" not in error["message"] and len(error["message"]) < 1000


def test_lone_surrogates_are_echoed_as_valid_json(client):
    rid = "sur\udc80rogate"
    client.expect_id(rid)
    client.send_raw(b'{"jsonrpc":"2.0","id":"sur\\udc80rogate","method":"ping"}\n')
    assert client.wait_response(rid)["result"] == {}
    got = client.request("prompts/get", {"name": "recall",
                                         "arguments": {"question": "why \ud800 this?"}})
    assert "\ud800" in got["messages"][0]["content"]["text"]
    lint = client.call_tool("memshelf_lint_digest", {"digest": "Dana chose \udbff JWT."})
    assert isinstance(lint["isError"], bool)


def test_blank_and_whitespace_lines_are_ignored(client):
    client.send_raw(b"\n\n \t \r\n\r\n")
    assert client.request("ping") == {}
    assert client.null_id_errors() == []


def test_big_but_allowed_line(client):
    payload = "x" * (20 * 1024 * 1024)
    assert client.request("ping", {"blob": payload}, timeout=120) == {}


def test_line_over_32_mib(client):
    line = b'{"jsonrpc":"2.0","id":"big","method":"ping","params":{"x":"' + \
        b"a" * (32 * 1024 * 1024) + b'"}}\n'
    client.send_raw(line + b'{"jsonrpc":"2.0","id":"next","method":"ping"}\n')
    client.expect_id("next")
    assert client.wait_null_id_errors(1, timeout=120)[0]["error"]["code"] == -32600
    assert client.wait_response("next", timeout=120)["result"] == {}
    assert not client.answered("big")


def test_line_over_32_mib_arriving_in_pieces(client):
    client.send_raw(b'{"jsonrpc":"2.0","id":"piece","method":"ping","params":{"x":"')
    chunk = b"b" * (4 * 1024 * 1024)
    for _ in range(9):
        client.send_raw(chunk)
    client.send_raw(b'"}}\n')
    assert client.wait_null_id_errors(1, timeout=120)[0]["error"]["code"] == -32600
    assert client.request("ping") == {}
    assert not client.answered("piece")


def test_batches_of_junk_on_2025_03_26(area):
    c = spawn(area[0])
    c.initialize("2025-03-26")
    c.send_raw(b"[1, null, [], {}, \"x\"]\n")
    answers = c.wait_batch(1)
    assert len(answers) == 5 and all(a["error"]["code"] == -32600 and a["id"] is None
                                     for a in answers)
    c.send_raw(b"[" + b",".join([b'{"jsonrpc":"2.0","method":"notifications/x"}'] * 50) + b"]\n")
    assert c.request("ping") == {}
    assert len(c.batches) == 1
    c.assert_clean()
    assert c.close() == 0


# --- EOF in the middle of things ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("tail", [b'{"jsonrpc":"2.0","id":9,"meth', b"[" * 1000, b"\xff\xfe",
                                  b'{"jsonrpc":"2.0","id":"x","method":"ping"}'],
                         ids=["half-object", "open-brackets", "bad-utf8", "complete-no-newline"])
def test_eof_mid_message(area, tail):
    c = spawn(area[0])
    c.initialize()
    c.expect_id("x")
    c.send_raw(tail)
    assert c.close() == 0
    c.assert_clean()


def test_eof_mid_oversized_line(area):
    c = spawn(area[0])
    c.initialize()
    c.send_raw(b'"' + b"z" * (33 * 1024 * 1024))
    assert c.close(timeout=60) == 0
    c.assert_clean()


def test_eof_with_a_call_in_flight(area):
    c = spawn(area[0])
    c.initialize()
    c.start_request("tools/call", {"name": "memshelf_lint_digest",
                                   "arguments": {"digest": DIGEST}})
    assert c.close() == 0
    c.assert_clean()


def test_stdout_closed_by_the_client(area):
    proc = subprocess.Popen([sys.executable, SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=server_env())
    proc.stdout.close()      # the client stops reading: writes fail with EPIPE
    try:
        proc.stdin.write(b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":'
                         b'{"protocolVersion":"2025-11-25"}}\n')
        for _ in range(50):
            proc.stdin.write(b'{"jsonrpc":"2.0","id":2,"method":"ping"}\n')
        proc.stdin.flush()
    except OSError:
        pass      # the server may already be gone: that is the point
    assert proc.wait(30) == 0
    proc.stdin.close()


# --- hostile tool arguments --------------------------------------------------------------------

def nested_object(depth):
    value = "leaf"
    for _ in range(depth):
        value = {"k": value}
    return value


HOSTILE_CALLS = [
    ("memshelf_recall", {"episode_id": "../../../../etc/passwd"}),
    ("memshelf_recall", {"episode_id": ".."}),
    ("memshelf_recall", {"episode_id": "/etc/passwd"}),
    ("memshelf_recall", {"episode_id": "docs/topics/../../../x"}),
    ("memshelf_recall", {"episode_id": "a\x00b"}),
    ("memshelf_recall", {"episode_id": "-rf"}),
    ("memshelf_recall", {"episode_id": "x" * 100000}),
    ("memshelf_recall", {"episode_id": "ok", "section": "../../etc"}),
    ("memshelf_recall", {"episode_id": "ok", "section": "a\nb"}),
    ("memshelf_recall", {"episode_id": "ok", "max_bytes": -5}),
    ("memshelf_recall", {"episode_id": "ok", "max_bytes": 10 ** 200}),
    ("memshelf_recall", {"episode_id": ["list"]}),
    ("memshelf_shelve", {"slug": "../escape", "kind": "topic", "digest": DIGEST,
                         "sections": {"Decisions": "- x"}}),
    ("memshelf_shelve", {"slug": "/abs/path", "kind": "topic", "digest": DIGEST,
                         "sections": {"Decisions": "- x"}}),
    ("memshelf_shelve", {"slug": "2026-07-22-a/b", "kind": "topic", "digest": DIGEST,
                         "sections": {"Decisions": "- x"}}),
    ("memshelf_shelve", {"slug": "2026-07-22-x\ny", "kind": "topic", "digest": DIGEST,
                         "sections": {"Decisions": "- x"}}),
    ("memshelf_shelve", {"slug": "2026-07-22-" + "a" * 5000, "kind": "topic", "digest": DIGEST,
                         "sections": {"Decisions": "- x"}}),
    ("memshelf_shelve", {"slug": "2026-07-22-ok", "kind": "../topic", "digest": DIGEST,
                         "sections": {"Decisions": "- x"}}),
    ("memshelf_shelve", {"slug": "2026-07-22-ok", "kind": "topic", "digest": DIGEST,
                         "sections": {"Decisions": nested_object(400)}}),
    ("memshelf_shelve", {"slug": "2026-07-22-ok", "kind": "topic", "digest": "x " * 500000,
                         "sections": {"Decisions": "- x"}}),
    ("memshelf_shelve", {"slug": "2026-07-22-ok", "kind": "topic", "digest": DIGEST,
                         "sections": {"../../Decisions": "- x"}}),
    ("memshelf_shelve", {"slug": "2026-07-22-ok", "kind": "topic", "digest": DIGEST,
                         "sections": {"Decisions": "- x"}, "tags": ["a\nb"]}),
    ("memshelf_shelve", {"slug": "2026-07-22-ok", "kind": "topic", "digest": DIGEST,
                         "sections": {"Decisions": "- x"}, "date": "2026-02-30"}),
    ("memshelf_shelve", {"slug": "2026-07-22-ok", "kind": "topic", "digest": DIGEST,
                         "sections": {"Decisions": "- x"}, "display_title": "\x1b[31m" * 1000}),
    ("memshelf_shelve", {"slug": "2026-07-22-ok", "kind": "topic", "digest": DIGEST,
                         "sections": {"Decisions": "- x"}, "shelf_path": "relative/../x"}),
    ("memshelf_index", {"category": "../../etc"}),
    ("memshelf_index", {"since": "'; DROP TABLE episodes; --"}),
    ("memshelf_index", {"max_chars": 10 ** 300}, None),
    ("memshelf_index", {"unknown": {"deep": nested_object(300)}}),
    ("memshelf_index", {"params": {"params": {"params": {}}}}),
    ("memshelf_lint_digest", {"digest": "\x00" * 10000}, None),
    ("memshelf_lint_digest", {"digest": 12345}),
    ("memshelf_init", {"shelf_path": "/proc/self/nope", "storage": "git-local"}),
    ("memshelf_init", {"storage": "; rm -rf /"}),
]


@pytest.mark.slow
@pytest.mark.parametrize("call", HOSTILE_CALLS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(HOSTILE_CALLS)])
def test_hostile_arguments(client, area, call):
    """Refused with a tool error (None: any valid answer) and nothing written outside the shelf."""
    name, args, must_fail = (call + (True,))[:3]
    base, shelf = area
    before = tree(base)
    args = dict(args)
    if "shelf_path" not in args and name != "memshelf_lint_digest":
        args["shelf_path"] = shelf
    result = client.call_tool(name, args, timeout=120)
    if must_fail:
        assert result["isError"] is True, text_of(result)
    if result["isError"]:
        lines = text_of(result).split("\n")
        assert lines[-2].startswith("code: ") and lines[-1].startswith("fix: ")
    # nothing new outside the shelf (the shelf's own cache may appear)
    grown = {p for p in tree(base) - before if not p.startswith(os.path.join("inner", "shelf"))}
    assert grown == set()


def test_hostile_shelf_paths(client, area):
    base, _ = area
    for path in ("/", "/etc", "~root", "~nobody-such-user/x", "a\x00b", "\\\\server\\share",
                 "${HOME}", "$(touch pwned)", "/" + "x" * 5000):
        result = client.call_tool("memshelf_index", {"shelf_path": path})
        assert result["isError"] is True, (path, text_of(result))
    assert not os.path.exists(os.path.join(base, "pwned"))


def test_hostile_resource_uris(client):
    for uri in ("memshelf://episode/..%2F..%2Fetc%2Fpasswd", "memshelf://episode/%00",
                "memshelf://episode/%ff%fe", "memshelf://episode/.", "memshelf://episode/x?y=1",
                "memshelf://../../etc/passwd", "file:///etc/passwd", "memshelf://index/../x",
                "memshelf://episode/" + "a" * 100000):
        error = client.request_raw("resources/read", {"uri": uri})["error"]
        assert error["code"] in (-32602, -32002), (uri, error)


def test_hostile_prompt_arguments(client):
    for args in ({"question": "x" * 1000000}, {"question": "${arguments.question}"},
                 {"question": "\x00\x01\x02"}, {"question": "ok", "extra": "ignored"}):
        got = client.request("prompts/get", {"name": "recall", "arguments": args})
        assert got["messages"][0]["role"] == "user"
