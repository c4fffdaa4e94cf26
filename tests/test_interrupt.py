"""One commit point per write verb (docs/architecture.md § Interruptions, issue 18): SIGINT or
SIGTERM at any instant of shelve, amend, rollup and rebuild --commit leaves the shelf in the old
state (HEAD unchanged, tree and index equal to it, exit 130) or the new one (HEAD holds the new
commit, the tree equals it, exit 0); never a stale index.lock nor a traceback; doctor's verdict
agrees with `git status`. After SIGKILL doctor names the damage and `memshelf repair` restores a
clean, complete shelf. The sweep prints its counts (trials, violations, doctor misses)."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, copy_of_template, git

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
    return git(root, "--no-optional-locks", "status", "--porcelain=v1", "-z",
               "--untracked-files=all")


def head(root):
    return git(root, "rev-parse", "HEAD").strip()


def verdict(root):
    return memshelf.doctor(shelf_path=str(root))["healthy"]


counts_before_start = [0]


def judge(root, before, code, err, sig):
    """The invariant's violations after one trial, and whether doctor missed the state."""
    _children_done(root)
    bad = []
    now, dirty = head(root), status(root)
    if os.path.exists(os.path.join(root, ".git", "index.lock")):
        bad.append("index.lock left")
    # a signal before memshelf's first line runs (the interpreter still loading its bytecode)
    # is Python's own (a traceback of importlib frames, exit 1): no code in the file sees it
    before_start = "Traceback" in err and 'memshelf.py"' not in err
    counts_before_start[0] += before_start
    if "Traceback" in err and not before_start:
        bad.append("traceback: " + err[-300:])
    if now == before:
        if dirty:
            bad.append(f"old HEAD but tree/index differ: {dirty[:200]!r}")
        if code not in (130, -sig) and not before_start:   # -sig: before the first line too
            bad.append(f"exit {code} but nothing committed")
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


@pytest.mark.slow
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
            bad, miss, landed = judge(root, before, code, err, sig)
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


@pytest.mark.slow
def test_sigkill_then_doctor_names_the_damage_and_repair_restores(template, tmp_path):
    root = tmp_path / "shelf"
    shutil.copytree(template, root, symlinks=True)
    committed = set(git(root, "ls-files", "--", "docs").split())
    kinds = {"damaged": 0, "clean": 0}
    for trial in range(10):
        slug = f"2026-08-03-kill-{trial}"
        args = ["shelve", "--shelf", root, "--slug", slug, "--kind", "topic", "--digest", DIGEST,
                "--section", "Decisions=- JWT."] if trial % 3 else ["rebuild", "--shelf", root,
                                                                   "--commit"]
        if not trial % 3:
            with open(os.path.join(root, "ledger.tsv"), "a", encoding="utf-8") as f:
                f.write(f"2026-01-01\tstale-{trial}\tlive\t0\t0\t\n")
            git(root, "commit", "-q", "--no-verify", "-m", "stale ledger", "--", "ledger.tsv")
        run_signalled(args, signal.SIGKILL, 0.05 + 0.025 * trial)
        _children_done(root)
        path = root / "docs" / "topics" / f"{slug}.md"
        written = path.exists()
        if [e for e in status(root).split("\0") if e and memshelf._TEMP_MARK not in e]:
            kinds["damaged"] += 1
            report = memshelf.doctor(shelf_path=str(root))
            assert not report["healthy"], (trial, status(root))
            named = {f["path"] for f in report["findings"] if f["level"] == "error"}
            dirty = {e[3:] for e in status(root).split("\0") if e}
            assert dirty & named, (trial, dirty, named)
        else:
            kinds["clean"] += 1
        before = status(root)
        r = run_signalled(["repair", "--shelf", root])
        assert r[0] == 0, r
        assert not status(root) and verdict(root), (trial, before, r, status(root))
        now = set(git(root, "ls-files", "--", "docs").split())
        assert committed <= now, trial
        if written:
            assert f"docs/topics/{slug}.md" in now, trial
        committed = now
    print("sigkill:", kinds)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_imports_ends_quietly(sig):
    """The handlers come before memshelf's imports: a signal while they load (sent here by an
    import hook the moment `json` is asked for) ends with one line and 130, no traceback."""
    code = ("import os, sys\n"
            "class Hook:\n"
            "    @staticmethod\n"
            "    def find_spec(name, *rest):\n"
            f"        if name == 'json': os.kill(os.getpid(), {int(sig)})\n"
            "sys.meta_path.insert(0, Hook)\n"
            "sys.argv = ['memshelf', 'index']\n"
            "import memshelf\n"
            "print('imported')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (p.returncode, p.stderr, p.stdout) == (130, "memshelf: interrupted\n", ""), p


# --- each finding of the tree / index / HEAD comparison, and its repair ----------------------

def _three_small(root):
    memshelf.init(shelf_path=str(root))
    for i in range(3):
        memshelf.shelve(shelf_path=str(root), slug=f"2026-06-0{i + 1}-small", kind="topic",
                        digest=DIGEST, sections={"Decisions": "- JWT."})


@pytest.fixture
def small(tmp_path, tmp_path_factory):
    """Built once, copied for each test."""
    return copy_of_template(tmp_path_factory, tmp_path / "small", "interrupt-small",
                            _three_small)


def _episode_text(root, slug):
    return memshelf.shelve(shelf_path=str(root), slug=slug, kind="topic", digest=DIGEST,
                           sections={"Decisions": "- JWT."}, dry_run=True)["episode_text"]


def _findings(root):
    return {(f["code"], f["path"], f["level"]) for f in memshelf.doctor(shelf_path=str(root))
            ["findings"] if f["class"] == "git"}


def _repaired(root, cwd):
    """memshelf repair, run from another folder: the shelf ends clean and healthy."""
    r = run_signalled(["repair", "--shelf", root])
    assert r[0] == 0, r
    assert not status(root), status(root)
    report = memshelf.doctor(shelf_path=str(root))
    assert report["healthy"] and not [f for f in report["findings"] if f["class"] == "git"]


@pytest.mark.slow
def test_committed_missing(small, tmp_path):
    rel = "docs/topics/2026-06-01-small.md"
    os.unlink(small / rel)
    found = _findings(small)
    assert ("committed-missing", rel, "error") in found
    fix = [f["fix"] for f in memshelf.doctor(shelf_path=str(small))["findings"]
           if f["code"] == "committed-missing"][0]
    assert fix == (f"memshelf repair --shelf {small} puts it back; to delete it on purpose: "
                   f"memshelf purge --shelf {small} --id ID --apply")
    _repaired(small, tmp_path)
    assert (small / rel).exists()


@pytest.mark.slow
def test_staged_episode_on_disk_and_gone(small, tmp_path):
    on_disk = "docs/topics/2026-06-10-staged.md"
    gone = "docs/topics/2026-06-11-staged-gone.md"
    for rel in (on_disk, gone):
        (small / rel).write_text(_episode_text(small, rel[12:-3]), encoding="utf-8")
        git(small, "add", "--", rel)
    os.unlink(small / gone)
    found = _findings(small)
    assert {("git-staged", on_disk, "error"), ("git-staged", gone, "error")} <= found
    _repaired(small, tmp_path)
    tracked = git(small, "ls-files", "--", "docs").split()
    assert on_disk in tracked and gone not in tracked


@pytest.mark.slow
def test_untracked_episode_and_index_listing_it(small, tmp_path):
    rel = "docs/topics/2026-06-12-orphan.md"
    (small / rel).write_text(_episode_text(small, "2026-06-12-orphan"), encoding="utf-8")
    memshelf.rebuild(shelf_path=str(small))
    # the derived files that list it are committed; the episode is not
    git(small, "commit", "-q", "--no-verify", "-m", "derived only", "--", "INDEX.md",
        "ledger.tsv", "docs/topics/.meta.json", "stats.svg")
    found = _findings(small)
    assert ("episode-untracked", rel, "error") in found
    assert ("index-lists-uncommitted", "INDEX.md", "error") in found
    assert ("index-lists-uncommitted", "ledger.tsv", "error") in found
    _repaired(small, tmp_path)
    assert rel in git(small, "ls-files", "--", "docs").split()


@pytest.mark.slow
def test_derived_uncommitted_is_an_error_in_auto_a_warning_in_bot(small, tmp_path):
    with open(small / "INDEX.md", "a", encoding="utf-8") as f:
        f.write("\n")
    assert ("derived-uncommitted", "INDEX.md", "error") in _findings(small)
    (small / "memshelf.json").write_text('{"derived": "bot"}\n', encoding="utf-8")
    git(small, "commit", "-q", "-m", "bot", "--", "memshelf.json")
    assert ("derived-uncommitted", "INDEX.md", "warning") in _findings(small)
    _repaired(small, tmp_path)   # bot: put back to HEAD, never rendered here


@pytest.mark.slow
def test_stale_git_lock(small, tmp_path):
    lock = small / ".git" / "index.lock"
    lock.write_bytes(b"")
    os.utime(lock, (time.time() - 60, time.time() - 60))
    assert ("git-lock-stale", "index.lock", "error") in _findings(small)
    code, err, _ = run_signalled(["shelve", "--shelf", small, "--slug", "2026-06-13-locked",
                                  "--kind", "topic", "--digest", DIGEST,
                                  "--section", "Decisions=- JWT."])
    assert code == 1 and "which no running process holds" in err, err
    assert f"memshelf repair --shelf {small}" in err and "File exists" not in err
    assert not status(small)   # refused before anything was written
    _repaired(small, tmp_path)
    assert not lock.exists()


@pytest.mark.slow
def test_rebuild_commit_commits_drift_an_earlier_run_left(small):
    with open(small / "ledger.tsv", "a", encoding="utf-8") as f:
        f.write("2026-01-01\tstale\tlive\t0\t0\t\n")
    git(small, "commit", "-q", "--no-verify", "-m", "stale", "--", "ledger.tsv")
    memshelf.rebuild(shelf_path=str(small))       # the fresh ledger, uncommitted: M ledger.tsv
    assert status(small)
    r = memshelf.rebuild(shelf_path=str(small), commit=True)   # writes nothing, commits it
    assert r["written"] == [] and r["committed"] and not status(small), r


@pytest.mark.slow
def test_init_refuses_an_unrelated_root_beside_a_remote_history(small, tmp_path):
    bare = tmp_path / "remote.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(small), str(bare)], check=True)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    subprocess.run(["git", "-C", str(fresh), "init", "-q"], check=True)
    git(fresh, "remote", "add", "origin", str(bare))
    with pytest.raises(memshelf.ShelfError) as exc:
        memshelf.init(shelf_path=str(fresh))
    assert "already holds a history (branch main)" in exc.value.message
    assert "git clone -b main" in exc.value.fix
    assert not subprocess.run(["git", "-C", str(fresh), "rev-parse", "-q", "--verify", "HEAD"],
                              capture_output=True).stdout


def _mount_tmpfs(path, size):
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_disk_full_refused_shelve_leaves_nothing(small, tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "3m"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount)")
    try:
        root = disk / "shelf"
        shutil.copytree(small, root, symlinks=True)
        head_before = head(root)
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:                                     # fill the disk to the last block
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        refused = 0
        for freed in (0, 8, 16, 32, 64, 128):
            os.truncate(disk / "filler", max(0, os.path.getsize(disk / "filler") - 4096 * freed))
            slug = f"2026-06-20-full-{freed}"
            code, err, _ = run_signalled(["shelve", "--shelf", root, "--slug", slug, "--kind",
                                          "topic", "--digest", DIGEST, "--section",
                                          "Decisions=- " + "JWT verified once. " * 400])
            if code == 0:
                break
            refused += 1
            assert code == 1 and "Traceback" not in err, err
            assert head(root) == head_before and not status(root), (freed, status(root))
            for rel in ("INDEX.md", "ledger.tsv", "docs/topics/.meta.json"):
                assert slug not in (root / rel).read_text(encoding="utf-8"), rel
        assert refused
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_repair_bad_input_and_plain_shelf(tmp_path, plain_shelf):
    code, err, _ = run_signalled(["repair", "--shelf", tmp_path / "nowhere"])
    assert code == 1 and "fix: create it with: memshelf init" in err, err
    assert not (tmp_path / "nowhere").exists()
    r = memshelf.repair(shelf_path=str(plain_shelf))
    assert r["summary"] == "not a git shelf: nothing to repair"
    assert not r["committed"]
