"""Damage at rest (issue 18): links out of the shelf are never followed, one damaged episode
is a doctor finding and never the end of a whole command. Everything runs the real CLI."""
import json
import os

import pytest

from conftest import git, run_cli, shelve_args, snapshot

STEM = "2026-07-22-auth-refactor"

EPISODE = """# {id}

---
id: {id}
kind: {kind}
span: 2026-07-23
date: 2026-07-23
tags: [auth, {word}]
approx_tokens: 1200
approx_tokens_source: estimate
mode: live
---

## Digest
Dana chose {word} middleware for the auth refactor; server sessions were rejected. Open: the
key rotation schedule.

## {section}
- {word} is verified once per request in the middleware.
"""


def episode_text(stem, word, kind="topic"):
    section = {"topic": "Decisions", "research": "Findings"}[kind]
    return EPISODE.format(id=stem, kind=kind, word=word, section=section)


@pytest.fixture
def linked(tmp_path):
    """A git shelf with one episode, a research folder linked outside and a linked episode file."""
    root = tmp_path / "shelf"
    assert run_cli("init", "--shelf", root).code == 0
    assert run_cli(*shelve_args(root, extra=["--tag", "auth"])).code == 0
    outside = tmp_path / "outside"
    (outside / "research").mkdir(parents=True)
    (outside / "research" / "2026-07-23-outside-folder.md").write_text(
        episode_text("2026-07-23-outside-folder", "outsideword", "research"))
    (outside / "2026-07-24-outside-file.md").write_text(
        episode_text("2026-07-24-outside-file", "outsidefile"))
    research = root / "docs" / "research"
    if research.exists():
        os.rmdir(research)
    os.symlink(outside / "research", research)
    os.symlink(outside / "2026-07-24-outside-file.md",
               root / "docs" / "topics" / "2026-07-24-outside-file.md")
    return root, outside


def outside_state(outside):
    return {p: (os.path.getsize(os.path.join(d, p)), os.path.getmtime(os.path.join(d, p)))
            for d, _, names in os.walk(outside) for p in names}


def no_outside(r, args=()):
    text = (r.out + r.err).lower()
    for arg in args:   # the query or id as echoed back is not outside content
        text = text.replace(f"'{arg}'", "")
    for word in ("outsideword", "outsidefile"):
        assert word not in text, r


def test_links_are_never_followed(linked, tmp_path):
    root, outside = linked
    before = outside_state(outside)
    s = ["--shelf", root]
    for args, code in (
            (["index"], 0), (["search", "outsideword"], 0), (["search", "outsidefile"], 0),
            (["search", "middleware"], 0), (["tags"], 0), (["graph"], 0), (["graph", "--all"], 0),
            (["retro", "--since", "2026-01-01", "--until", "2026-12-31"], 0),
            (["mirror", "--all"], 0), (["fork", "--episode", STEM], 0), (["stats"], 0),
            (["advise"], 0), (["hook", "session-start"], 0), (["purge"], 0),
            (["recall", "--id", "2026-07-23-outside-folder"], 1),
            (["recall", "--id", "2026-07-24-outside-file"], 1),
            (["recall", "--id", "docs/research/2026-07-23-outside-folder.md"], 1),
            (["fork", "--episode", "2026-07-23-outside-folder"], 1),
            (["mirror", "--episode", "2026-07-24-outside-file"], 1),
            (["rebuild"], 0), (["rebuild", "--check"], 0), (["rebuild", "--commit"], 0)):
        r = run_cli(*args, *s)
        assert r.code == code, (args, r)
        no_outside(r, args)
    # the shelf's own episode is still seen, so the checks above are not vacuous
    assert STEM in run_cli("index", *s).out
    assert "middleware" in run_cli("search", "middleware", *s).out
    index = (root / "INDEX.md").read_text()
    assert STEM in index and "outside" not in index
    assert not os.path.exists(outside / "research" / ".meta.json")
    # doctor names both links and reads neither
    r = run_cli("doctor", *s, "--json")
    no_outside(r)
    found = {(f["code"], f["path"]) for f in r.json()["findings"]}
    assert ("symlink-ignored", "docs/research") in found
    assert ("symlink-ignored", "docs/topics/2026-07-24-outside-file.md") in found
    assert not any(code == "uncommitted-episode" for code, _ in found), found
    # writes refuse with exit 1 (a refusal, not a usage error) and write nothing outside
    r = run_cli("shelve", *s, "--slug", "2026-07-25-new-research", "--kind", "research",
                "--digest", "Priya measured cache hit rates; allkeys-lru won. Open: tuning.",
                "--section", "Findings=94 % hit rate.")
    assert r.code == 1 and "symlink" in r.err and "fix:" in r.err, r
    r = run_cli(*shelve_args(root, slug="2026-07-24-outside-file", extra=["--amend"]))
    assert r.code == 1, r
    r = run_cli("rollup", *s, "--until", "2026-12-31", "--slug", "2026-07-30-auth-rollup",
                "--digest", "Dana folded the auth work into one rollup. Open: key rotation.")
    assert r.code == 0, r
    no_outside(r)
    assert outside_state(outside) == before
    tracked = git(root, "ls-files")
    assert "outside" not in tracked and "2026-07-22-auth-refactor" in tracked
    assert "outside" not in git(root, "log", "-p", "--all")
