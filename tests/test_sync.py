"""git-remote shelves: the sync preflight, push with one retry, publish, await-render, the sync
verb, merges that resolve themselves, resolve, and doctor's judgement of the renderer
(docs/verbs.md § sync, push and publish, § resolve; docs/doctor.md § Judging the
renderer). Real bare remotes, real clones."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import run_cli, shelve_args, snapshot, git

import memshelf

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(ROOT, "adapters", "shelf-repo")
SYNC_KEYS = {"performed", "skipped_reason", "remote", "branch", "commits_pulled",
             "push_requested", "pushed", "push_retries", "final_sha", "hint",
             "publish_requested", "published_branch", "compare_url", "render_awaited",
             "render_pulled", "render_waited_s", "render_note", "error", "summary"}


# --- helpers -------------------------------------------------------------------------------

def bare_remote(tmp_path, name="remote.git"):
    bare = tmp_path / name
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    git(bare, "symbolic-ref", "HEAD", "refs/heads/main")
    return bare


def first_shelf(tmp_path, bare, derived="auto", name="a"):
    """`init --storage git-remote`, one episode pushed: the remote has main."""
    root = tmp_path / name
    memshelf.init(shelf_path=str(root), storage="git-remote", remote=str(bare), derived=derived)
    if derived == "bot":
        install_renderer_workflow(root)
    res = put(root, "2026-07-01-first", push=True)
    assert res["sync"]["pushed"], res
    return root


def install_renderer_workflow(root):
    dest = os.path.join(root, ".github", "workflows")
    os.makedirs(dest, exist_ok=True)
    for name in ("shelf-derived.yml", "shelf-pr-guard.yml"):
        shutil.copy(os.path.join(TEMPLATES, "workflows", name), dest)
    git(root, "add", ".github")
    git(root, "commit", "-q", "-m", "ci: renderer workflow")


def clone(bare, path):
    """A second machine: git clone, then `memshelf sync` installs the drivers and hooks."""
    subprocess.run(["git", "clone", "-q", str(bare), str(path)], check=True)
    assert memshelf.sync_verb(shelf_path=str(path))["status"] == "ok"
    return path


DIGEST = ("Dana chose JWT middleware over sessions; rejected per-route decorators. "
          "Open: key rotation.")


def put(root, slug, **kw):
    """An in-process shelve for set-up steps; the CLI path has tests of its own."""
    kw.setdefault("sections", {"Decisions": "- JWT verified once per request in middleware."})
    return memshelf.shelve(shelf_path=str(root), slug=slug, kind="topic", digest=DIGEST, **kw)


def recall(root, section=None):
    memshelf.recall(shelf_path=str(root), episode_id="2026-07-01-first", section=section)


def shelve(root, slug, *extra, code=0):
    r = run_cli(*shelve_args(root, slug=slug, extra=["--json", *extra]))
    assert r.code == code, r
    return r.json()


def head(root, ref="HEAD"):
    return git(root, "rev-parse", ref).strip()


def rebuild_check(root):
    return memshelf.rebuild(shelf_path=str(root), check=True)["ok"]


def doctor(root, hours=None):
    return memshelf.doctor(shelf_path=str(root), derived_stale_after_hours=hours)


def codes(report, level=None):
    return sorted(f["code"] for f in report["findings"] if level in (None, f["level"]))


# --- preflight, push, the sync report ------------------------------------------------------

@pytest.mark.slow
def test_first_push_creates_the_branch_and_reports(tmp_path):
    bare = bare_remote(tmp_path)
    a = tmp_path / "a"
    r = run_cli("init", "--shelf", a, "--storage", "git-remote", "--remote", bare)
    assert r.code == 0, r
    # init pushes its commit (issue 18): the remote has main at once
    assert "pushed" in r.out and head(bare, "main") == head(a)
    res = shelve(a, "2026-07-01-first", "--push")
    assert res["sync"]["pushed"] and head(bare, "main") == head(a)
    assert git(a, "rev-parse", "--abbrev-ref", "@{u}").strip() == "origin/main"
    res = shelve(a, "2026-07-02-second", "--push")
    sync = res["sync"]
    assert set(sync) == SYNC_KEYS
    assert (sync["performed"], sync["pushed"], sync["push_retries"]) == (True, True, 0)
    assert (sync["remote"], sync["branch"]) == ("origin", "main")
    assert sync["summary"] == "sync: pulled 0, pushed"
    assert sync["final_sha"] == head(a) == head(bare, "main")
    # without --push: committed locally, the catch-up command as the hint
    res = shelve(a, "2026-07-03-third")
    assert res["status"] == "ok" and res["sync"]["pushed"] is False
    assert res["sync"]["hint"] == (f"git -C {a} pull --rebase origin main && "
                                   f"git -C {a} push origin main")
    assert head(bare, "main") != head(a)


@pytest.mark.slow
def test_preflight_fast_forwards_before_writing(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    b = clone(bare, tmp_path / "b")
    put(b, "2026-07-02-from-b", push=True)
    res = shelve(a, "2026-07-03-from-a")
    assert res["sync"]["commits_pulled"] == 1
    assert res["sync"]["summary"] == "sync: pulled 1"
    assert (a / "docs" / "topics" / "2026-07-02-from-b.md").exists()
    index = (a / "INDEX.md").read_text(encoding="utf-8")
    assert "2026-07-02-from-b" in index and "2026-07-03-from-a" in index
    assert rebuild_check(a)
    assert git(a, "log", "--format=%s", "-2").split("\n")[:2] == \
        ["shelve: 2026-07-03-from-a", "shelve: 2026-07-02-from-b"]


@pytest.mark.slow
def test_preflight_refuses_a_dirty_tree_before_writing(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    # derived files and the recall log never count as dirty
    with open(a / "INDEX.md", "a", encoding="utf-8") as f:
        f.write("\n")
    recall(a)
    put(a, "2026-07-02-ok")
    with open(a / "POLICY.md", "a", encoding="utf-8") as f:
        f.write("\nA local edit.\n")
    before = snapshot(a)
    log = git(a, "log", "--format=%H")
    r = run_cli(*shelve_args(a, slug="2026-07-03-refused"))
    assert r.code == 1 and "tracked files are modified: POLICY.md" in r.err, r
    assert snapshot(a) == before and git(a, "log", "--format=%H") == log
    # --no-sync skips the preflight, and the commit still leaves POLICY.md out
    res = shelve(a, "2026-07-03-refused", "--no-sync")
    assert res["sync"] is None
    assert "POLICY.md" not in git(a, "show", "--name-only", "--format=", "HEAD")
    assert git(a, "status", "--porcelain", "--", "POLICY.md").startswith(" M")


@pytest.mark.slow
def test_preflight_refuses_a_diverged_clone(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    b = clone(bare, tmp_path / "b")
    put(a, "2026-07-02-local-only", sync=False)
    put(b, "2026-07-02-on-remote", push=True)
    before = snapshot(a)
    r = run_cli(*shelve_args(a, slug="2026-07-03-refused", extra=["--json"]))
    assert r.code == 1
    err = r.json()["error"]
    assert err["code"] == "sync-diverged"
    assert f"git -C {a} pull --rebase origin main" in err["fix"]
    assert snapshot(a) == before


@pytest.mark.slow
def test_offline_only_warns(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    git(a, "remote", "set-url", "origin", str(tmp_path / "unreachable.git"))
    res = shelve(a, "2026-07-02-offline")
    assert res["status"] == "ok" and res["committed"]
    assert res["sync"]["performed"] is False
    assert res["sync"]["skipped_reason"].startswith("fetch failed: ")
    assert res["sync"]["summary"].startswith("sync: skipped — fetch failed")
    # a push that cannot reach the remote: the commit stays, status incomplete, exit 1
    r = run_cli(*shelve_args(a, slug="2026-07-03-unpushed", extra=["--json", "--push"]))
    assert r.code == 1, r
    res = r.json()
    assert res["status"] == "incomplete" and res["committed"]
    assert res["sync"]["error"] and not res["sync"]["pushed"]
    assert res["sync"]["hint"].endswith("push origin main")
    assert git(a, "log", "-1", "--format=%s").strip() == "shelve: 2026-07-03-unpushed"


@pytest.mark.slow
def test_push_rejected_rebases_once_and_regenerates(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    b = clone(bare, tmp_path / "b")
    recall(b)       # a pending recall row
    put(a, "2026-07-02-from-a", push=True)
    # b has not fetched: its push is rejected, rebased onto a's commit and retried once
    res = shelve(b, "2026-07-03-from-b", "--push", "--no-sync")
    sync = res["sync"]
    assert (res["status"], sync["pushed"], sync["push_retries"]) == ("ok", True, 1)
    assert sync["summary"] == "sync: pulled 1, push retries 1, pushed"
    assert sync["commits_pulled"] == 1 and sync["error"] is None
    assert res["commit"] == head(b) == head(bare, "main") == sync["final_sha"]
    assert git(b, "log", "--format=%s", "-3").split("\n")[:3] == \
        ["shelve: 2026-07-03-from-b", "shelve: 2026-07-02-from-a", "shelve: 2026-07-01-first"]
    assert rebuild_check(b)
    assert git(b, "status", "--porcelain", "--untracked-files=no") == ""
    assert "2026-07-01-first" in (b / "recall-log.tsv").read_text(encoding="utf-8")
    assert codes(doctor(b), "error") == [] and codes(doctor(b), "warning") == []
    subprocess.run(["git", "-C", str(a), "pull", "-q", "--ff-only"], check=True)
    assert rebuild_check(a)


@pytest.mark.slow
def test_a_refused_push_is_incomplete_with_the_catch_up_hint(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    hook = bare / "hooks" / "pre-receive"
    hook.write_text("#!/bin/sh\necho 'protected branch: open a pull request' >&2\nexit 1\n")
    hook.chmod(0o755)
    r = run_cli(*shelve_args(a, slug="2026-07-02-refused", extra=["--json", "--push"]))
    assert r.code == 1, r
    res = r.json()
    assert res["status"] == "incomplete" and res["committed"]
    assert "protected branch" in res["sync"]["error"]
    assert res["sync"]["summary"] == "sync: pulled 0, not pushed"
    assert res["sync"]["hint"] == res["hint"]
    assert head(a) == res["commit"] != head(bare, "main")
    r = run_cli(*shelve_args(a, slug="2026-07-03-also", extra=["--push"]))
    assert r.code == 1 and "hint: git -C" in r.out, r


@pytest.mark.slow
def test_bot_mode_commits_episodes_only(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare, derived="bot")
    derived = {n: (a / n).read_bytes() for n in ("INDEX.md", "ledger.tsv")}
    res = shelve(a, "2026-07-02-bot", "--push")
    assert res["derived"] == {"mode": "bot", "written": []}
    assert git(a, "show", "--name-only", "--format=", "HEAD").split() == \
        ["docs/topics/2026-07-02-bot.md"]
    assert {n: (a / n).read_bytes() for n in derived} == derived


# --- publish ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_publish_pushes_a_new_branch_without_switching(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare, derived="bot")
    main_before = head(bare, "main")
    res = shelve(a, "2026-07-02-pr", "--publish")
    sync = res["sync"]
    assert sync["publish_requested"] and sync["published_branch"] == "shelve/2026-07-02-pr"
    assert sync["summary"] == "sync: pulled 0, published shelve/2026-07-02-pr"
    assert sync["final_sha"] == head(a) == head(bare, "shelve/2026-07-02-pr")
    assert sync["compare_url"] is None                    # a local path has no web page
    assert head(bare, "main") == main_before
    assert git(a, "symbolic-ref", "--short", "HEAD").strip() == "main"
    assert not any("derived files" in w for w in res["warnings"])
    # a second writer publishes the same id: the name is taken, so the short sha qualifies it
    b = clone(bare, tmp_path / "b")
    res = shelve(b, "2026-07-02-pr", "--publish", "--notes", "written by b")
    assert res["sync"]["published_branch"] == f"shelve/2026-07-02-pr-{head(b)[:7]}"
    assert head(bare, "shelve/2026-07-02-pr") == head(a)
    # an amend on top of a published branch simply moves it forward
    res = shelve(a, "2026-07-02-pr", "--publish", "--amend", "--notes", "v2")
    assert res["sync"]["published_branch"] == "shelve/2026-07-02-pr"
    assert head(bare, "shelve/2026-07-02-pr") == head(a)
    r = run_cli(*shelve_args(a, slug="2026-07-03-x", extra=["--publish", "--push"]))
    assert r.code == 2


@pytest.mark.slow
def test_publish_on_an_auto_shelf_warns(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    res = shelve(a, "2026-07-02-pr", "--publish")
    assert res["sync"]["published_branch"] == "shelve/2026-07-02-pr"
    assert any("derived files" in w for w in res["warnings"])


def test_compare_urls():
    url = memshelf._compare_url
    assert url("git@github.com:acme/shelf.git", "main", "shelve/x") == \
        "https://github.com/acme/shelf/compare/main...shelve/x?expand=1"
    assert url("https://tok@github.com/acme/shelf.git", "main", "shelve/x") == \
        "https://github.com/acme/shelf/compare/main...shelve/x?expand=1"
    assert url("https://gitlab.com/acme/shelf.git", "main", "shelve/x") == \
        "https://gitlab.com/acme/shelf/-/merge_requests/new?merge_request%5Bsource_branch%5D=" \
        "shelve/x&merge_request%5Btarget_branch%5D=main"
    assert url("/srv/git/shelf.git", "main", "shelve/x") is None
    assert url("git@alias:acme/shelf.git", "main", "shelve/x") is None


# --- await-render ----------------------------------------------------------------------------

@pytest.mark.slow
def test_await_render_pulls_the_renderers_commit(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare, derived="bot")
    bot = tmp_path / "bot"
    subprocess.run(["git", "clone", "-q", str(bare), str(bot)], check=True)
    proc = subprocess.Popen([sys.executable, "-m", "memshelf",
                             *shelve_args(a, slug="2026-07-02-awaited"),
                             "--push", "--await-render", "40", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            subprocess.run(["git", "-C", str(bot), "pull", "-q", "--ff-only"],
                           capture_output=True)
            if (bot / "docs" / "topics" / "2026-07-02-awaited.md").exists():
                break
            time.sleep(0.3)
        # the renderer: what shelf-derived.yml runs
        assert memshelf.rebuild(shelf_path=str(bot), commit=True)["committed"]
        git(bot, "push", "-q", "origin", "main")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    sync = json.loads(out)["sync"]
    assert sync["render_awaited"] and sync["render_pulled"], sync
    assert sync["render_note"] is None
    assert head(a) == head(bare, "main")
    assert "2026-07-02-awaited" in (a / "INDEX.md").read_text(encoding="utf-8")
    assert "no-ledger-row" not in codes(doctor(a))


@pytest.mark.slow
def test_await_render_notes_instead_of_failing(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare, derived="bot")
    res = shelve(a, "2026-07-02-unpushed", "--await-render", "5")
    assert res["status"] == "ok"
    assert res["sync"]["render_awaited"] and res["sync"]["render_note"] == "nothing was pushed"
    res = shelve(a, "2026-07-03-pushed", "--push", "--await-render", "1")
    assert res["status"] == "ok" and res["sync"]["pushed"]
    assert res["sync"]["render_pulled"] is False
    assert res["sync"]["render_note"].startswith("no render on origin/main within 1 s")


# --- the sync verb ---------------------------------------------------------------------------

@pytest.mark.slow
def test_sync_verb_pulls_reports_and_installs(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    subprocess.run(["git", "clone", "-q", str(bare), str(tmp_path / "b")], check=True)
    b = tmp_path / "b"
    assert "merge-driver-missing" in codes(doctor(b), "info")
    r = run_cli("sync", "--shelf", b, "--json")
    assert r.code == 0, r
    first = r.json()
    assert "merge-driver-missing" not in codes(doctor(b))
    assert "merge.memshelf-recall-log.driver" in first["installed"]
    assert "post-merge hook" in first["installed"]
    assert git(b, "config", "merge.memshelf-derived.driver").strip() == "true"
    assert os.access(b / ".git" / "hooks" / "post-merge", os.X_OK)
    put(a, "2026-07-02-new", push=True)
    put(a, "2026-07-01-first", amend=True, push=True, notes="changed")
    r = run_cli("sync", "--shelf", b, "--json")
    res = r.json()
    assert set(SYNC_KEYS) <= set(res)
    assert (res["status"], res["commits_pulled"]) == ("ok", 2)
    assert res["episodes_added"] == ["2026-07-02-new"]
    assert res["episodes_changed"] == ["2026-07-01-first"]
    assert res["derived_lag"] is False and res["installed"] == []
    r = run_cli("sync", "--shelf", b)
    assert r.code == 0 and r.out.startswith("sync: pulled 0"), r
    # --push sends local commits; a refused push is exit 1
    put(b, "2026-07-03-from-b", sync=False)
    r = run_cli("sync", "--shelf", b, "--push", "--json")
    assert r.code == 0 and r.json()["pushed"], r
    assert head(bare, "main") == head(b)
    with open(b / "shelf.yml", "a", encoding="utf-8") as f:
        f.write("# local edit\n")
    r = run_cli("sync", "--shelf", b)
    assert r.code == 1 and "shelf.yml" in r.err


@pytest.mark.slow
def test_sync_without_a_remote(tmp_path, shelf):
    r = run_cli("sync", "--shelf", shelf, "--json")
    assert r.code == 0
    assert r.json()["summary"] == "sync: skipped — no remote configured"


# --- merges resolve themselves -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("rebase", [False, True], ids=["merge", "rebase"])
def test_pulling_two_clones_leaves_a_correct_shelf(tmp_path, rebase):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    b = clone(bare, tmp_path / "b")
    recall(a, "Decisions")
    recall(b)
    put(a, "2026-07-02-from-a")
    put(b, "2026-07-02-from-b")
    git(a, "push", "-q", "origin", "main")
    mode = "--rebase" if rebase else "--no-rebase"
    p = subprocess.run(["git", "-C", str(b), "pull", "-q", mode, "--no-edit", "origin", "main"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert git(b, "status", "--porcelain", "--untracked-files=no") == ""
    assert rebuild_check(b)
    index = (b / "INDEX.md").read_text(encoding="utf-8")
    assert "2026-07-02-from-a" in index and "2026-07-02-from-b" in index
    assert "<<<<<<<" not in index
    assert git(b, "log", "-1", "--format=%s").strip() == \
        "rebuild: regenerate derived files after merge"
    rows = (b / "recall-log.tsv").read_text(encoding="utf-8").splitlines()[1:]
    assert sorted(r.split("\t")[1] for r in rows) == ["", "Decisions"]     # the union
    assert codes(doctor(b), "error") == [] and codes(doctor(b), "warning") == []


@pytest.mark.slow
def test_resolve_finishes_a_merge_without_drivers(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    b = tmp_path / "b"
    subprocess.run(["git", "clone", "-q", str(bare), str(b)], check=True)  # no drivers, no hooks
    recall(a, "Decisions")
    recall(b)
    put(a, "2026-07-02-from-a", push=True)
    put(b, "2026-07-02-from-b", sync=False)
    p = subprocess.run(["git", "-C", str(b), "pull", "-q", "--no-rebase", "--no-edit", "origin",
                        "main"], capture_output=True, text=True)
    assert p.returncode != 0                     # text merge of derived files: conflicts
    assert "<<<<<<<" in (b / "ledger.tsv").read_text(encoding="utf-8")
    r = run_cli("resolve", "--shelf", b, "--commit", "--json")
    assert r.code == 0, r
    res = r.json()
    assert res["status"] == "ok" and res["unresolved"] == []
    assert "recall-log.tsv" in res["resolved"] and "ledger.tsv" in res["resolved"]
    assert "INDEX.md" in res["regenerated"]
    assert res["committed"] and res["doctor"]["healthy"]
    assert len(git(b, "log", "-1", "--format=%P").split()) == 2      # the merge commit
    assert rebuild_check(b)
    rows = (b / "recall-log.tsv").read_text(encoding="utf-8").splitlines()[1:]
    assert len(rows) == 2
    assert git(b, "status", "--porcelain", "--untracked-files=no") == ""


@pytest.mark.slow
def test_resolve_reports_an_episode_conflict_without_touching_it(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare)
    b = clone(bare, tmp_path / "b")
    put(a, "2026-07-01-first", amend=True, notes="from a", push=True)
    put(b, "2026-07-01-first", amend=True, notes="from b", sync=False)
    p = subprocess.run(["git", "-C", str(b), "pull", "-q", "--no-rebase", "--no-edit", "origin",
                        "main"], capture_output=True, text=True)
    assert p.returncode != 0
    episode = b / "docs" / "topics" / "2026-07-01-first.md"
    before = episode.read_bytes()
    r = run_cli("resolve", "--shelf", b, "--commit", "--json")
    assert r.code == 1, r
    res = r.json()
    assert res["status"] == "attention" and res["in_merge"]
    assert res["unresolved"] == ["docs/topics/2026-07-01-first.md"]
    assert not res["committed"]
    assert any("git show :2:./docs/topics/2026-07-01-first.md" in n for n in res["notes"])
    assert episode.read_bytes() == before
    # a person picks a side; resolve finishes the job
    git(b, "checkout", "--theirs", "--", "docs/topics/2026-07-01-first.md")
    git(b, "add", "docs/topics/2026-07-01-first.md")
    r = run_cli("resolve", "--shelf", b, "--commit", "--json")
    assert r.code == 0, r
    assert r.json()["committed"] and rebuild_check(b)


@pytest.mark.slow
def test_resolve_outside_a_merge_is_rebuild_and_doctor(tmp_path, shelf):
    put(shelf, "2026-07-01-first")
    (shelf / "INDEX.md").write_text("stale\n", encoding="utf-8")
    git(shelf, "commit", "-q", "-m", "a hand edit", "--", "INDEX.md")
    r = run_cli("resolve", "--shelf", shelf, "--commit", "--json")
    assert r.code == 0, r
    res = r.json()
    assert res["in_merge"] is False and res["regenerated"] == ["INDEX.md"]
    assert res["committed"]
    assert git(shelf, "log", "-1", "--format=%s").strip() == \
        "resolve: regenerate derived files + union the recall log"


def test_shelve_commits_recall_rows_that_head_lacks_and_only_those(tmp_path):
    # shelve tells pending recall rows by the file's bytes against HEAD's blob; where HEAD has
    # no such file, git status tells (untracked: committed; ignored: left alone)
    root = tmp_path / "s"
    memshelf.init(shelf_path=str(root), storage="git-local")
    put(root, "2026-07-01-first")

    def committed(slug):
        put(root, slug)
        return git(root, "show", "--name-only", "--format=", "HEAD").split()

    assert "recall-log.tsv" not in committed("2026-07-02-no-recall")   # none pending
    recall(root)
    assert "recall-log.tsv" in committed("2026-07-03-after-recall")
    assert "recall-log.tsv" not in committed("2026-07-04-again")   # committed already
    assert git(root, "status", "--porcelain", "--", "recall-log.tsv") == ""
    git(root, "rm", "-q", "--cached", "recall-log.tsv")
    git(root, "commit", "-q", "-m", "untrack the log")
    assert "recall-log.tsv" in committed("2026-07-05-untracked")   # HEAD lacks it: status
    git(root, "rm", "-q", "--cached", "recall-log.tsv")
    with open(root / ".gitignore", "a", encoding="utf-8") as f:
        f.write("recall-log.tsv\n")
    git(root, "commit", "-q", "-am", "ignore the log")
    recall(root)
    assert "recall-log.tsv" not in committed("2026-07-06-ignored")
    assert memshelf.rebuild(shelf_path=str(root), check=True)["ok"]


def test_recall_rows_of_a_shelf_inside_a_larger_repository_ride_once(tmp_path):
    # HEAD's blob is looked up from the shelf's folder, not from the repository's top
    outer = tmp_path / "outer"
    outer.mkdir()
    git(outer, "init", "-q")
    git(outer, "commit", "-q", "--allow-empty", "-m", "root")
    root = outer / "shelf"
    memshelf.init(shelf_path=str(root), storage="git-local")
    put(root, "2026-07-01-first")
    recall(root)
    # the outer project's own file of that name holds the very rows the shelf has pending
    (outer / "recall-log.tsv").write_bytes((root / "recall-log.tsv").read_bytes())
    git(outer, "add", "recall-log.tsv")
    git(outer, "commit", "-q", "-m", "a file of the outer project", "--", "recall-log.tsv")
    for slug, rides in (("2026-07-02-after-recall", True), ("2026-07-03-again", False)):
        put(root, slug)
        changed = git(root, "show", "--name-only", "--format=", "HEAD").split()
        assert ("shelf/recall-log.tsv" in changed) is rides, (slug, changed)
    assert git(outer, "status", "--porcelain") == ""


# --- the recall-log union --------------------------------------------------------------------

H = "episode_id\tsection\tfetched_tokens\tdate\n"


def test_union_recall_logs():
    union = memshelf._union_recall_logs
    x, y, z = "a\t\t10\t2026-07-01", "b\tDecisions\t5\t2026-07-02", "c\t\t7\t2026-07-03"
    base = H + x + "\n"
    ours = H + x + "\n" + y + "\n" + y + "\n"
    theirs = H + x + "\n" + z + "\n" + x + "\n"
    assert union(ours, theirs, base) == H + "\n".join([x, y, y, z, x]) + "\n"
    # without a base: max(ours, theirs) of each row
    assert union(ours, theirs) == H + "\n".join([x, y, y, z, x]) + "\n"
    assert union(H + x + "\n", H + x + "\n") == H + x + "\n"
    # identical rows are separate events and never collapse below either side's count
    assert union(H + (x + "\n") * 3, H + (x + "\n") * 2, H + x + "\n") == H + (x + "\n") * 4
    # trailing empty cells do not make a different row; the longer spelling is kept
    assert union(H + "a\t\t10\n", H + "a\t\t10\t\n") == H + "a\t\t10\t\n"
    # conflict markers (with a diff3 base block) are split into their sides
    marked = (H + x + "\n<<<<<<< ours\n" + y + "\n||||||| base\n" + z + "\n=======\n" + z +
              "\n>>>>>>> theirs\n")
    assert union(marked, "") == H + "\n".join([x, y, z]) + "\n"


def test_merge_driver_verb(tmp_path):
    base, ours, theirs = (tmp_path / n for n in ("O", "A", "B"))
    base.write_text(H + "a\t\t1\n")
    ours.write_text(H + "a\t\t1\nb\t\t2\n")
    theirs.write_text(H + "a\t\t1\nc\t\t3\n")
    r = run_cli("merge-driver", "recall-log", base, ours, theirs)
    assert r.code == 0, r
    assert ours.read_text() == H + "a\t\t1\nb\t\t2\nc\t\t3\n"
    assert run_cli("merge-driver", "ledger", base, ours, theirs).code == 2


# --- doctor: judging the renderer ------------------------------------------------------------

@pytest.mark.slow
def test_doctor_judges_the_renderer_from_the_clones_own_evidence(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare, derived="bot")
    git(a, "push", "-q", "origin", "main")
    git(a, "branch", "-q", "--set-upstream-to", "origin/main")
    # rendered by hand once, so the pushed episode is counted
    memshelf.rebuild(shelf_path=str(a), commit=True)
    git(a, "push", "-q", "origin", "main")
    assert codes(doctor(a), "warning") == []
    # local only: episode-unpushed
    put(a, "2026-07-02-local", sync=False)
    report = doctor(a)
    assert "episode-unpushed" in codes(report, "warning")
    assert "derived-stale" not in codes(report)
    # pushed by this clone: the push dates its arrival exactly, so a short wait is silent ...
    git(a, "push", "-q", "origin", "main")
    report = doctor(a)
    assert not {"episode-unpushed", "derived-stale", "renderer-wait-unknown"} & \
        set(codes(report))
    # ... and a wait past the threshold is proven
    time.sleep(1.2)
    report = doctor(a, 0.0002)
    assert "derived-stale" in codes(report, "error")
    stale = [f for f in report["findings"] if f["code"] == "derived-stale"][0]
    assert "2026-07-02-local" in stale["detail"] and "renderer" in stale["fix"]
    # a fresh clone holds no record of the arrival: unknown, not stale, however old the commit
    c = tmp_path / "c"
    subprocess.run(["git", "clone", "-q", str(bare), str(c)], check=True)
    report = doctor(c, 0.0002)
    assert "renderer-wait-unknown" in codes(report, "unknown")
    assert "derived-stale" not in codes(report)
    assert report["healthy"]


@pytest.mark.slow
def test_doctor_upstream_not_rendered_and_upstream_unknown(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare, derived="bot")
    memshelf.rebuild(shelf_path=str(a), commit=True)
    git(a, "push", "-q", "origin", "main")
    git(a, "checkout", "-q", "-b", "topic")
    put(a, "2026-07-02-on-branch", sync=False)
    git(a, "push", "-q", "-u", "origin", "topic")
    report = doctor(a)
    assert "upstream-not-rendered" in codes(report, "warning")
    finding = [f for f in report["findings"] if f["code"] == "upstream-not-rendered"][0]
    assert finding["path"] == "docs/topics/2026-07-02-on-branch.md"
    git(a, "checkout", "-q", "--detach")
    assert "upstream-unknown" in codes(doctor(a), "warning")


@pytest.mark.slow
def test_doctor_derived_age_unknown_in_a_shallow_clone(tmp_path):
    bare = bare_remote(tmp_path)
    a = first_shelf(tmp_path, bare, derived="bot")
    memshelf.rebuild(shelf_path=str(a), commit=True)
    put(a, "2026-07-02-second", push=True)
    c = tmp_path / "c"
    subprocess.run(["git", "clone", "-q", "--depth", "1", "file://" + str(bare), str(c)],
                   check=True)
    git(c, "checkout", "-q", "--detach")
    report = doctor(c)
    assert "upstream-unknown" in codes(report, "warning")
    assert "derived-age-unknown" in codes(report, "unknown")
    # a full clone with the same history has a real ledger age: silent at 24 h
    d = tmp_path / "d"
    subprocess.run(["git", "clone", "-q", str(bare), str(d)], check=True)
    git(d, "checkout", "-q", "--detach")
    assert "derived-age-unknown" not in codes(doctor(d))


@pytest.mark.slow
def test_a_remote_on_an_unreachable_public_host_is_never_called_private(tmp_path, shelf):
    git(shelf, "remote", "add", "origin", "https://shelf-host.invalid/acme/shelf.git")
    report = memshelf.doctor(shelf_path=str(shelf), check_remote=True)
    assert "remote-unverified" in codes(report, "warning")
    assert "remote-private" not in codes(report)


def test_templates_name_the_renderer(tmp_path):
    """The renderer template is what flips the default derived mode to bot."""
    root = tmp_path / "s"
    os.makedirs(root / ".github" / "workflows")
    shutil.copy(os.path.join(TEMPLATES, "workflows", "shelf-derived.yml"),
                root / ".github" / "workflows")
    r = run_cli("init", "--shelf", root, "--json")
    assert r.code == 0 and r.json()["derived"] == "bot", r
    text = open(os.path.join(TEMPLATES, "workflows", "shelf-derived.yml")).read()
    assert "sha256sum -c" in text and "PLACEHOLDER" in text
    assert "chore: regenerate derived files [skip ci]" in text
    guard = open(os.path.join(TEMPLATES, "workflows", "shelf-pr-guard.yml")).read()
    assert "rebuild --check" not in guard.replace("does not run `rebuild --check`", "")


# --- the git wrapper's commits and hooks -----------------------------------------------------

@pytest.mark.slow
def test_commits_hold_exactly_their_paths_and_record_moves(tmp_path, shelf):
    put(shelf, "2026-07-01-first")
    (shelf / "notes.txt").write_text("the user's own work\n")
    git(shelf, "add", "notes.txt")                       # staged by the user: stays out
    res = memshelf.shelve(shelf_path=str(shelf), slug="2026-07-01-first", kind="session",
                          digest=DIGEST, amend=True,
                          sections={"Timeline": "1. Met.", "Open threads": "- Keys."})
    assert res["moved_from"] == "docs/topics/2026-07-01-first.md"
    changed = git(shelf, "show", "--name-status", "--no-renames", "--format=",
                  "HEAD").split("\n")
    assert "D\tdocs/topics/2026-07-01-first.md" in changed
    assert "A\tdocs/sessions/2026-07-01-first.md" in changed
    assert "notes.txt" not in git(shelf, "show", "--name-only", "--format=", "HEAD")
    assert git(shelf, "status", "--porcelain") == "A  notes.txt\n"


@pytest.mark.slow
def test_the_guard_follows_a_moved_shelf(tmp_path, shelf):
    moved = tmp_path / "elsewhere" / "shelf"
    moved.parent.mkdir()
    shutil.move(str(shelf), str(moved))
    leak = moved / "docs" / "topics" / "2026-07-01-leak.md"
    leak.write_text("token ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8\n")
    git(moved, "add", str(leak))
    p = subprocess.run(["git", "-C", str(moved), "commit", "-q", "-m", "leak"],
                       capture_output=True, text=True)
    assert p.returncode == 1, p.stderr   # the guard scanned this index, not the old folder's
    assert "[github-token] docs/topics/2026-07-01-leak.md:1" in p.stderr
    # hooks that exist are left alone, memshelf's own included: they are the user's
    hooks = moved / ".git" / "hooks"
    (hooks / "post-merge").write_text("#!/bin/sh\necho mine\n")
    r = run_cli("init", "--shelf", moved, "--json")
    assert r.code == 0, r
    assert (hooks / "post-merge").read_text() == "#!/bin/sh\necho mine\n"
    assert r.json()["hooks"]["installed"] == [] and "post-merge" in r.json()["hooks"]["skipped"]


@pytest.mark.slow
def test_the_pre_commit_guard_blocks_a_secret(tmp_path, shelf):
    leak = shelf / "docs" / "topics" / "2026-07-01-leak.md"
    leak.write_text("token ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8\n")
    git(shelf, "add", str(leak))
    p = subprocess.run(["git", "-C", str(shelf), "commit", "-q", "-m", "leak"],
                       capture_output=True, text=True)
    assert p.returncode == 1
    assert "memshelf pre-commit: [github-token] docs/topics/2026-07-01-leak.md:1" in p.stderr
    p = subprocess.run(["git", "-C", str(shelf), "commit", "-q", "-m", "leak"],
                       capture_output=True, text=True, env=dict(os.environ,
                                                                 MEMSHELF_SKIP_GUARD="1"))
    assert p.returncode == 0 and "nothing was scanned" in p.stderr
