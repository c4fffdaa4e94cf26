"""import: exported transcripts (Claude Code JSONL, claude.ai JSON, ChatGPT conversations.json,
plain Markdown) -> a cleaned, redacted working file outside any shelf, with proposed cuts."""
import json
import os
import tempfile

import pytest

import memshelf
from conftest import run_cli, snapshot

TOKEN = "ghp_" + "Q1w2E3r4T5" * 4


def write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def jsonl(path, events):
    return write(path, "".join(json.dumps(e) + "\n" for e in events))


def cc(kind, content, ts, mid=None, **extra):
    message = {"role": kind, "content": content}
    if mid:
        message["id"] = mid
    return dict({"type": kind, "sessionId": "sess-42", "timestamp": ts, "message": message},
                **extra)


CLAUDE_CODE = [
    {"type": "summary", "summary": "Auth refactor and Redis", "leafUuid": "x"},
    cc("user", f"Plan the auth refactor; the old token was {TOKEN}", "2026-07-01T10:00:00.000Z"),
    cc("assistant", [{"type": "thinking", "thinking": "private"},
                     {"type": "text", "text": "JWT middleware, once per request."}],
       "2026-07-01T10:00:05.000Z", "m1"),
    cc("assistant", [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}],
       "2026-07-01T10:00:06.000Z", "m1"),
    cc("user", [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
       "2026-07-01T10:00:07.000Z"),
    cc("user", "<command caveat>", "2026-07-01T10:00:08.000Z", isMeta=True),
    cc("assistant", [{"type": "text", "text": "Middleware merged."}], "2026-07-01T10:01:00.000Z",
       "m2"),
    cc("user", "Sidechain chatter", "2026-07-01T10:02:00.000Z", isSidechain=True),
    cc("user", "Now the Redis eviction policy.", "2026-07-01T13:00:00.000Z"),
    cc("assistant", [{"type": "text", "text": "allkeys-lru with 2 GB."}],
       "2026-07-01T13:00:05.000Z", "m3"),
]


def env_for(tmp_path):
    tmp = tmp_path / "tmpdir"
    tmp.mkdir(exist_ok=True)
    return {"TMPDIR": str(tmp)}, tmp


def only_dir(tmp):
    """The one private folder extract made under TMPDIR (memshelf-import-XXXX, mode 0700)."""
    (found,) = [p for p in tmp.iterdir() if p.name.startswith("memshelf-import-")]
    assert found.stat().st_mode & 0o077 == 0
    return found


# --- the four formats -----------------------------------------------------------------------

def test_claude_code_jsonl_discover_and_extract(tmp_path):
    src = jsonl(tmp_path / "session.jsonl", CLAUDE_CODE)
    with open(src, "rb") as f:
        original = f.read()
    env, out_dir = env_for(tmp_path)
    r = run_cli("import", "discover", "--path", src, "--json", env=env)
    assert r.code == 0, r
    d = r.json()
    assert d["format"] == "claude-code-jsonl" and d["total"] == 1
    conv = d["conversations"][0]
    assert conv["id"] == "sess-42" and conv["title"] == "Auth refactor and Redis"
    assert conv["messages"] == 5 and conv["stripped_blocks"] == 3 and conv["index"] == 0
    assert TOKEN not in r.out
    assert list(out_dir.iterdir()) == []          # discover writes nothing
    r = run_cli("import", "extract", "--path", src, "--json", env=env)
    assert r.code == 0, r
    x = r.json()
    out_dir = only_dir(out_dir)
    assert x["output_path"] == str(out_dir / "auth-refactor-and-redis.md")
    assert f"to {out_dir / 'auth-refactor-and-redis.md'}" in x["summary"]
    assert x["messages"] == 5 and x["stripped_blocks"] == 3
    assert x["redaction"]["counts"] == {"github-token": 1}
    assert 0 < x["noise_ratio"] < 1 and x["source_tokens"] > x["approx_tokens"] > 0
    text = (out_dir / "auth-refactor-and-redis.md").read_text(encoding="utf-8")
    assert text.startswith("# Auth refactor and Redis\n\n> Working copy made by memshelf import")
    assert "Not part of any shelf" in text and "3 tool call/result block(s) stripped" in text
    assert "## [1] user\n\nPlan the auth refactor" in text
    assert "## [2] assistant\n\nJWT middleware, once per request.\n\n## [3] assistant" in text
    assert "private" not in text and "Sidechain" not in text and "caveat" not in text
    assert TOKEN not in text and "«redacted:github-token»" in text
    assert x["proposed_cuts"] == [
        {"from_message": 1, "to_message": 3, "approx_tokens": x["proposed_cuts"][0]["approx_tokens"],
         "first_words": "Plan the auth refactor; the old token was «redacted:github-token»",
         "reason": "start"},
        {"from_message": 4, "to_message": 5, "approx_tokens": x["proposed_cuts"][1]["approx_tokens"],
         "first_words": "Now the Redis eviction policy.", "reason": "gap"}]
    assert "one episode per arc with mode import" in x["next"]
    assert "session episode" in x["next"]
    with open(src, "rb") as f:
        assert f.read() == original      # the source is never modified


def test_jsonl_streams_past_bad_lines_and_no_redact(tmp_path):
    src = tmp_path / "s.jsonl"
    write(src, json.dumps(CLAUDE_CODE[1]) + "\n{truncated\n\n" + json.dumps(CLAUDE_CODE[2]) + "\n")
    out = tmp_path / "work.md"
    r = run_cli("import", "extract", "--path", src, "--out", out, "--no-redact", "--json")
    assert r.code == 0, r
    x = r.json()
    assert x["redaction"] is None and x["redacted"] is False
    assert any("skipped 1 line" in w for w in x["warnings"])
    assert any("--no-redact" in w for w in x["warnings"])
    assert TOKEN in out.read_text(encoding="utf-8")
    assert x["title"].startswith("Plan the auth refactor")   # no summary line: first user words


def claude_ai_export():
    return [
        {"uuid": "c-1", "name": "Billing bug", "chat_messages": [
            {"sender": "human", "text": "", "created_at": "2026-05-01T09:00:00Z",
             "content": [{"type": "text", "text": "The invoice total is off by one cent."}]},
            {"sender": "assistant", "created_at": "2026-05-01T09:00:10Z",
             "content": [{"type": "tool_use", "name": "calc"},
                         {"type": "tool_result", "content": []},
                         {"type": "text", "text": "Rounding happens twice; decided to round once."}]},
            {"sender": "human", "text": "", "content": [{"type": "image"}]},
        ]},
        {"uuid": "c-2", "name": "Trip planning", "chat_messages": [
            {"sender": "human", "text": "Plan a trip to Lisbon with the billing budget."},
            {"sender": "assistant", "text": "Three days in Alfama."},
        ]},
        {"uuid": "c-3", "name": "", "chat_messages": []},
    ]


@pytest.mark.slow
def test_claude_ai_export_markers_select_and_forms(tmp_path):
    src = write(tmp_path / "conversations.json", json.dumps(claude_ai_export()))
    env, out_dir = env_for(tmp_path)
    r = run_cli("import", "discover", "--path", src, "--json", env=env)
    assert r.code == 0, r
    d = r.json()
    assert d["format"] == "claude-json" and d["total"] == 3
    assert [c["id"] for c in d["conversations"]] == ["c-1", "c-2", "c-3"]
    assert d["conversations"][0]["messages"] == 2 and d["conversations"][0]["stripped_blocks"] == 2
    r = run_cli("import", "discover", "--path", src, "--marker", "BILLING", "--marker", "cent",
                "--json", env=env)
    d = r.json()
    assert d["matched"] == 1 and d["conversations"][0]["id"] == "c-1"
    assert "cent" in d["conversations"][0]["snippet"]
    assert run_cli("import", "discover", "--path", src, "--limit", "1", "--json",
                   env=env).json()["truncated"] is True
    # extract needs one conversation
    r = run_cli("import", "extract", "--path", src, env=env)
    assert r.code == 2 and "discover" in r.err
    r = run_cli("import", "extract", "--path", src, "--marker", "billing", env=env)
    assert r.code == 2 and "2 conversations" in r.err
    for select, ident in (("c-2", "c-2"), ("Trip planning", "c-2"), ("0", "c-1")):
        r = run_cli("import", "extract", "--path", src, "--select", select, "--json", env=env)
        assert r.code == 0, r
        assert r.json()["id"] == ident
    (billing,) = out_dir.glob("memshelf-import-*/billing-bug.md")
    assert billing.read_text(encoding="utf-8").count("## [") == 2
    r = run_cli("import", "extract", "--path", src, "--select", "nope", env=env)
    assert r.code == 2 and "discover" in r.err
    r = run_cli("import", "extract", "--path", src, "--select", "2", env=env)
    assert r.code == 1 and "no text messages" in r.err
    # {conversations: [...]} and a single conversation object read the same way
    wrapped = write(tmp_path / "wrapped.json", json.dumps({"conversations": claude_ai_export()}))
    single = write(tmp_path / "single.json", json.dumps(claude_ai_export()[0], indent=2))
    for path in (wrapped, single):
        d = memshelf.import_transcript(method="discover", path=str(path))
        assert d["format"] == "claude-json" and d["conversations"][0]["id"] == "c-1"


def chatgpt_export():
    def node(ident, parent, children, role=None, parts=None, ctype="text", t=None, **msg):
        message = None
        if role:
            message = dict({"author": {"role": role}, "create_time": t,
                            "content": {"content_type": ctype, "parts": parts or []}}, **msg)
        return {"id": ident, "parent": parent, "children": children, "message": message}
    mapping = {
        "root": node("root", None, ["sys"]),
        "sys": node("sys", "root", ["u1"], "system", [""]),
        "u1": node("u1", "sys", ["a1"], "user", ["How should the cache evict?"], t=1000.0),
        "a1": node("a1", "u1", ["u2-old", "u2"], "assistant", ["Use allkeys-lru."], t=1010.0),
        "u2-old": node("u2-old", "a1", [], "user", ["An abandoned branch question"], t=1020.0),
        "u2": node("u2", "a1", ["call"], "user", ["Moving on: the deploy window?"], t=1030.0),
        "call": node("call", "u2", ["tool"], "assistant", ["search('deploy')"], ctype="code",
                     t=1031.0, recipient="browser"),
        "tool": node("tool", "call", ["a2"], "tool", ["results"], t=1032.0),
        "a2": node("a2", "tool", [], "assistant", ["Tuesdays, 10:00 UTC."], t=1040.0),
    }
    return [{"id": "g-1", "title": "Cache and deploys", "mapping": mapping, "current_node": "a2"}]


def test_chatgpt_export_follows_the_active_branch(tmp_path):
    src = write(tmp_path / "conversations.json", json.dumps(chatgpt_export()))
    env, out_dir = env_for(tmp_path)
    r = run_cli("import", "extract", "--path", src, "--json", env=env)
    assert r.code == 0, r
    x = r.json()
    assert x["format"] == "chatgpt-json" and x["id"] == "g-1" and x["messages"] == 4
    assert x["stripped_blocks"] == 2
    text = (only_dir(out_dir) / "cache-and-deploys.md").read_text(encoding="utf-8")
    assert "abandoned" not in text and "search(" not in text and "results" not in text
    assert text.index("How should the cache evict?") < text.index("Tuesdays, 10:00 UTC.")
    assert [(c["from_message"], c["to_message"], c["reason"]) for c in x["proposed_cuts"]] == \
        [(1, 2, "start"), (3, 4, "topic-change")]
    # explicit format that does not match the file
    r = run_cli("import", "discover", "--path", src, "--format", "claude-json", env=env)
    assert r.code == 1 and "not a transcript" in r.err


def test_plain_markdown_transcript_and_round_trip(tmp_path):
    src = write(tmp_path / "chat.md", "# Schema talk\n\nUser: Should ids be UUIDs?\n\n"
                "**Assistant:** Yes, v7 for ordering.\n\n```\nUser: inside a fence stays\n```\n"
                "User: ## Topic: migrations\nplan the rollout\n\nAssistant: Two phases.\n")
    out = tmp_path / "clean.md"
    x = memshelf.import_transcript(method="extract", path=str(src), out=str(out))
    assert x["format"] == "markdown" and x["title"] == "Schema talk" and x["messages"] == 4
    text = out.read_text(encoding="utf-8")
    assert "User: inside a fence stays" in text       # fenced lines are content
    assert "### Topic: migrations" in text            # H2 inside a message is demoted
    assert [c["reason"] for c in x["proposed_cuts"]] == ["start", "heading"]
    # our own working file reads back as a Markdown transcript
    again = memshelf.import_transcript(method="discover", path=str(out))
    assert again["format"] == "markdown" and again["conversations"][0]["messages"] == 4


def test_cuts_are_deterministic_and_need_two_messages(tmp_path):
    events = [cc("user", "New topic: logging", "2026-07-01T10:00:00Z"),
              cc("user", "Moving on: metrics", "2026-07-01T10:01:00Z"),
              cc("assistant", [{"type": "text", "text": "ok"}], "2026-07-01T10:02:00Z", "a"),
              cc("user", "Next question about tracing", "2026-07-01T10:03:00Z"),
              cc("assistant", [{"type": "text", "text": "ok"}], "2026-07-01T10:04:00Z", "b")]
    src = jsonl(tmp_path / "c.jsonl", events)
    first = memshelf.import_transcript(method="extract", path=str(src),
                                       out=str(tmp_path / "a.md"))["proposed_cuts"]
    second = memshelf.import_transcript(method="extract", path=str(src),
                                        out=str(tmp_path / "b.md"))["proposed_cuts"]
    assert first == second
    assert [(c["from_message"], c["to_message"]) for c in first] == [(1, 3), (4, 5)]


# --- what is not a transcript, and where output may go --------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, data", [
    ("random.json", b'{"name": "config", "value": 3}'),
    ("numbers.json", b"[1, 2, 3]"),
    ("empty.json", b""),
    ("blank.jsonl", b"\n\n  \n"),
    ("binary.bin", bytes(range(256)) * 8),
    ("latin1.json", "[{\"name\": \"caf\xe9\"}]".encode("latin-1")),
    ("events.jsonl", b'{"type": "progress", "pct": 10}\n{"type": "progress", "pct": 20}\n'),
    ("notes.md", b"# Notes\n\nJust a list of things to buy.\n"),
    ("bad.json", b"[{\"chat_messages\": [}"),
])
def test_not_a_transcript_is_refused_and_writes_nothing(tmp_path, name, data):
    src = tmp_path / name
    src.write_bytes(data)
    env, out_dir = env_for(tmp_path)
    for method in ("discover", "extract"):
        r = run_cli("import", method, "--path", src, "--json", env=env)
        assert r.code == 1, r
        err = r.json()["error"]
        assert err["code"] == "io-error" and "Traceback" not in r.err
        assert os.path.realpath(src) in err["message"]
    assert list(out_dir.iterdir()) == []
    assert src.read_bytes() == data


def test_missing_source_and_bad_arguments(tmp_path):
    r = run_cli("import", "discover", "--path", tmp_path / "nope.json", "--json")
    assert r.code == 1 and r.json()["error"]["code"] == "io-error"
    assert "no such file" in r.json()["error"]["message"]
    r = run_cli("import", "discover", "--path", tmp_path)
    assert r.code == 1 and "not a regular file" in r.err
    r = run_cli("import", "sideways", "--path", tmp_path / "x")
    assert r.code == 2
    src = jsonl(tmp_path / "s.jsonl", CLAUDE_CODE)
    assert run_cli("import", "extract", "--path", src, "--out", src).code == 2   # never the source


def test_cli_out_is_never_inside_a_git_directory(tmp_path):
    src = jsonl(tmp_path / "s.jsonl", CLAUDE_CODE)
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    before = snapshot(tmp_path / "repo")
    for out in (tmp_path / "repo" / ".git" / "x.md", tmp_path / "repo" / ".git"):
        r = run_cli("import", "extract", "--path", src, "--out", out)
        assert r.code == 2, r
        assert ".git" in r.err
    assert snapshot(tmp_path / "repo") == before
    assert os.listdir(tmp_path / "repo" / ".git") == []
    r = run_cli("import", "extract", "--path", src, "--out", tmp_path / "missing" / "x.md")
    assert r.code == 1 and "does not exist" in r.err


def test_mcp_out_is_a_bare_name_under_the_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    src = jsonl(tmp_path / "s.jsonl", CLAUDE_CODE)
    r = memshelf.call_tool("memshelf_import", {"method": "extract", "path": str(src),
                                               "out": "auth-notes.md"})
    (made,) = (tmp_path / "tmp").iterdir()
    assert made.name.startswith("memshelf-import-") and made.stat().st_mode & 0o077 == 0
    assert r["output_path"] == str(made / "auth-notes.md")
    assert os.path.isfile(r["output_path"])
    for bad in ("../escape.md", "/etc/x.md", str(tmp_path / "abs.md"), ".git", "..",
                "-rf", "a\\b.md", "line\nbreak.md", "CON.md", "dir/x.md"):
        with pytest.raises(memshelf.ShelfError) as exc:
            memshelf.call_tool("memshelf_import", {"method": "extract", "path": str(src),
                                                   "out": bad})
        assert exc.value.code == "usage", bad
    assert os.listdir(tmp_path / "tmp") == [made.name] and os.listdir(made) == ["auth-notes.md"]
    assert not os.path.exists(tmp_path / "abs.md")
    # discover over MCP: no shelf needed, nothing written
    d = memshelf.call_tool("memshelf_import", {"method": "discover", "path": str(src)})
    assert d["conversations"][0]["id"] == "sess-42"
