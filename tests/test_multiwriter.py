"""Many writers at once: processes sharing one clone through the shelf lock, and two or three
clones shelving and pushing to one bare remote at the same moment (the shelf lock; docs/verbs.md §
sync, push and publish). Nothing may be lost; derived files must equal a fresh render."""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import run_cli, shelve_args, snapshot, git

import memshelf

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")]


def spawn(*args):
    return subprocess.Popen([sys.executable, "-m", "memshelf", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs, timeout=120):
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append((p.returncode, stdout, stderr))
    return out


def episodes_in_head(root):
    names = git(root, "ls-tree", "-r", "--name-only", "HEAD", "--", "docs").split()
    return sorted(n.rsplit("/", 1)[-1][:-3] for n in names if n.endswith(".md"))


def assert_shelf_is_whole(root, expected):
    """Every expected episode committed; derived files equal a fresh render; doctor clean."""
    assert set(expected) <= set(episodes_in_head(root))
    assert git(root, "status", "--porcelain", "--untracked-files=no") == ""
    assert memshelf.rebuild(shelf_path=str(root), check=True)["ok"]
    ledger = (root / "ledger.tsv").read_text(encoding="utf-8")
    assert all(f"\t{slug}\t" in ledger for slug in expected)
    report = memshelf.doctor(shelf_path=str(root))
    bad = [f for f in report["findings"] if f["level"] in ("error", "warning")]
    assert bad == [], bad


def test_processes_writing_one_clone_share_the_lock(tmp_path, shelf):
    slugs = [f"2026-07-{d:02d}-writer-{d}" for d in range(1, 7)]
    procs = [spawn(*shelve_args(shelf, slug=s, kind=("topic", "session", "research")[i % 3]))
             for i, s in enumerate(slugs)]
    # readers never take the lock and never see a torn file while the writers run
    reads = 0
    while any(p.poll() is None for p in procs):
        memshelf.index(shelf_path=str(shelf))
        reads += 1
    results = finish(procs)
    assert [code for code, _, _ in results] == [0] * len(slugs), results
    assert reads > 0
    subjects = git(shelf, "log", "--format=%s").splitlines()
    assert sorted(s for s in subjects if s.startswith("shelve: ")) == \
        sorted(f"shelve: {s}" for s in slugs)
    assert_shelf_is_whole(shelf, slugs)


def test_a_second_writer_waits_for_the_lock_then_fails_busy(tmp_path, shelf):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, memshelf\n"
         "with memshelf._ShelfLock(sys.argv[1]):\n    print('held', flush=True)\n"
         "    time.sleep(30)\n", str(shelf)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(shelf)
        r = run_cli(*shelve_args(shelf, extra=["--json"]), env={"MEMSHELF_LOCK_TIMEOUT": "1"})
        assert r.code == 1 and r.json()["error"]["code"] == "shelf-busy", r
        assert snapshot(shelf) == before
    finally:
        holder.kill()
        holder.wait()
    # the operating system released the lock with the process
    r = run_cli(*shelve_args(shelf), env={"MEMSHELF_LOCK_TIMEOUT": "5"})
    assert r.code == 0, r


def make_remote(tmp_path, clones):
    bare = tmp_path / "remote.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    git(bare, "symbolic-ref", "HEAD", "refs/heads/main")
    first = tmp_path / "c0"
    memshelf.init(shelf_path=str(first), storage="git-remote", remote=str(bare))
    res = memshelf.shelve(shelf_path=str(first), slug="2026-07-01-seed", kind="topic",
                          digest="Priya seeded the shared shelf; nothing was decided yet.",
                          sections={"Decisions": "- Seed."}, push=True)
    assert res["sync"]["pushed"], res
    roots = [first]
    for i in range(1, clones):
        root = tmp_path / f"c{i}"
        subprocess.run(["git", "clone", "-q", str(bare), str(root)], check=True)
        assert memshelf.sync_verb(shelf_path=str(root))["status"] == "ok"
        roots.append(root)
    return bare, roots


def test_two_clones_shelving_at_once_and_pushing(tmp_path):
    bare, (a, b) = make_remote(tmp_path, 2)
    slugs = []
    for rnd in range(2):
        pair = [f"2026-07-{10 + rnd:02d}-from-{n}" for n in ("a", "b")]
        slugs += pair
        procs = [spawn(*shelve_args(root, slug=slug, extra=["--push", "--json"]))
                 for root, slug in zip((a, b), pair)]
        for code, out, err in finish(procs):
            assert code == 0, (out, err)
            sync = json.loads(out)["sync"]
            assert sync["pushed"] and sync["push_retries"] <= 1, sync
    for root in (a, b):
        assert memshelf.sync_verb(shelf_path=str(root))["status"] == "ok"
        assert_shelf_is_whole(root, slugs + ["2026-07-01-seed"])
    assert git(a, "rev-parse", "HEAD") == git(b, "rev-parse", "HEAD") == \
        git(bare, "rev-parse", "main")


def test_three_clones_converge_with_the_catch_up_hint(tmp_path):
    bare, roots = make_remote(tmp_path, 3)
    slugs = [f"2026-07-20-from-{i}" for i in range(3)]
    procs = [spawn(*shelve_args(root, slug=slug, extra=["--push", "--json"]))
             for root, slug in zip(roots, slugs)]
    for root, (code, out, err) in zip(roots, finish(procs)):
        res = json.loads(out)
        assert res["committed"], (out, err)
        if res["status"] == "incomplete":
            # rejected twice: the commit stayed local; the hint is the whole catch-up
            assert code == 1 and res["sync"]["push_retries"] == 1
            p = subprocess.run(["sh", "-c", res["sync"]["hint"]], capture_output=True,
                               text=True)
            assert p.returncode == 0, p.stderr
        else:
            assert code == 0 and res["sync"]["pushed"], res
    for root in roots:
        assert memshelf.sync_verb(shelf_path=str(root))["status"] == "ok"
        assert_shelf_is_whole(root, slugs + ["2026-07-01-seed"])
    fresh = tmp_path / "fresh"
    subprocess.run(["git", "clone", "-q", str(bare), str(fresh)], check=True)
    assert_shelf_is_whole(fresh, slugs + ["2026-07-01-seed"])
