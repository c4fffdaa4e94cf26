#!/usr/bin/env python3
"""memshelf reliability harness: the stress versions of the correctness tests (bench/README.md
§ Reliability).

tests/ proves each scenario once, small and fast; this harness repeats them at scale and prints
one table row per scenario (trials, passed, failed, wall time, notes):

- writers    N CLI processes x M shelves each, plus S MCP servers shelving through tools/call,
             on one git-local auto-mode shelf; readers (index, recall, search) run meanwhile.
             Pass: every episode on disk and committed, derived files equal a fresh rebuild,
             doctor has no error, no shelf-busy at the default lock timeout, no failed read.
- crash      kill -9 at a random moment during shelve, rebuild and rollup. Pass per trial:
             every file parses; doctor reports only the documented crash findings
             (docs/architecture.md § Interruptions); the documented repair makes doctor clean; no committed
             episode is lost or changed.
- clones     two clones shelving at once and pushing to one bare remote (auto mode), many
             rounds. Pass per round: at most one push retry each, both episodes on the remote;
             at the end derived files equal a fresh render and doctor is clean in both clones.

    python3 bench/reliability.py                      # the full run (bench/README.md)
    python3 bench/reliability.py --quick              # a minute-long smoke run
    python3 bench/reliability.py --only crash --crash-trials 500 --seed 3 --json out.json

Exit 1 when any scenario failed. Linux (the crash scenario waits for orphaned git children
through /proc). Work happens in a temporary folder (--keep-work keeps it).
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PYTHON = os.path.realpath(sys.executable)
sys.path.insert(0, REPO)
import memshelf  # noqa: E402  (the code under test, from this checkout)

ENV = dict(os.environ, PYTHONPATH=REPO, GIT_AUTHOR_NAME="memshelf bench",
           GIT_AUTHOR_EMAIL="bench@example.invalid", GIT_COMMITTER_NAME="memshelf bench",
           GIT_COMMITTER_EMAIL="bench@example.invalid")
for _name in ("MEMSHELF_SHELF", "MEMSHELF_SHELF_PATH", "MEMSHELF_ROOT", "MEMSHELF_LOCK_TIMEOUT"):
    ENV.pop(_name, None)
os.environ.update({k: v for k, v in ENV.items() if k.startswith("GIT_")})
CRASH_FINDINGS = {"uncommitted-episode", "no-ledger-row", "stale-index", "leftover-temp-file",
                  # what doctor's tree / index / HEAD comparison names after a kill
                  "episode-untracked", "derived-uncommitted", "git-staged",
                  # "derived files partly re-rendered": a rollup killed between moving an
                  # episode into archive/ and re-rendering leaves its .meta.json entry behind
                  "stale-meta-entry"}
DIGEST = ("Writer {w} chose layout {k} for the bench shelf; rejected the older one. "
          "Open: nothing left.")


# --- small helpers ---------------------------------------------------------------------------

def cli(*args, timeout=300):
    return subprocess.run([PYTHON, "-m", "memshelf", *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=timeout)


def git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True).stdout


def shelve_cmd(root, slug, writer=0, k=0, kind="topic", extra=()):
    args = ["shelve", "--shelf", root, "--slug", slug, "--kind", kind,
            "--digest", DIGEST.format(w=writer, k=k)]
    if kind == "topic":
        args += ["--section", "Decisions=- Layout {}.".format(k)]
    elif kind == "session":
        args += ["--section", "Timeline=1. Ran.", "--section", "Open threads=- None."]
    else:
        args += ["--section", "Findings=Layout {} measured.".format(k)]
    return args + list(extra)


def new_shelf(work, name, **init):
    root = os.path.join(work, name)
    memshelf.init(shelf_path=root, **init)
    return root


def committed_episodes(root):
    """{file name: blob} of every episode committed at HEAD (docs/ and archive/docs/)."""
    out = {}
    for line in git(root, "ls-tree", "-r", "HEAD", "--", "docs", "archive").splitlines():
        meta, path = line.split("\t", 1)
        if path.endswith(".md") and "/docs/" in "/" + path and path.count("/") >= 2:
            out[path.rsplit("/", 1)[-1]] = meta.split()[2]
    return out


def doctor_codes(root, levels=("error", "warning")):
    report = memshelf.doctor(shelf_path=root, no_cache=True)
    return {f["code"] for f in report["findings"]
            if f["level"] in levels or f["code"] == "leftover-temp-file"}


def whole(root, expected):
    """Problems that break the pass condition of a shared shelf (empty list = pass)."""
    problems = []
    names = set(committed_episodes(root))
    missing = [s for s in expected if s + ".md" not in names]
    if missing:
        problems.append(f"{len(missing)} episode(s) not committed (e.g. {missing[0]})")
    if git(root, "status", "--porcelain", "--untracked-files=no").strip():
        problems.append("tracked files left modified")
    check = memshelf.rebuild(shelf_path=root, check=True)
    if not check["ok"]:
        problems.append("derived files drift: " + ", ".join(check["drifted"]))
    errors = doctor_codes(root, levels=("error",))
    if errors:
        problems.append("doctor errors: " + ", ".join(sorted(errors)))
    return problems


class Row:
    def __init__(self, scenario, what):
        self.scenario, self.what = scenario, what
        self.trials = self.passed = 0
        self.failures = []
        self.notes = []
        self.started = time.perf_counter()
        self.seconds = 0.0

    def record(self, ok, why=""):
        self.trials += 1
        if ok:
            self.passed += 1
        else:
            self.failures.append(why)

    def done(self):
        self.seconds = time.perf_counter() - self.started
        return self

    def as_dict(self):
        return {"scenario": self.scenario, "what": self.what, "trials": self.trials,
                "passed": self.passed, "failed": len(self.failures),
                "seconds": round(self.seconds, 1), "notes": self.notes,
                "failures": self.failures[:20]}


# --- scenario: concurrent writers --------------------------------------------------------------

class _McpWriter(threading.Thread):
    """One MCP server (server.py over stdio) shelving `count` episodes through tools/call."""

    def __init__(self, root, index, count):
        super().__init__(daemon=True)
        self.root, self.index, self.count = root, index, count
        self.slugs, self.errors = [], []

    def run(self):
        env = dict(ENV, MEMSHELF_SHELF=self.root)
        proc = subprocess.Popen([PYTHON, os.path.join(REPO, "server.py")], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, bufsize=1)
        try:
            self.call(proc, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                           "clientInfo": {"name": "bench", "version": "1"}})
            proc.stdin.write(json.dumps({"jsonrpc": "2.0",
                                         "method": "notifications/initialized"}) + "\n")
            for k in range(self.count):
                slug = f"2026-09-{self.index + 1:02d}-mcp-{self.index}-{k}"
                result = self.call(proc, "tools/call", {"name": "memshelf_shelve", "arguments": {
                    "shelf_path": self.root, "slug": slug, "kind": "topic",
                    "digest": DIGEST.format(w=f"mcp{self.index}", k=k),
                    "sections": {"Decisions": f"- Layout {k}."}}})
                if result.get("isError"):
                    self.errors.append(json.dumps(result)[:300])
                else:
                    self.slugs.append(slug)
        except Exception as exc:  # reported in the table, never fatal to the harness
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)

    _next = [0]

    def call(self, proc, method, params):
        self._next[0] += 1
        ident = self._next[0]
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": ident, "method": method,
                                     "params": params}) + "\n")
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the server closed its output")
            msg = json.loads(line)
            if msg.get("id") == ident:
                if "error" in msg:
                    raise RuntimeError(json.dumps(msg["error"])[:300])
                return msg["result"]


def writers(work, n_writers, per_writer, n_servers, per_server):
    row = Row("writers", f"{n_writers} CLI x {per_writer} + {n_servers} MCP x {per_server} "
                         "shelves, one git-local auto shelf, readers running")
    root = new_shelf(work, "writers")
    seed = "2026-08-01-reader-target"
    if cli(*shelve_cmd(root, seed)).returncode:
        row.record(False, "seed shelve failed")
        return row.done()
    stop = threading.Event()
    read_failures, reads = [], [0]

    def reader():
        while not stop.is_set():
            try:
                memshelf.recall(shelf_path=root, episode_id=seed, log=False)
                memshelf.index(shelf_path=root)
                memshelf.search(shelf_path=root, query="layout")
                reads[0] += 1
            except Exception as exc:
                read_failures.append(f"{type(exc).__name__}: {exc}"[:200])

    def cli_writer(w, out):
        for k in range(per_writer):
            slug = f"2026-08-{(w % 28) + 1:02d}-cli-{w}-{k}"
            kind = ("topic", "research", "session")[k % 3]
            p = subprocess.run([PYTHON, "-m", "memshelf", *map(str, shelve_cmd(
                root, slug, w, k, kind))], capture_output=True, text=True, env=ENV)
            out.append((slug, p.returncode, p.stderr[-300:]))

    results = [[] for _ in range(n_writers)]
    threads = [threading.Thread(target=cli_writer, args=(w, results[w]))
               for w in range(n_writers)]
    servers = [_McpWriter(root, i, per_server) for i in range(n_servers)]
    read_thread = threading.Thread(target=reader, daemon=True)
    read_thread.start()
    for t in threads + servers:
        t.start()
    for t in threads + servers:
        t.join()
    stop.set()
    read_thread.join(timeout=60)
    expected = [seed]
    for out in results:
        for slug, code, err in out:
            row.record(code == 0, f"{slug}: exit {code}: {err}")
            if code == 0:
                expected.append(slug)
            if code and "shelf-busy" in err or "holds the shelf lock" in err:
                row.notes.append(f"shelf-busy: {slug}")
    for s in servers:
        for slug in s.slugs:
            row.record(True)
            expected.append(slug)
        for err in s.errors:
            row.record(False, f"mcp{s.index}: {err}")
    for why in whole(root, expected):
        row.record(False, why)
    for why in read_failures[:5]:
        row.record(False, "reader: " + why)
    row.notes.append(f"{len(expected) - 1} episodes shelved, {reads[0]} reader rounds, "
                     f"{len(read_failures)} failed reads")
    return row.done()


# --- scenario: kill -9 -------------------------------------------------------------------------

def _touching(path):
    needle = path.encode()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if needle in f.read():
                        found.append(pid)
            except OSError:
                pass
    return found


def _kill_after(args, delay, root):
    proc = subprocess.Popen([PYTHON, "-m", "memshelf", *map(str, args)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while _touching(root) and time.time() < deadline:   # orphaned git children finish
        time.sleep(0.02)
    return proc.returncode == -signal.SIGKILL


def _parses(root):
    marker = memshelf._TEMP_MARK
    for dirpath, dirnames, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir.split(os.sep)[0] in (".git", ".memshelf"):
            dirnames[:] = []
            continue
        for name in files:
            if marker in name:
                continue
            rel = os.path.join(rel_dir, name).replace(os.sep, "/").lstrip("./")
            with open(os.path.join(dirpath, name), "rb") as f:
                text = f.read().decode("utf-8")
            if name.endswith(".json"):
                json.loads(text)
            elif name.endswith(".md") and "docs/" in rel:
                fields, _ = memshelf.parse_frontmatter(text)
                if fields.get("id") != name[:-3]:
                    return f"{rel}: id {fields.get('id')!r}"
            elif name.endswith(".tsv"):
                rows = [r for r in text.split("\n") if r]
                width = len(rows[0].split("\t"))
                if any(len(r.split("\t")) != width for r in rows):
                    return f"{rel}: ragged rows"
    return None


def _repair(root):
    """The documented repair: memshelf repair (commits what an interrupted write left)."""
    return cli("repair", "--shelf", root).returncode == 0


def _calibrate(args_for, root, runs=2):
    """How long an uninterrupted run of the verb takes here (the kill window)."""
    spans = []
    for i in range(runs):
        args = args_for(f"calibrate-{i}")
        if args is None:
            continue
        start = time.perf_counter()
        cli(*args)
        spans.append(time.perf_counter() - start)
    return max(spans) if spans else 0.5


def crash(work, trials, seed, max_delay):
    row = Row("crash", f"kill -9 at a random moment of shelve / rebuild / rollup "
                       f"({trials} trials)")
    rng = random.Random(seed)
    root = new_shelf(work, "crash")
    for i in range(12):
        cli(*shelve_cmd(root, f"2026-05-{i + 1:02d}-seed-{i}", k=i))
    counter = [0]

    def oldest_live():
        live = sorted(n[:-3] for n in os.listdir(os.path.join(root, "docs", "topics"))
                      if n.endswith(".md") and "-roll-" not in n)
        return live[0] if live else None

    def args_for(verb):
        def make(tag):
            counter[0] += 1
            n = counter[0]
            if verb == "shelve":
                return shelve_cmd(root, f"2026-10-{(n % 28) + 1:02d}-crash-{n}", k=n)
            if verb == "rebuild":
                return ["rebuild", "--shelf", root]
            victim = oldest_live()
            if victim is None:
                cli(*shelve_cmd(root, f"2026-05-{(n % 28) + 1:02d}-refill-{n}", k=n))
                victim = oldest_live()
            return ["rollup", "--shelf", root, "--slug", f"2026-11-{(n % 28) + 1:02d}-roll-{n}",
                    "--digest", f"Bench Runner rolled up {victim}; the layout decision stands.",
                    "--episode", victim]
        return make

    windows = {v: max_delay or _calibrate(args_for(v), root) for v in
               ("shelve", "rebuild", "rollup")}
    _repair(root)
    baseline = doctor_codes(root)
    stats = {v: {"killed": 0, "finished": 0, "left_findings": 0} for v in windows}
    for trial in range(trials):
        verb = ("shelve", "rebuild", "rollup")[trial % 3]
        before = committed_episodes(root)
        head = git(root, "rev-parse", "HEAD").strip()
        killed = _kill_after(args_for(verb)(trial), rng.uniform(0, windows[verb]), root)
        stats[verb]["killed" if killed else "finished"] += 1
        problem = _parses(root)
        after = doctor_codes(root) - baseline
        if after:
            stats[verb]["left_findings"] += 1
        if not problem and not after <= CRASH_FINDINGS:
            problem = "undocumented findings: " + ", ".join(sorted(after - CRASH_FINDINGS))
        if not problem and not _repair(root):
            problem = "the repair failed"
        if not problem:
            left = doctor_codes(root) - baseline
            if left:
                problem = "doctor not clean after the repair: " + ", ".join(sorted(left))
        if not problem:
            now = committed_episodes(root)
            changed = [n for n, blob in before.items() if now.get(n) != blob]
            if changed:
                problem = f"committed episode lost or changed: {changed[0]}"
            elif subprocess.run(["git", "-C", root, "merge-base", "--is-ancestor", head,
                                 "HEAD"]).returncode:
                problem = "history rewritten"
        row.record(problem is None, f"trial {trial} ({verb}): {problem}")
        if problem:
            _repair(root)
            baseline = doctor_codes(root)
    for verb, s in stats.items():
        row.notes.append(f"{verb}: window {windows[verb]:.2f} s, killed {s['killed']}, "
                         f"finished {s['finished']}, left findings {s['left_findings']}")
    return row.done()


# --- scenario: two clones pushing --------------------------------------------------------------

def clones(work, rounds):
    row = Row("clones", f"two clones shelving at once and pushing, {rounds} rounds")
    bare = os.path.join(work, "remote.git")
    subprocess.run(["git", "init", "-q", "--bare", bare], check=True)
    git(bare, "symbolic-ref", "HEAD", "refs/heads/main")
    a = new_shelf(work, "clone-a", storage="git-remote", remote=bare)
    first = cli(*shelve_cmd(a, "2026-12-01-seed", extra=["--push"]))
    if first.returncode:
        row.record(False, "seed push failed: " + first.stderr[-300:])
        return row.done()
    b = os.path.join(work, "clone-b")
    subprocess.run(["git", "clone", "-q", bare, b], check=True)
    memshelf.sync_verb(shelf_path=b)
    expected = ["2026-12-01-seed"]
    retries = 0
    for rnd in range(rounds):
        slugs = [f"2026-12-{(rnd % 27) + 2:02d}-r{rnd}-{n}" for n in ("a", "b")]
        procs = [subprocess.Popen([PYTHON, "-m", "memshelf", *map(str, shelve_cmd(
            root, slug, extra=["--push", "--json"]))], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=ENV) for root, slug in zip((a, b), slugs)]
        ok, why = True, ""
        for slug, p in zip(slugs, procs):
            out, err = p.communicate(timeout=300)
            try:
                sync = json.loads(out)["sync"]
            except (ValueError, KeyError, TypeError):
                ok, why = False, f"{slug}: exit {p.returncode}: {err[-300:]}"
                continue
            retries += sync["push_retries"]
            if p.returncode or not sync["pushed"] or sync["push_retries"] > 1:
                ok, why = False, f"{slug}: {sync['summary']} {sync['error'] or ''}"[:400]
            else:
                expected.append(slug)
        remote_names = git(bare, "ls-tree", "-r", "--name-only", "main", "--", "docs").split()
        if ok and not all(f"docs/topics/{s}.md" in remote_names for s in slugs):
            ok, why = False, f"round {rnd}: an episode is missing on the remote"
        row.record(ok, why)
        if not ok:   # converge before the next round, as a person would
            for root in (a, b):
                subprocess.run(["sh", "-c", f"git -C {root} pull -q --rebase origin main && "
                                            f"git -C {root} push -q origin main"],
                               capture_output=True)
    for root in (a, b):
        memshelf.sync_verb(shelf_path=root)
        for why in whole(root, expected):
            row.record(False, f"{os.path.basename(root)}: {why}")
        warnings = doctor_codes(root, levels=("warning",))
        if warnings:
            row.record(False, f"{os.path.basename(root)}: doctor warnings: "
                              + ", ".join(sorted(warnings)))
    row.notes.append(f"{retries} push retries in {rounds * 2} pushes")
    return row.done()


# --- the table -------------------------------------------------------------------------------

def table(rows):
    lines = ["| scenario | trials | passed | failed | wall s | notes |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.scenario} | {r.trials} | {r.passed} | {len(r.failures)} | "
                     f"{r.seconds:.1f} | {'; '.join(r.notes)} |")
    for r in rows:
        for why in r.failures[:5]:
            lines.append(f"  - {r.scenario} failure: {why}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=["writers", "crash", "clones"],
                    help="run only these scenarios (repeatable)")
    ap.add_argument("--quick", action="store_true", help="small numbers: a smoke run")
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--per-writer", type=int, default=25)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--per-server", type=int, default=10)
    ap.add_argument("--crash-trials", type=int, default=210)
    ap.add_argument("--max-delay", type=float, default=0.0,
                    help="kill window in seconds (default: one uninterrupted run of the verb)")
    ap.add_argument("--rounds", type=int, default=20, help="two-clone rounds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--keep-work", action="store_true")
    a = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        sys.exit("bench/reliability.py needs Linux (/proc)")
    if a.quick:
        a.writers, a.per_writer, a.servers, a.per_server = 3, 4, 1, 3
        a.crash_trials, a.rounds = 15, 3
    only = a.only or ["writers", "crash", "clones"]
    work = tempfile.mkdtemp(prefix="memshelf-reliability-")
    rows = []
    try:
        if "writers" in only:
            rows.append(writers(work, a.writers, a.per_writer, a.servers, a.per_server))
            print(table(rows[-1:]), flush=True)
        if "crash" in only:
            rows.append(crash(work, a.crash_trials, a.seed, a.max_delay))
            print(table(rows[-1:]), flush=True)
        if "clones" in only:
            rows.append(clones(work, a.rounds))
            print(table(rows[-1:]), flush=True)
    finally:
        if a.keep_work:
            print(f"work kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    git_version = subprocess.run(["git", "--version"], capture_output=True,
                                 text=True).stdout.strip()
    print(f"memshelf {memshelf.__version__} ({memshelf.code_hash()}), Python "
          f"{sys.version.split()[0]}, {git_version}")
    print(table(rows))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump([r.as_dict() for r in rows], f, indent=2)
    return 1 if any(r.failures for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
