"""One commit point per write verb (git-and-sync.md § 3, issue 18): SIGINT or SIGTERM at any
instant of shelve, amend, rollup and rebuild --commit leaves the shelf in the old state (HEAD
unchanged, tree and index equal to it, exit 130) or the new one (HEAD holds the new commit, the
tree equals it, exit 0); never a stale index.lock nor a traceback; doctor's verdict agrees with
`git status`. After SIGKILL doctor names the damage and `memshelf repair` restores a clean,
complete shelf. The sweep prints its counts (trials, violations, doctor misses)."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, git

import memshelf

pytestmark = [pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="waits for orphaned git children through /proc")]

EPISODES = 200
DELAYS = 20          # per verb; spread over the verb's measured run time
DIGEST = "Dana chose JWT middleware over sessions; rejected per-route decorators. Open: none."


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gen_shelf
    out = tmp_path_factory.mktemp("sweep") / "shelf"
    gen_shelf.generate(str(out), n=EPISODES, raw_kb=0.5, git=True,
                       queries_path=str(out.parent / "queries.tsv"), log=lambda m: None)
    return out


def _children_done(root):
    """Wait for the git processes an interrupted memshelf left running to end."""
    needle = str(root).encode()
    deadline = time.time() + 20
    while time.time() < deadline:
        busy = False
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        busy = busy or needle in f.read()
                except OSError:
                    pass
        if not busy:
            return
        time.sleep(0.02)


def run_signalled(args, sig=None, delay=0.0):
    """Run `python3 -m memshelf ARGS`, send `sig` after `delay` s; (exit code, stderr, s)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "memshelf", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if sig is not None:
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(sig)
    err = proc.communicate()[1].decode("utf-8", "replace")
    return proc.returncode, err, time.monotonic() - start


def status(root):
    return git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all")


def head(root):
    return git(root, "rev-parse", "HEAD").strip()


def verdict(root):
    return memshelf.doctor(shelf_path=str(root))["healthy"]


counts_before_start = [0]


def judge(root, before, code, err):
    """The invariant's violations after one trial, and whether doctor missed the state."""
    _children_done(root)
    bad = []
    now, dirty = head(root), status(root)
    if os.path.exists(os.path.join(root, ".git", "index.lock")):
        bad.append("index.lock left")
    if "Traceback" in err and 'memshelf.py"' in err:
        bad.append("traceback: " + err[-300:])
    elif "Traceback" in err:
        # a signal before memshelf's first line runs (the interpreter still loading its
        # bytecode) is Python's own; no code in the file can catch it
        counts_before_start[0] += 1
    if now == before:
        if dirty:
            bad.append(f"old HEAD but tree/index differ: {dirty[:200]!r}")
        if code == 0:
            bad.append("exit 0 but nothing committed")
    else:
        if git(root, "rev-parse", "HEAD~1").strip() != before:
            bad.append("more than one new commit")
        if dirty:
            bad.append(f"new HEAD but tree differs: {dirty[:200]!r}")
        if code != 0:
            bad.append(f"exit {code} although the commit landed")
    miss = verdict(root) != (not dirty)
    return bad, miss, now != before


def _live_ids(root):
    return sorted(n[:-3] for n in os.listdir(os.path.join(root, "docs", "topics"))
                  if n.endswith(".md"))


def _commands(root):
    """verb -> function(trial) returning the argument list of one trial's command."""
    ids = iter(_live_ids(root))

    def shelve(t):
        return ["shelve", "--shelf", root, "--slug", f"2026-08-01-sweep-{t}", "--kind", "topic",
                "--digest", DIGEST, "--section", "Decisions=- JWT verified once."]

    def amend(t):
        return ["shelve", "--shelf", root, "--slug", "2026-08-01-sweep-0", "--kind", "topic",
                "--amend", "--digest", DIGEST.replace("none", f"rotation {t}"),
                "--section", f"Decisions=- JWT verified once ({t})."]

    def rollup(t):
        return ["rollup", "--shelf", root, "--slug", f"2026-08-02-roll-{t}", "--digest",
                "Dana folded one auth episode into this rollup. Open: none.",
                "--episode", next(ids)]

    def rebuild(t):
        # a committed stale ledger, so that the rebuild has something to commit
        with open(os.path.join(root, "ledger.tsv"), "a", encoding="utf-8") as f:
            f.write(f"2026-01-01\tstale-{t}\tlive\t0\t0\t\n")
        git(root, "commit", "-q", "--no-verify", "-m", f"stale ledger {t}", "--",
            "ledger.tsv")
        return ["rebuild", "--shelf", root, "--commit"]

    return {"shelve": shelve, "amend": amend, "rollup": rollup, "rebuild --commit": rebuild}


def test_sigint_and_sigterm_sweep(template, tmp_path):
    root = tmp_path / "shelf"
    shutil.copytree(template, root, symlinks=True)
    assert verdict(root) and not status(root)
    counts = {"trials": 0, "violations": 0, "doctor_misses": 0, "committed": 0}
    problems = []
    trial = 0
    for verb, make in _commands(root).items():
        # the verb's own run time, measured once, spreads the delays over it
        code, err, took = run_signalled(make(trial))
        assert code == 0, (verb, err)
        trial += 1
        for k in range(DELAYS):
            sig = (signal.SIGINT, signal.SIGTERM)[k % 2]
            delay = 0.03 + took * 1.1 * k / (DELAYS - 1)
            args = make(trial)
            before = head(root)
            code, err, _ = run_signalled(args, sig, delay)
            trial += 1
            bad, miss, landed = judge(root, before, code, err)
            counts["trials"] += 1
            counts["committed"] += landed
            counts["doctor_misses"] += miss
            if bad:
                counts["violations"] += 1
                problems.append((verb, sig.name, round(delay, 3), code, bad))
                # start the next trial from a clean state
                git(root, "reset", "-q", "--hard")
                git(root, "clean", "-fdq", "--", "docs", "archive")
                for lock in ("index.lock",):
                    try:
                        os.unlink(os.path.join(root, ".git", lock))
                    except OSError:
                        pass
    counts["signals_before_start"] = counts_before_start[0]
    print("sweep:", counts)
    for p in problems:
        print("  ", p)
    assert counts["violations"] == 0 and counts["doctor_misses"] == 0, (counts, problems[:5])
    assert 0 < counts["committed"] < counts["trials"]
