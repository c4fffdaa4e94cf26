"""Lifecycle on real git shelves: rollup into archive/, purge by retain_until, supersedes links
and provenance fields; refusals write nothing."""
import json
import os
import shutil

import pytest

import memshelf
from conftest import git, run_cli, snapshot

SECTIONS = {"topic": {"Decisions": "- Decided in the episode."},
            "research": {"Findings": "- Found in the episode."},
            "session": {"Timeline": "1. Worked.", "Open threads": "- Follow-up."}}


def make_shelf(tmp_path, storage="git-local", **kw):
    # no local hooks: each would start a Python process per commit (test_hooks covers them)
    root = tmp_path / "shelf"
    memshelf.init(shelf_path=str(root), storage=storage, hooks=False, **kw)
    return root


def clone(template, tmp_path):
    """A private copy of a shelf built once per module (git history included)."""
    root = tmp_path / "shelf"
    shutil.copytree(template, root, symlinks=True, ignore=shutil.ignore_patterns(".memshelf"))
    return root


def put(root, slug, kind="topic", digest=None, **kw):
    digest = digest or f"Dana chose the {slug[11:]} plan; open: a follow-up review."
    return memshelf.shelve(shelf_path=str(root), slug=slug, kind=kind, digest=digest,
                           sections=kw.pop("sections", SECTIONS[kind]), **kw)


def head(root):
    return git(root, "rev-parse", "HEAD").strip()


def status(root):
    return git(root, "status", "--porcelain").strip()


def read(root, rel):
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def period_template(tmp_path_factory):
    """Two January episodes and one February episode on a git-local shelf."""
    root = make_shelf(tmp_path_factory.mktemp("period"))
    put(root, "2026-01-05-auth-refactor", display_title="Auth refactor", tags=["auth"])
    put(root, "2026-01-10-redis-cache", kind="research", tags=["redis"])
    put(root, "2026-02-10-release-prep", kind="session")
    return root


@pytest.fixture
def period(period_template, tmp_path):
    return clone(period_template, tmp_path)


ROLLUP_DIGEST = ("January: Dana chose JWT middleware and Priya chose allkeys-lru for the cache. "
                 "Open: key rotation.")


# --- rollup ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_rollup_moves_originals_into_the_archive_in_one_commit(period):
    before = head(period)
    r = run_cli("rollup", "--shelf", period, "--slug", "2026-01-31-january", "--until",
                "2026-01-31", "--digest", ROLLUP_DIGEST, "--date", "2026-02-01", "--json")
    assert r.code == 0, r
    res = r.json()
    assert res["status"] == "ok" and res["count"] == 2 and res["committed"]
    assert res["archived"] == ["2026-01-05-auth-refactor", "2026-01-10-redis-cache"]
    assert res["index_tokens_after"] < res["index_tokens_before"]
    # originals moved, keeping file name and category
    for rel in ("topics/2026-01-05-auth-refactor.md", "research/2026-01-10-redis-cache.md"):
        assert not os.path.exists(period / "docs" / rel)
        assert os.path.isfile(period / "archive" / "docs" / rel)
    # one commit with exactly the moves, the rollup, the sub-shelf config and derived files
    assert git(period, "rev-parse", "HEAD~1").strip() == before
    assert git(period, "log", "-1", "--format=%s").strip() == \
        "rollup: 2026-01-31-january (2 episodes)"
    changed = git(period, "show", "--name-status", "--no-renames", "--format=", "HEAD")
    rows = {tuple(line.split("\t")) for line in changed.strip().split("\n")}
    assert ("D", "docs/topics/2026-01-05-auth-refactor.md") in rows
    assert ("A", "archive/docs/topics/2026-01-05-auth-refactor.md") in rows
    assert ("A", "docs/topics/2026-01-31-january.md") in rows
    assert ("A", "archive/.docshelf.json") in rows and ("A", "archive/INDEX.md") in rows
    assert status(period) == ""
    # the archive sub-shelf
    cfg = json.loads(read(period, "archive/.docshelf.json"))
    assert cfg["name"] == "Memory shelf — archive"
    assert cfg["preamble"].startswith("Archive of episodes folded into rollups")
    archive_index = read(period, "archive/INDEX.md")
    assert archive_index.startswith("# Memory shelf — archive\n")
    assert "- 2026-01-05-auth-refactor **Auth refactor**" in archive_index
    assert "- 2026-01-10-redis-cache" in archive_index
    index = read(period, "INDEX.md")
    assert "2026-01-05-auth-refactor" not in index and "2026-01-31-january" in index
    # the rollup episode
    fields, body = memshelf.parse_frontmatter(read(period, "docs/topics/2026-01-31-january.md"))
    assert fields["kind"] == "topic" and fields["tags"] == ["rollup"]
    # no folded episode was measured: nothing absorbed to claim (issue 30)
    assert fields["approx_tokens"] == "0" and fields["approx_tokens_source"] == "unmeasured"
    assert fields["span"] == "2026-01-05..2026-01-10" and fields["date"] == "2026-02-01"
    assert fields["keywords"] == res["keywords"] and fields["keywords"]
    # the INDEX line is the rollup's own digest, as for every episode (issue 22), then its
    # keywords (issue 30), capped
    assert fields["description"] == memshelf._cap_description(
        memshelf._first_sentence(ROLLUP_DIGEST) + " Keywords: " + ", ".join(res["keywords"]) +
        ".")[0]
    assert f"2026-01-31-january — {fields['description']}" in index
    assert "## Decisions\n" in body
    archived = body.split("## Archived\n", 1)[1]
    assert "[archive](../../archive/INDEX.md)" in archived
    assert "- 2026-01-05-auth-refactor — Auth refactor" in archived
    assert "\n- 2026-01-10-redis-cache — " in archived
    # derived files match a fresh render; the shelf is healthy
    check = run_cli("rebuild", "--shelf", period, "--check")
    assert check.code == 0, check
    doc = memshelf.doctor(shelf_path=str(period))
    assert doc["healthy"], doc["findings"]
    assert not [f for f in doc["findings"] if f["level"] == "warning"], doc["findings"]


def test_archived_episodes_stay_reachable(period):
    memshelf.rollup(shelf_path=str(period), slug="2026-01-31-january", until="2026-01-31",
                    digest=ROLLUP_DIGEST)
    r = run_cli("recall", "--shelf", period, "--id", "2026-01-05-auth-refactor", "--section",
                "decisions", "--json")
    assert r.code == 0, r
    assert r.json()["archived"] is True
    assert r.json()["address"] == "archive/docs/topics/2026-01-05-auth-refactor.md"
    hits = memshelf.search(shelf_path=str(period), query="redis-cache")["hits"]
    assert any(h["id"] == "2026-01-10-redis-cache" and h["archived"] for h in hits)
    ledger = read(period, "ledger.tsv")
    assert "\t2026-01-05-auth-refactor\t" in ledger and "\t2026-01-31-january\t" in ledger
    st = memshelf.stats(shelf_path=str(period))
    assert st["episodes"] == 2 and st["episodes_archived"] == 2   # counted apart (issue 30)
    assert memshelf.index(shelf_path=str(period), archive=True)["entries_total"] == 2


@pytest.mark.slow
def test_rollup_keywords_rank_by_units_then_date_then_name(tmp_path):
    root = make_shelf(tmp_path)
    put(root, "2026-01-01-a", tags=["alpha"], display_title="Zeta Plan",
        digest="Dana chose alpha routing; open: beta.")
    put(root, "2026-01-02-b", tags=["beta"], digest="Priya chose beta caching; open: gamma.")
    put(root, "2026-01-03-c", tags=["gamma"],
        digest="Omar decided the gamma rollout for alpha; open: docs.")
    r = memshelf.rollup(shelf_path=str(root), slug="2026-01-31-r1", until="2026-01-03",
                        digest="Three January topics were settled by Dana, Priya and Omar; "
                               "open: docs.", date="2026-01-31")
    assert r["keywords"] == ["alpha", "gamma", "beta", "docs", "omar", "rollout", "caching",
                             "priya"]
    text = read(root, "docs/topics/2026-01-31-r1.md")
    # the caller's digest stays as written; the keywords go to frontmatter (issue 30)
    assert "Omar; open: docs.\n\n## Decisions" in text and "keywords: [alpha, gamma, beta" in text
    # a rollup absorbed by a later rollup contributes its stored keywords only
    put(root, "2026-02-01-d", tags=["delta"], digest="Lena chose delta sharding; open: epsilon.")
    r2 = memshelf.rollup(shelf_path=str(root), slug="2026-02-28-r2",
                         episode_ids=["2026-01-31-r1", "2026-02-01-d"],
                         digest="Two periods folded: Lena chose sharding; open: epsilon.",
                         date="2026-02-28")
    assert r2["keywords"] == ["delta", "epsilon", "lena", "sharding", "alpha", "beta",
                              "caching", "docs"]
    fields, _ = memshelf.parse_frontmatter(read(root, "docs/topics/2026-02-28-r2.md"))
    assert fields["span"] == "2026-01-01..2026-02-01"
    assert os.path.isfile(root / "archive/docs/topics/2026-01-31-r1.md")
    assert status(root) == ""


def test_rollup_keeps_a_120_word_digest_as_written(tmp_path):
    """Issue 30: no Keywords sentence is appended; the digest is the caller's."""
    root = make_shelf(tmp_path)
    put(root, "2026-01-01-a", tags=["alpha", "beta", "gamma", "delta"])
    put(root, "2026-01-02-b", tags=["alpha", "epsilon", "zeta", "theta"])
    digest = "Dana chose the plan. " + " ".join(["word"] * 112) + " Open: review."
    r = memshelf.rollup(shelf_path=str(root), slug="2026-01-31-r", until="2026-01-31",
                        digest=digest)
    assert len(r["keywords"]) == 8
    body = memshelf.parse_frontmatter(read(root, "docs/topics/2026-01-31-r.md"))[1]
    assert body.split("## Digest\n", 1)[1].split("\n\n## ", 1)[0] == digest


def test_rollup_redacts_its_digest_and_sections(period):
    token = "ghp_" + "a1B2c3D4e5" * 4
    r = memshelf.rollup(shelf_path=str(period), slug="2026-01-31-january", until="2026-01-31",
                        digest=f"January: Dana chose JWT and rotated {token}. Open: audit.",
                        sections={"Artifacts": f"- deploy key {token}"})
    assert r["redaction"]["total"] == 2
    assert r["redaction"]["counts"] == {"github-token": 2}
    text = read(period, "docs/topics/2026-01-31-january.md")
    # digest, Artifacts, and the description (the digest's first sentence)
    assert token not in text and text.count("«redacted:github-token»") == 3


def snapshot_and_head(root):
    return snapshot(root), head(root)


@pytest.mark.parametrize("args, code, words", [
    (["--slug", "2026-01-31-x", "--episode", "2026-01-05-auth-refactor", "--episode",
      "2026-09-09-nope"], 1, "2026-09-09-nope"),
    (["--slug", "2026-01-31-x", "--until", "2025-12-31"], 1, "nothing to fold"),
    (["--slug", "2026-01-31-x", "--until", "2026-01-31", "--kind", "session"], 1,
     "nothing to fold"),
    (["--slug", "2026-01-05-auth-refactor", "--until", "2026-01-31"], 1, "fold itself"),
    (["--slug", "2026-02-10-release-prep", "--episode", "2026-01-05-auth-refactor"], 1,
     "already exists"),
    (["--slug", "2026-01-31-x", "--until", "2026-01-31", "--episode", "2026-01-05-auth-refactor"],
     2, "not both"),
    (["--slug", "2026-01-31-x"], 2, "nothing selects"),
    (["--slug", "Bad Slug", "--until", "2026-01-31"], 2, "slug"),
    (["--slug", "2026-01-31-x", "--until", "2026-13-01"], 2, "not a real"),
    (["--slug", "2026-01-31-x", "--until", "2026-01-31", "--section", "Archived=x"], 2,
     "Archived"),
])
def test_rollup_refusals_write_nothing(period, args, code, words):
    before = snapshot_and_head(period)
    r = run_cli("rollup", "--shelf", period, "--digest", ROLLUP_DIGEST, *args)
    assert r.code == code, r
    assert words in r.err
    assert "Traceback" not in r.err
    assert snapshot_and_head(period) == before
    assert not os.path.exists(period / "archive")


def test_rollup_of_archived_members_and_existing_rollup_is_refused(period):
    memshelf.rollup(shelf_path=str(period), slug="2026-01-31-january", until="2026-01-31",
                    digest=ROLLUP_DIGEST)
    before = snapshot_and_head(period)
    r = run_cli("rollup", "--shelf", period, "--slug", "2026-02-28-again", "--digest",
                ROLLUP_DIGEST, "--episode", "2026-01-05-auth-refactor", "--json")
    assert r.code == 1, r
    err = r.json()["error"]
    assert err["code"] == "rollup-invalid" and "archive" in err["message"]
    r = run_cli("rollup", "--shelf", period, "--slug", "2026-01-31-january", "--digest",
                ROLLUP_DIGEST, "--episode", "2026-02-10-release-prep")
    assert r.code == 1 and "already exists" in r.err
    assert snapshot_and_head(period) == before


def test_rollup_digest_contract_refuses_and_writes_nothing(period):
    before = snapshot_and_head(period)
    r = run_cli("rollup", "--shelf", period, "--slug", "2026-01-31-x", "--until", "2026-01-31",
                "--digest", "We folded January. Open: nothing.", "--json")
    assert r.code == 1, r
    assert r.json()["error"]["code"] == "digest-rejected"
    assert "referent-we" in r.json()["error"]["message"]
    assert snapshot_and_head(period) == before


def test_rollup_dry_run_reports_and_writes_nothing(period):
    before = snapshot_and_head(period)
    r = run_cli("rollup", "--shelf", period, "--slug", "2026-01-31-january", "--until",
                "2026-01-31", "--digest", ROLLUP_DIGEST, "--dry-run", "--json")
    assert r.code == 0, r
    res = r.json()
    assert res["status"] == "dry-run" and res["count"] == 2
    assert res["moves"][0]["to"] == "archive/docs/topics/2026-01-05-auth-refactor.md"
    assert res["episode_text"].startswith("# 2026-01-31-january\n")
    assert "## Archived\n" in res["episode_text"]
    assert res["index_tokens_after"] < res["index_tokens_before"]
    assert snapshot_and_head(period) == before


def test_rollup_git_failure_restores_every_file(period):
    hook = period / ".git" / "hooks" / "pre-commit"
    hook.write_text("#!/bin/sh\necho refused by test hook >&2\nexit 1\n")
    os.chmod(hook, 0o755)
    before = snapshot_and_head(period)
    r = run_cli("rollup", "--shelf", period, "--slug", "2026-01-31-january", "--until",
                "2026-01-31", "--digest", ROLLUP_DIGEST, "--json")
    assert r.code == 1, r
    assert r.json()["error"]["code"] == "git-failed"
    assert snapshot_and_head(period) == before
    assert not os.path.exists(period / "archive")
    assert status(period) == ""


def test_rollup_by_ids_and_kinds(period):
    r = memshelf.rollup(shelf_path=str(period), slug="2026-02-28-sessions", until="2026-12-31",
                        kinds=["session"], digest="Sessions folded: Dana decided the release. "
                                                  "Open: changelog.")
    assert r["archived"] == ["2026-02-10-release-prep"]
    r = memshelf.rollup(shelf_path=str(period), slug="2026-03-01-two",
                        episode_ids=["docs/research/2026-01-10-redis-cache.md",
                                     "2026-01-05-auth-refactor", "2026-01-05-auth-refactor"],
                        digest=ROLLUP_DIGEST)
    assert r["archived"] == ["2026-01-05-auth-refactor", "2026-01-10-redis-cache"]
    assert status(period) == ""


def test_rollup_in_bot_mode_commits_no_derived_files(tmp_path):
    root = make_shelf(tmp_path, derived="bot")
    put(root, "2026-01-05-a")
    put(root, "2026-01-06-b")
    index_before = read(root, "INDEX.md")
    r = memshelf.rollup(shelf_path=str(root), slug="2026-01-31-r", until="2026-01-31",
                        digest=ROLLUP_DIGEST)
    assert r["committed"] and r["derived"] == {"mode": "bot", "written": []}
    names = set(git(root, "show", "--name-only", "--no-renames", "--format=", "HEAD").split())
    assert names == {"archive/.docshelf.json", "docs/topics/2026-01-31-r.md",
                     "docs/topics/2026-01-05-a.md", "docs/topics/2026-01-06-b.md",
                     "archive/docs/topics/2026-01-05-a.md", "archive/docs/topics/2026-01-06-b.md"}
    assert read(root, "INDEX.md") == index_before


def test_rollup_on_a_plain_shelf(tmp_path):
    root = make_shelf(tmp_path, storage="plain")
    put(root, "2026-01-05-a")
    r = run_cli("rollup", "--shelf", root, "--slug", "2026-01-31-r", "--until", "2026-01-31",
                "--digest", ROLLUP_DIGEST, "--json")
    assert r.code == 0, r
    assert r.json()["committed"] is False
    assert os.path.isfile(root / "archive/docs/topics/2026-01-05-a.md")
    assert "rolled up 1 episode into 2026-01-31-r" in r.json()["summary"]


# --- purge ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def retained_template(tmp_path_factory):
    root = make_shelf(tmp_path_factory.mktemp("retained"))
    put(root, "2026-01-05-old", retain_until="2026-02-01")
    put(root, "2026-01-06-folded", retain_until="2026-02-15")
    put(root, "2026-01-07-today", retain_until="2026-03-01")
    put(root, "2026-01-08-later", retain_until="2026-12-31")
    put(root, "2026-01-09-forever", supersedes=["2026-01-05-old"])
    memshelf.rollup(shelf_path=str(root), slug="2026-01-31-r", episode_ids=["2026-01-06-folded"],
                    digest=ROLLUP_DIGEST)
    return root


@pytest.fixture
def retained(retained_template, tmp_path):
    return clone(retained_template, tmp_path)


@pytest.mark.slow
def test_purge_is_a_dry_run_by_default(retained):
    before = snapshot_and_head(retained)
    r = run_cli("purge", "--shelf", retained, "--today", "2026-03-01", "--json")
    assert r.code == 0, r
    res = r.json()
    assert res["applied"] is False and res["count"] == 2 and res["deleted"] == []
    assert [e["id"] for e in res["expired"]] == ["2026-01-06-folded", "2026-01-05-old"]
    assert res["expired"][0]["archived"] is True
    assert "dry run — re-run with --apply to delete" in r.err
    assert snapshot_and_head(retained) == before
    human = run_cli("purge", "--shelf", retained, "--today", "2026-03-01")
    assert "docs/topics/2026-01-05-old.md" in human.out


def test_purge_apply_deletes_renders_and_commits(retained):
    r = run_cli("purge", "--shelf", retained, "--today", "2026-03-01", "--apply", "--json")
    assert r.code == 0, r
    res = r.json()
    assert res["applied"] and res["committed"] and res["count"] == 2
    assert sorted(res["deleted"]) == ["archive/docs/topics/2026-01-06-folded.md",
                                      "docs/topics/2026-01-05-old.md"]
    assert "git history" in res["note"] and "filter-repo" in res["note"]
    assert "no memshelf verb" in res["note"]
    assert any("supersedes 2026-01-05-old" in w for w in res["warnings"])
    assert git(retained, "log", "-1", "--format=%s").strip() == \
        "purge: 2 episode(s) past retain_until"
    assert status(retained) == ""
    for rel in res["deleted"]:
        assert not os.path.exists(retained / rel)
    assert os.path.exists(retained / "docs/topics/2026-01-07-today.md")   # equal date is kept
    assert "2026-01-05-old" not in read(retained, "INDEX.md")
    assert "2026-01-06-folded" not in read(retained, "archive/INDEX.md")
    assert "2026-01-05-old" not in read(retained, "ledger.tsv")
    assert run_cli("rebuild", "--shelf", retained, "--check").code == 0
    # git history still holds the files, as the note says
    assert "Dana chose" in git(retained, "show", "HEAD~1:docs/topics/2026-01-05-old.md")
    again = memshelf.purge(shelf_path=str(retained), today="2026-03-01", apply=True)
    assert again["count"] == 0 and not again["committed"]


def test_purge_without_commit_and_bad_input(retained):
    before = snapshot_and_head(retained)
    r = run_cli("purge", "--shelf", retained, "--today", "03/01/2026")
    assert r.code == 2 and "not a real" in r.err
    assert snapshot_and_head(retained) == before
    r = memshelf.purge(shelf_path=str(retained), today="2026-03-01", apply=True,
                       autocommit=False)
    assert r["applied"] and not r["committed"]
    assert head(retained) == before[1]
    assert "docs/topics/2026-01-05-old.md" in status(retained)


def test_purge_on_a_plain_shelf_says_the_files_are_gone(tmp_path):
    root = make_shelf(tmp_path, storage="plain")
    put(root, "2026-01-05-old", retain_until="2026-02-01")
    r = memshelf.purge(shelf_path=str(root), today="2026-03-01", apply=True)
    assert r["deleted"] == ["docs/topics/2026-01-05-old.md"] and not r["committed"]
    assert "no history" in r["note"]
    assert not os.path.exists(root / "stats.svg")   # nothing left to chart


# --- supersedes and provenance --------------------------------------------------------------

def test_supersedes_marks_index_recall_and_doctor(tmp_path):
    root = make_shelf(tmp_path)
    put(root, "2026-01-05-cache-v1")
    r = run_cli("shelve", "--shelf", root, "--slug", "2026-02-01-cache-v2", "--kind", "topic",
                "--digest", "Priya chose cache v2 over v1; open: metrics.", "--section",
                "Decisions=- v2", "--supersedes", "2026-01-05-cache-v1", "--json")
    assert r.code == 0, r
    fields, _ = memshelf.parse_frontmatter(read(root, "docs/topics/2026-02-01-cache-v2.md"))
    assert fields["supersedes"] == ["2026-01-05-cache-v1"]
    index = read(root, "INDEX.md")
    line = next(l for l in index.split("\n") if l.startswith("- 2026-01-05-cache-v1"))
    assert line.endswith(" [superseded by 2026-02-01-cache-v2]")
    assert memshelf._ENTRY_LINE.match(line).group(5) == "2026-02-01-cache-v2"
    rec = memshelf.recall(shelf_path=str(root), episode_id="2026-01-05-cache-v1", log=False)
    assert rec["superseded_by"] == ["2026-02-01-cache-v2"]
    assert "superseded by 2026-02-01-cache-v2" in rec["content"]
    assert memshelf.doctor(shelf_path=str(root))["healthy"]
    # an INDEX that lists the superseded episode without its marker is reported
    with open(root / "INDEX.md", "w", encoding="utf-8") as f:
        f.write(index.replace(" [superseded by 2026-02-01-cache-v2]", ""))
    doc = memshelf.doctor(shelf_path=str(root))
    assert any(f["code"] == "stale-index" and f["path"] == "INDEX.md" and
               f["level"] == "warning" for f in doc["findings"]), doc["findings"]
    memshelf.rebuild(shelf_path=str(root))
    assert " [superseded by 2026-02-01-cache-v2]" in read(root, "INDEX.md")
    # the marker survives a rollup of the superseded episode, in the archive INDEX
    memshelf.rollup(shelf_path=str(root), slug="2026-01-31-r", episode_ids=["2026-01-05-cache-v1"],
                    digest=ROLLUP_DIGEST)
    assert "- 2026-01-05-cache-v1 — " in read(root, "archive/INDEX.md")
    assert "[superseded by 2026-02-01-cache-v2]" in read(root, "archive/INDEX.md")
    rec = memshelf.recall(shelf_path=str(root), episode_id="2026-01-05-cache-v1", log=False)
    assert rec["archived"] and rec["superseded_by"] == ["2026-02-01-cache-v2"]


def test_supersedes_unknown_id_is_a_doctor_warning(tmp_path):
    root = make_shelf(tmp_path)
    r = put(root, "2026-02-01-v2", supersedes=["2026-01-01-missing"])
    assert any("no episode 2026-01-01-missing" in w for w in r["warnings"])
    doc = memshelf.doctor(shelf_path=str(root))
    found = [f for f in doc["findings"] if f["code"] == "supersedes-unknown"]
    assert found and found[0]["path"] == "docs/topics/2026-02-01-v2.md"


def test_provenance_fields_round_trip(tmp_path):
    root = make_shelf(tmp_path)
    r = run_cli("shelve", "--shelf", root, "--slug", "2026-03-01-prov", "--kind", "topic",
                "--digest", "Dana chose provenance fields; open: audit.", "--section",
                "Decisions=- keep", "--agent", 'Claude "Code"  CLI', "--model",
                "claude-opus-4", "--json")
    assert r.code == 0, r
    text = read(root, "docs/topics/2026-03-01-prov.md")
    assert 'agent: "Claude \\"Code\\" CLI"\nmodel: "claude-opus-4"\n' in text
    fields, _ = memshelf.parse_frontmatter(text)
    assert fields["agent"] == 'Claude "Code" CLI' and fields["model"] == "claude-opus-4"
    assert text.index("\nagent:") < text.index("\nspan:")     # docs/format.md § Episodes order
    # over MCP the client's name fills agent; an explicit agent wins
    memshelf.call_tool("memshelf_shelve", {
        "shelf_path": str(root), "slug": "2026-03-02-mcp", "kind": "topic",
        "digest": "Priya chose the MCP path; open: docs.", "sections": {"Decisions": "- mcp"}},
        client_name="claude-ai")
    assert memshelf.parse_frontmatter(read(root, "docs/topics/2026-03-02-mcp.md"))[0]["agent"] \
        == "claude-ai"
    memshelf.call_tool("memshelf_shelve", {
        "shelf_path": str(root), "slug": "2026-03-03-own", "kind": "topic", "agent": "bot-7",
        "model": "m-1", "digest": "Omar chose own naming; open: none yet.",
        "sections": {"Decisions": "- own"}}, client_name="claude-ai")
    fields = memshelf.parse_frontmatter(read(root, "docs/topics/2026-03-03-own.md"))[0]
    assert fields["agent"] == "bot-7" and fields["model"] == "m-1"
    # a credential in a provenance field is masked before it is written
    token = "ghp_" + "Z9y8X7w6V5" * 4
    put(root, "2026-03-04-leak", agent=f"agent {token}")
    assert token not in read(root, "docs/topics/2026-03-04-leak.md")
    assert memshelf.doctor(shelf_path=str(root))["healthy"]
