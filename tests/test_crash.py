"""kill -9 during shelve (docs/architecture.md § Interruptions): each file is old or new,
never torn; doctor reports only the documented crash findings; the documented repair makes
doctor clean; no committed episode is lost or changed. bench/reliability.py runs the same
trial at scale."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import run_cli, shelve_args, snapshot, git

import memshelf

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="waits for orphaned git children through /proc")]

TRIALS = 20
MAX_DELAY = 0.3
# what an interrupted shelve may leave behind: each is a finding doctor names with its repair
CRASH_FINDINGS = {"uncommitted-episode", "no-ledger-row", "stale-index", "leftover-temp-file",
                  "episode-untracked", "derived-uncommitted", "git-staged",
                  "git-temp-stale"}   # the killed writer's temporary index (issue 31)


def processes_touching(path):
    """Pids whose command line names `path` (the killed shelve's git children)."""
    needle = str(path).encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return [p for p in found if p != os.getpid()]


# Odd trials start the clock once memshelf is imported, so the kill lands in the shelve's own
# work (lock, write, render, commit) rather than in interpreter start-up.
_READY = ("import sys, memshelf; print('ready', flush=True); "
          "sys.argv[0] = 'memshelf'; sys.exit(memshelf.main())")


def kill_during_shelve(root, slug, delay, after_import=False):
    """Start a shelve, SIGKILL it after `delay` s; let the git children it orphaned end."""
    head = ["-c", _READY] if after_import else ["-m", "memshelf"]
    proc = subprocess.Popen([sys.executable, *head, *map(str, shelve_args(root, slug=slug))],
                            stdout=subprocess.PIPE if after_import else subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    if after_import:
        proc.stdout.readline()
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.stdout:
        proc.stdout.close()
    deadline = time.time() + 20
    while processes_touching(root) and time.time() < deadline:
        time.sleep(0.02)
    return proc.returncode


def committed_state(root):
    """HEAD and the blob of every committed episode."""
    head = git(root, "rev-parse", "HEAD").strip()
    blobs = {}
    for line in git(root, "ls-tree", "-r", "HEAD", "--", "docs", "archive").splitlines():
        meta, path = line.split("\t", 1)
        if path.endswith(".md"):
            blobs[path] = meta.split()[2]
    return head, blobs


def assert_every_file_parses(root):
    marker = memshelf._TEMP_MARK
    for rel, data in snapshot(root).items():
        if marker in rel:
            continue                                  # a documented leftover, never read
        text = data.decode("utf-8")
        rel = rel.replace(os.sep, "/")
        if rel.endswith(".json"):
            json.loads(text)
        elif rel.startswith(("docs/", "archive/docs/")) and rel.endswith(".md"):
            fields, _ = memshelf.parse_frontmatter(text)
            assert fields.get("id") == rel.rsplit("/", 1)[-1][:-3], rel
        elif rel.endswith(".tsv"):
            rows = text.splitlines()
            width = len(rows[0].split("\t"))
            assert all(len(r.split("\t")) == width for r in rows if r), rel


def findings(root):
    report = memshelf.doctor(shelf_path=str(root), no_cache=True)
    return {f["code"] for f in report["findings"] if f["level"] != "info"} | \
        {f["code"] for f in report["findings"] if f["code"] == "leftover-temp-file"}


def repair(root, slug, trial):
    """The documented repair: memshelf repair (from another directory on odd trials), which
    commits the episode the killed shelve wrote and the derived files."""
    path = root / "docs" / "topics" / f"{slug}.md"
    written = path.exists()
    r = run_cli("repair", "--shelf", root, cwd=root if trial % 2 else root.parent)
    assert r.code == 0, r
    assert git(root, "status", "--porcelain").strip() == "", trial
    if written:
        assert git(root, "ls-files", "--", str(path)).strip(), trial


def test_sigkill_during_shelve_never_loses_or_tears(tmp_path):
    root = tmp_path / "shelf"
    memshelf.init(shelf_path=str(root))
    for i in range(3):
        memshelf.shelve(shelf_path=str(root), slug=f"2026-06-0{i + 1}-before", kind="topic",
                        digest="Dana chose JWT middleware over sessions; rejected per-route "
                               "decorators.", sections={"Decisions": "- JWT."})
    baseline = findings(root)
    rng = random.Random(int(os.environ.get("MEMSHELF_CRASH_SEED", "7")))
    outcomes = {"killed": 0, "finished": 0, "repaired": 0}
    for trial in range(TRIALS):
        slug = f"2026-07-{trial + 1:02d}-crash-{trial}"
        head, blobs = committed_state(root)
        code = kill_during_shelve(root, slug, rng.uniform(0, MAX_DELAY), after_import=trial % 2)
        outcomes["killed" if code == -signal.SIGKILL else "finished"] += 1
        assert_every_file_parses(root)
        after_crash = findings(root) - baseline
        assert after_crash <= CRASH_FINDINGS, (trial, after_crash)
        # the next writer is never blocked: the lock died with the process
        if after_crash:
            outcomes["repaired"] += 1
        repair(root, slug, trial)
        assert findings(root) - baseline == set(), trial
        assert memshelf.rebuild(shelf_path=str(root), check=True)["ok"]
        new_head, new_blobs = committed_state(root)
        assert subprocess.run(["git", "-C", str(root), "merge-base", "--is-ancestor", head,
                               new_head]).returncode == 0, trial
        assert {p: new_blobs.get(p) for p in blobs} == blobs, trial
    print(outcomes)
    assert outcomes["killed"] > 0
    # every trial's episode exists exactly once when its shelve got as far as writing it
    r = run_cli("doctor", "--shelf", root, "--json")
    assert r.json()["healthy"], r
