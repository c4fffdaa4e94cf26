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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("linked_dir", ["archive", "docs"])
def test_linked_archive_or_docs_folder_is_never_followed(tmp_path, linked_dir):
    root = tmp_path / "shelf"
    assert run_cli("init", "--shelf", root).code == 0
    assert run_cli(*shelve_args(root)).code == 0
    outside = tmp_path / "outside"
    for sub, stem, word in (("docs/topics", "2026-07-23-outside-docs", "outsideword"),
                            ("archive/docs/topics", "2026-07-24-outside-arch", "outsidefile")):
        (outside / sub).mkdir(parents=True)
        (outside / sub / f"{stem}.md").write_text(episode_text(stem, word))
    if linked_dir == "docs":
        os.rename(root / "docs", tmp_path / "docs-moved")
    os.symlink(outside / linked_dir, root / linked_dir)
    before = outside_state(outside)
    s = ["--shelf", root]
    for args, code in ((["index"], 0), (["search", "outsideword"], 0),
                       (["search", "outsidefile"], 0), (["graph", "--all"], 0),
                       (["mirror", "--all"], 0), (["tags"], 0),
                       (["recall", "--id", "2026-07-24-outside-arch"], 1),
                       (["recall", "--id", "2026-07-23-outside-docs"], 1),
                       (["rebuild"], 0)):
        r = run_cli(*args, *s)
        assert r.code == code, (args, r)
        no_outside(r, args)
    r = run_cli("doctor", *s, "--json")
    no_outside(r)
    assert ("symlink-ignored", linked_dir) in {(f["code"], f["path"])
                                               for f in r.json()["findings"]}
    if linked_dir == "archive":   # a rollup would move episodes through the link: refused
        r = run_cli("rollup", *s, "--until", "2026-12-31", "--slug", "2026-07-30-auth-rollup",
                    "--digest", "Dana folded the auth work into one rollup. Open: key rotation.")
        assert r.code == 1 and "symlink" in r.err and "fix:" in r.err, r
        assert (root / "docs" / "topics" / f"{STEM}.md").exists()
    assert outside_state(outside) == before


@pytest.fixture
def damaged(tmp_path):
    """A git shelf with one good episode and three damaged ones put there by hand."""
    root = tmp_path / "shelf"
    assert run_cli("init", "--shelf", root).code == 0
    assert run_cli(*shelve_args(root)).code == 0
    topics = root / "docs" / "topics"
    good = (topics / f"{STEM}.md").read_bytes()
    (topics / "2026-07-23-random-bytes.md").write_bytes(bytes(range(256)) * 12)
    (topics / "2026-07-24-nul-byte.md").write_bytes(
        good.replace(STEM.encode(), b"2026-07-24-nul-byte").replace(b"verified", b"veri\0fied")
        + b"\n## Artifacts\n- staging token ghp_" + b"aB3dE5fG7hJ9kL1mN2pQ4rS6tU8vW0xY2zA4\n")
    (topics / "2026-07-25-bad-utf8.md").write_bytes(
        good.replace(STEM.encode(), b"2026-07-25-bad-utf8").replace(b"verified", b"ver\xff\xfe"))
    return root


DAMAGED = ("2026-07-23-random-bytes", "2026-07-24-nul-byte", "2026-07-25-bad-utf8")


@pytest.mark.slow
def test_damaged_episodes_are_findings_never_the_end_of_a_view(damaged):
    root = damaged
    s = ["--shelf", root]
    r = run_cli("doctor", *s, "--json")
    assert r.code == 1, r
    found = {f["path"]: f for f in r.json()["findings"] if f["code"] == "episode-binary"}
    assert sorted(found) == [f"docs/topics/{d}.md" for d in DAMAGED]
    assert "NUL" in found["docs/topics/2026-07-24-nul-byte.md"]["detail"]
    assert "UTF-8" in found["docs/topics/2026-07-25-bad-utf8.md"]["detail"]
    assert all(f["level"] == "error" and "fix" in f for f in found.values())
    # the content of a damaged episode is still checked
    assert ("secret-at-rest", "docs/topics/2026-07-24-nul-byte.md") in {
        (f["code"], f["path"]) for f in r.json()["findings"]}
    # the damage replaces the format findings it would otherwise cause
    noise = [f for f in r.json()["findings"] if f["path"] in found
             and f["code"] in ("frontmatter-invalid", "no-digest", "no-frontmatter")]
    assert not noise, noise
    # the views skip each damaged episode with a warning and still answer
    for args in (["mirror", "--all"], ["graph", "--all"],
                 ["retro", "--since", "2026-01-01", "--until", "2026-12-31"]):
        r = run_cli(*args, *s)
        assert r.code == 0, (args, r)
        assert "\0" not in r.out + r.err
        for d in DAMAGED:
            assert f"docs/topics/{d}.md" in r.err, (args, r)
        assert "skipped" in r.err
    r = run_cli("mirror", "--all", *s, "--json")
    assert r.code == 0 and r.json()["episodes"] == [STEM], r
    assert {x["id"] for x in r.json()["skipped"]} == set(DAMAGED)
    assert "JWT verified once per request" in r.json()["html"]
    r = run_cli("mirror", "--episode", "2026-07-24-nul-byte", *s, "--json")
    assert r.code == 0 and r.json()["episodes"] == [], r
    # recall never prints a raw NUL: that episode is refused, with the fix
    r = run_cli("recall", "--id", "2026-07-24-nul-byte", *s)
    assert r.code == 1 and "NUL" in r.err and "fix:" in r.err and "\0" not in r.out + r.err, r
    r = run_cli("recall", "--id", "2026-07-24-nul-byte", "--section", "Decisions", *s, "--json")
    assert r.code == 1 and r.json()["error"]["code"] == "episode-invalid", r
    r = run_cli("recall", "--id", "2026-07-25-bad-utf8", *s)
    assert r.code == 1 and "UTF-8" in r.err and "fix:" in r.err, r
    assert run_cli("recall", "--id", STEM, *s).code == 0
    r = run_cli("search", "veri", *s)
    assert r.code == 0 and "\0" not in r.out, r
    for args in (["index"], ["tags"], ["stats"], ["rebuild"], ["fork", "--episode", STEM]):
        r = run_cli(*args, *s)
        assert r.code == 0 and "\0" not in r.out + r.err, (args, r)


def test_oversize_episode_is_a_finding(tmp_path):
    root = tmp_path / "shelf"
    assert run_cli("init", "--shelf", root, "--storage", "plain").code == 0
    assert run_cli(*shelve_args(root)).code == 0
    big = root / "docs" / "topics" / "2026-07-26-huge.md"
    good = (root / "docs" / "topics" / f"{STEM}.md").read_text()
    big.write_text(good.replace(STEM, "2026-07-26-huge") + "x" * (8 * 1024 * 1024 + 10))
    r = run_cli("doctor", "--shelf", root, "--json")
    assert r.code == 1, r
    found = [f for f in r.json()["findings"] if f["path"] == "docs/topics/2026-07-26-huge.md"]
    assert [f["code"] for f in found if f["level"] == "error"] == ["episode-oversize"], found
    assert "8.0 MiB" in found[0]["detail"] and "8 MiB" in found[0]["fix"]


@pytest.mark.slow
@pytest.mark.parametrize("rel", ["INDEX.md", "ledger.tsv", "docs/topics/.meta.json"])
def test_derived_file_replaced_by_a_directory(tmp_path, rel):
    root = tmp_path / "shelf"
    assert run_cli("init", "--shelf", root).code == 0
    assert run_cli(*shelve_args(root)).code == 0
    path = root / rel
    path.unlink()
    path.mkdir()
    (path / "keep").write_text("mine")
    before = snapshot(root)
    for args in (["rebuild"], ["rebuild", "--commit"]):
        r = run_cli(*args, "--shelf", root)
        assert r.code == 1, (args, r)
        assert "directory" in r.err and "fix: a file belongs there" in r.err, r
        assert "Traceback" not in r.err and "Errno" not in r.err
    assert snapshot(root) == before
    r = run_cli("doctor", "--shelf", root, "--json")
    assert r.code == 1, r
    codes = [(f["code"], f["path"]) for f in r.json()["findings"] if f["path"] == rel]
    assert codes == [("derived-not-file", rel)], codes
    assert all("memshelf rebuild" in f["fix"] for f in r.json()["findings"]
               if f["code"] == "derived-not-file")
    r = run_cli(*shelve_args(root, slug="2026-07-27-after-damage"))
    assert r.code == 1 and "fix: a file belongs there" in r.err, r
    assert (path / "keep").read_text() == "mine"
