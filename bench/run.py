#!/usr/bin/env python3
"""memshelf benchmark harness: speed, memory, token economy and retrieval against
memshelf-mcp 0.4.0 (bench/README.md; results in docs/performance.md).

Flow: generate (or reuse) a synthetic shelf per size in bench/.cache/ -> copy it once per
implementation -> run the cases in a fixed order, each case for every implementation in turn
(on its own copy) -> table (+ JSON/Markdown files) -> optional --check against
bench/targets.json.

Method (bench/README.md § Method): cold = a new process per run after one untimed warm-up, median and p90 of
--repeat runs; every measured child runs under a tiny wrapper process, so the wrapper's
RUSAGE_CHILDREN peak RSS belongs to that one child; the interpreter binary is called directly
(sys.executable resolved, never a version-manager shim). Warm = repeated calls in one MCP server.
A verb that fails (a stub, an internal error) is reported as n/a and never stops the run.

    python3 bench/run.py --smoke
    python3 bench/run.py --sizes 1000,10000 --ref --md --json
    python3 bench/run.py --sizes 10000 --check
"""
import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import queue
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import tempfile
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CACHE = os.path.join(HERE, ".cache")
RESULTS = os.path.join(HERE, "results")
TARGETS = os.path.join(HERE, "targets.json")
DEFAULT_REF = "/tmp/ref040/bin/memshelf"
sys.path.insert(0, HERE)
import gen_shelf  # noqa: E402  (the generator lives next to this file)

PYTHON = os.path.realpath(sys.executable)
GIT_ENV = {k: v for k, v in gen_shelf.GIT_ENV.items() if "DATE" not in k}
RUN_TIMEOUT = 1800
HOOK_STDIN = json.dumps({"session_id": "bench", "hook_event_name": "SessionStart",
                         "source": "startup"})
SHELVE_DIGEST = ("Bench Runner chose a fixed layout for run {k} of the shelve case. "
                 "Open: nothing left.")

# (name, what is measured) in execution order; order matters: writes come last
CASES = [
    ("version", "`--version`, cold, console script"),
    ("interpreter-floor", "floor of every cold process: the venv's interpreter starts and "
                          "exits (`-c pass`); no memshelf code (ours only)"),
    ("index", "`index`, cold, INDEX current (fast path)"),
    ("index-script", "`python3 memshelf.py index`, cold, script mode (0.4.0: its console script)"),
    ("index-floor", "floor of any `index` under the freshness rule: the interpreter, a stat "
                    "of every episode file, INDEX.md to stdout; no memshelf code (ours only)"),
    ("index-script-floor", "floor of `python3 memshelf.py index`: index-floor plus compiling "
                           "memshelf.py, which script mode does on every call (ours only)"),
    ("recall-section", "`recall --section`, cold CLI"),
    ("recall-script", "`python3 memshelf.py recall --section`, script mode (0.4.0: console)"),
    ("stats", "`stats`, cold CLI"),
    ("hook-session-start", "`hook session-start`, cold"),
    ("rebuild-empty", "`rebuild`, cold, empty cache"),
    ("rebuild-warm", "`rebuild`, cold, warm cache, nothing changed"),
    ("rebuild-check", "`rebuild --check`, cold, warm cache"),
    ("doctor-empty", "`doctor`, cold, empty cache"),
    ("doctor-warm", "`doctor`, cold, warm cache"),
    ("search-build", "`search`, first full index build (no cache)"),
    ("search", "`search`, cold CLI, index built"),
    ("mcp-initialize", "MCP spawn -> `initialize` answer"),
    ("mcp-recall", "`memshelf_recall`, warm MCP call (p50/p95)"),
    ("mcp-search", "`memshelf_search`, warm MCP call (p50/p95)"),
    ("search-incremental", "search after one new episode, in-process"),
    ("shelve-auto", "`shelve`, derived: auto, cold CLI, git"),
    ("shelve-bot", "`shelve`, derived: bot, cold CLI, episode-only commit"),
    ("shelve-script", "`python3 memshelf.py shelve`, derived: auto, script mode (0.4.0: console)"),
    ("shelve-floor", "floor of a `shelve` in auto mode: its git commands alone, the pre-commit "
                     "guard running; no other memshelf code (ours only)"),
    ("retrieval", "lexical hit@5 / MRR per query label"),
    ("questions", "section hit@1 / hit@5 of bench/questions.tsv on bench/design_docs.py"),
    ("tokens", "token economy (INDEX and digest tokens)"),
]
CASE_NAMES = [c[0] for c in CASES]
CASE_GROUPS = {
    "cold": ["version", "interpreter-floor", "index", "index-script", "index-floor", "index-script-floor",
             "recall-section",
             "recall-script", "stats", "hook-session-start", "rebuild-empty", "rebuild-warm",
             "rebuild-check",
             "doctor-empty", "doctor-warm", "search-build", "search", "shelve-auto",
             "shelve-bot", "shelve-script", "shelve-floor"],
    "floors": ["interpreter-floor", "index-floor", "index-script-floor", "shelve-floor"],
    "mcp": ["mcp-initialize", "mcp-recall", "mcp-search"],
    "find": ["search-build", "search", "mcp-search", "search-incremental", "retrieval",
             "questions"],
    "write": ["shelve-auto", "shelve-bot", "shelve-script", "shelve-floor"],
}
# --cases takes both: a group named like a case would select more than that case
assert not set(CASE_GROUPS) & set(CASE_NAMES), "a case group is named like a case"
HEAVY = {"rebuild-empty", "doctor-empty", "search-build"}
# Each cold case's floor (FLOORS_OF[case]: the floor cases summed, "listing" is index-floor
# less interpreter-floor and "compile" index-script-floor less index-floor): what the case pays
# before memshelf's own work, measured in the same run. bench/README.md § Floors.
FLOOR_PARTS = {"listing": ("index-floor", "interpreter-floor"),
               "compile": ("index-script-floor", "index-floor")}
FLOORS_OF = dict(
    {"version": ("interpreter-floor",)},
    **{c: ("index-floor",) for c in (
        "index", "recall-section", "stats", "hook-session-start", "rebuild-empty",
        "rebuild-warm", "rebuild-check", "doctor-empty", "doctor-warm", "search-build",
        "search")},
    **{c: ("index-script-floor",) for c in ("index-script", "recall-script")},
    **{c: ("shelve-floor", "listing") for c in ("shelve-auto", "shelve-bot")},
    **{"shelve-script": ("shelve-floor", "listing", "compile")})
MEMORY_CASES = ("rebuild-empty", "rebuild-warm", "doctor-empty", "doctor-warm", "search-build")

# Script mode compiles memshelf.py before its first line runs (argv[2]: its path).
COMPILE = "import sys\ncompile(open(sys.argv[2], 'rb').read(), sys.argv[2], 'exec')\n"

# What an auto-mode `shelve` must do in git (commits of exact paths, hooks run) and no more: in a private
# index, stage the new episode and the derived files it changes (each a line longer here, as a
# render makes them), commit with the hooks running (the pre-commit secret guard runs
# memshelf), set the real index's entries to the commit's. Its time bounds a shelve's ratio.
SHELVE_FLOOR = r'''
import os, shutil, subprocess, sys
root, k = sys.argv[1], sys.argv[2]
def git(*args, env=None, input=None):
    return subprocess.run(["git", "-C", root, *args], env=env, input=input, check=True,
                          capture_output=True).stdout
slug = "2026-01-15-bench-floor-" + k
paths = ["docs/topics/%s.md" % slug, "INDEX.md", "ledger.tsv", "docs/topics/.meta.json",
         "stats.svg"]
with open(os.path.join(root, paths[0]), "w", encoding="utf-8") as f:
    f.write("# %s\n\n---\nid: %s\nkind: topic\ndate: 2026-01-15\n---\n\n## Digest\nBench "
            "Runner kept the floor fixed. Open: nothing left.\n\n## Decisions\n- Keep it small.\n"
            % (slug, slug))
for rel in paths[1:]:
    with open(os.path.join(root, rel), "a", encoding="utf-8") as f:
        f.write("floor %s\n" % k)
private = os.path.join(git("rev-parse", "--absolute-git-dir").decode().strip(), "floor-index")
env = dict(os.environ, GIT_INDEX_FILE=private)
shutil.copyfile(os.path.join(os.path.dirname(private), "index"), private)
git("read-tree", "-m", "HEAD", env=env)
git("add", "-A", "--", *paths, env=env)
git("diff", "--cached", "--name-only", "-z", "--", *paths, env=env)
git("commit", "-q", "-m", "shelve: " + slug, env=env)
git("update-index", "-q", "--refresh", "-z", "--index-info",
    input=git("ls-tree", "-z", "--full-name", "HEAD", "--", *paths))
os.unlink(private)
'''

# What any `index` must do under the one freshness rule (docs/architecture.md), and no more:
# start the interpreter, stat every episode file, print INDEX.md. Its time bounds the ratio an
# `index` can reach against 0.4.0 on this machine.
FLOOR = r'''
import os, sys
root = sys.argv[1]
for base in ("docs", "archive/docs"):
    for cat in ("topics", "research", "sessions"):
        try:
            entries = list(os.scandir(os.path.join(root, base, cat)))
        except OSError:
            continue
        for e in entries:
            if e.name.endswith(".md") and e.is_file(follow_symlinks=False):
                e.stat()
with open(os.path.join(root, "INDEX.md"), encoding="utf-8") as f:
    sys.stdout.write(f.read())
'''

# The measured child runs under this wrapper: its RUSAGE_CHILDREN is that one child.
WRAPPER = r'''
import json, os, resource, subprocess, sys, threading, time
spec = json.load(open(sys.argv[1]))
darwin = sys.platform == "darwin"
def maxrss():
    r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return r // 1024 if darwin else r
def vmrss(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
res = {"rc": None, "wall": None, "maxrss_kb": None}
if spec["mode"] == "run":
    out = open(spec["stdout"], "wb"); err = open(spec["stderr"], "wb")
    stdin = open(spec["stdin"], "rb") if spec.get("stdin") else subprocess.DEVNULL
    t0 = time.perf_counter()
    p = subprocess.Popen(spec["argv"], stdin=stdin, stdout=out, stderr=err,
                         cwd=spec.get("cwd"), env=spec["env"])
    # a blocking wait: Popen.wait(timeout=...) polls with sleeps of up to 50 ms, which would
    # round every timing up to that grid; a timer thread enforces the timeout instead
    fired = []
    timer = threading.Timer(spec["timeout"], lambda: (fired.append(1), p.kill()))
    timer.start()
    rc = p.wait()
    res["wall"] = time.perf_counter() - t0
    timer.cancel()
    res["rc"] = "timeout" if fired else rc
else:  # mcp: spawn -> initialize answer; then the idle RSS of the server
    err = open(spec["stderr"], "wb")
    t0 = time.perf_counter()
    p = subprocess.Popen(spec["argv"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=err, cwd=spec.get("cwd"), env=spec["env"])
    got = []
    def reader():
        for line in p.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("id") == 1:
                got.append((time.perf_counter(), line.decode("utf-8", "replace")))
                return
    th = threading.Thread(target=reader, daemon=True); th.start()
    p.stdin.write((json.dumps(spec["initialize"]) + "\n").encode()); p.stdin.flush()
    th.join(spec["timeout"])
    if got:
        res["wall"] = got[0][0] - t0
        res["response"] = got[0][1][:200000]
        try:
            p.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
            p.stdin.flush()
        except OSError:
            pass
        time.sleep(spec.get("idle_wait", 0.3))
        res["idle_rss_kb"] = vmrss(p.pid)
    try:
        p.stdin.close()
    except OSError:
        pass
    try:
        rc = p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill(); rc = p.wait()
    res["rc"] = 0 if got else ("no-answer" if rc == 0 else rc)
res["maxrss_kb"] = maxrss()
sys.stdout.write(json.dumps(res))
'''


# ==========================================================================================
# Small pieces: statistics, formatting, environment
# ==========================================================================================

def percentile(values, q):
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q / 100.0 * len(s)) - 1)]


def fmt_s(seconds):
    if seconds is None:
        return "n/a"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_num(x, digits=1):
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}"


def tokens(text):
    return len(text) // 4


def _first(path, prefix):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cmd_output(argv):
    try:
        return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({exc})"


def _repo_commit(repo):
    """HEAD of the repository, read from .git without running git in the work tree."""
    git_dir = os.path.join(repo, ".git")
    try:
        head = open(os.path.join(git_dir, "HEAD")).read().strip()
        if not head.startswith("ref: "):
            return head[:12]
        ref = head[5:]
        path = os.path.join(git_dir, ref)
        if os.path.exists(path):
            return open(path).read().strip()[:12] + f" ({ref.rsplit('/', 1)[-1]})"
        with open(os.path.join(git_dir, "packed-refs")) as f:
            for line in f:
                if line.rstrip().endswith(" " + ref):
                    return line.split()[0][:12] + f" ({ref.rsplit('/', 1)[-1]})"
    except OSError:
        pass
    return None


_PROBE = r"""
import json, platform, sqlite3
fts5 = True
try:
    con = sqlite3.connect(":memory:")
    con.execute("create virtual table t using fts5(x)")
    con.close()
except sqlite3.Error:
    fts5 = False
print(json.dumps({"python": platform.python_version(), "sqlite": sqlite3.sqlite_version,
                  "fts5": fts5}))
"""


def environment(code_dir):
    """The machine, and the interpreter memshelf runs on (its SQLite and FTS5, not ours)."""
    try:
        probe = json.loads(subprocess.run([PYTHON, "-c", _PROBE], stdout=subprocess.PIPE,
                                          text=True, timeout=60).stdout)
    except (ValueError, OSError, subprocess.SubprocessError):
        probe = {"python": None, "sqlite": None, "fts5": None}
    cpu = _first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
            "os": platform.platform(), "python": probe["python"], "python_path": PYTHON,
            "git": _cmd_output(["git", "--version"]), "sqlite": probe["sqlite"],
            "fts5": probe["fts5"], "memshelf_commit": _repo_commit(code_dir)}


def clean_env(extra=None):
    env = {k: v for k, v in os.environ.items()   # MEMSHELF_WORKERS is a measuring choice
           if not (k.startswith("MEMSHELF_") and k != "MEMSHELF_WORKERS") and
           k != "PYTHONDONTWRITEBYTECODE"}
    env.update(GIT_ENV)
    env.update(extra or {})
    return env


def _file_hash(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:12]
    except OSError:
        return None


def log(msg):
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


# ==========================================================================================
# Implementations under test
# ==========================================================================================

class Impl:
    """How one implementation is called: CLI argv per verb, MCP server argv and arguments."""

    def __init__(self, key, label, console, script=None, server=None, ref=False):
        self.key, self.label, self.ref = key, label, ref
        self.console, self.script, self.server = console, script, server
        self.version = None
        self.interpreter = console[0] if console and "python" in console[0] else None

    def argv(self, verb, shelf, **kw):
        """The CLI argv for a verb, or None when the implementation has no such verb."""
        base = list(self.console)
        if verb.endswith("-script"):
            # ours compiled on every call (python3 memshelf.py); 0.4.0 has only its console
            # script, which is what a user of it runs
            verb = verb[:-len("-script")]
            if not self.ref:
                if self.script is None:
                    return None
                base = list(self.script)
        if verb == "version":
            return base + ["--version"]
        if verb == "index":
            return base + ["index", "--shelf", shelf]
        if verb == "recall":
            return base + ["recall", "--shelf", shelf, "--id", kw["episode"],
                           "--section", kw["section"]]
        if verb == "search":
            if self.ref:
                return base + ["search", "--shelf", shelf, "--query", kw["query"],
                               "--max-results", str(kw.get("max_results", 10))]
            extra = ["--json"] if kw.get("json") else []
            return base + ["search", "--shelf", shelf, "--max-results",
                           str(kw.get("max_results", 10))] + extra + kw["query"].split()
        if verb == "shelve":
            args = base + ["shelve", "--shelf", shelf, "--slug", kw["slug"], "--kind", "topic",
                           "--digest", kw["digest"], "--section",
                           "Decisions=- Keep the bench layout fixed across runs.",
                           "--section", "Raw excerpts=```\nbench run output\n```",
                           "--tag", "bench", "--approx-tokens", "4000", "--no-sync"]
            return args
        if verb in ("rebuild", "rebuild-check"):
            return base + ["rebuild", "--shelf", shelf] + (["--check"] if verb == "rebuild-check"
                                                          else [])
        if verb in ("doctor", "stats"):
            return base + [verb, "--shelf", shelf]
        if verb == "hook-session-start":
            return None if self.ref else base + ["hook", "session-start", "--shelf", shelf]
        if verb == "recall-raw":
            return None if self.ref else base + ["recall", "--shelf", shelf, "--id", kw["episode"],
                                                 "--section", kw["section"], "--raw", "--no-log"]
        if verb == "index-format":
            return None if self.ref else base + ["rebuild", "--shelf", shelf, "--index-format",
                                                 kw["format"]]
        raise KeyError(verb)

    def env(self, shelf=None):
        extra = {}
        if shelf:
            extra["MEMSHELF_SHELF_PATH" if self.ref else "MEMSHELF_SHELF"] = shelf
        return clean_env(extra)

    def tool_args(self, shelf, **args):
        args = dict(args, shelf_path=shelf)
        if self.ref:  # 0.4.0 nests every tool's arguments under "params"
            args.pop("log", None)
            return {"params": args}
        return args


def bench_venv():
    """A venv of the bench interpreter, without pip: ours runs the way pip installs it.

    memshelf-mcp 0.4.0 runs from its own venv, whose site skips the base interpreter's
    site-packages and their .pth files; a machine with heavy .pth files (certifi hooks and the
    like) would otherwise charge their start-up cost to memshelf alone."""
    venv = os.path.join(CACHE, "venv")
    py = os.path.join(venv, "bin", "python3")
    cfg = os.path.join(venv, "pyvenv.cfg")
    want = f"executable = {PYTHON}"
    if not (os.path.exists(py) and os.path.exists(cfg) and want in open(cfg).read()):
        shutil.rmtree(venv, ignore_errors=True)
        made = subprocess.run([PYTHON, "-m", "venv", "--without-pip", venv],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if made.returncode != 0 or not os.path.exists(py):
            log("bench: could not make a venv (" + made.stderr.decode(errors="replace").strip()
                + "); memshelf runs on the bare interpreter")
            return PYTHON
    return py  # not realpath'd: the symlink is what makes it a venv interpreter


def console_entry(code_dir):
    """(module, function) of the `memshelf` console script pyproject.toml declares; an older
    checkout without one (or without the file) ran memshelf:main."""
    try:
        with open(os.path.join(code_dir, "pyproject.toml"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "memshelf", "main"
    found = re.search(r'(?m)^memshelf = "([A-Za-z_][\w.]*):([A-Za-z_]\w*)"', text)
    return found.groups() if found else ("memshelf", "main")


def our_impl(code_dir):
    python = bench_venv()
    launcher = os.path.join(CACHE, "bin", "memshelf")
    os.makedirs(os.path.dirname(launcher), exist_ok=True)
    # what pip's console-script launcher for pyproject's entry point does; the module is
    # imported, so its bytecode is cached
    module, func = console_entry(code_dir)
    text = (f"#!{python}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n"
            f"sys.path.insert(0, {code_dir!r})\nfrom {module} import {func}\n"
            "if __name__ == '__main__':\n"
            "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
            f"    sys.exit({func}())\n")
    if not os.path.exists(launcher) or open(launcher).read() != text:
        with open(launcher, "w") as f:
            f.write(text)
        os.chmod(launcher, 0o755)
    server = os.path.join(code_dir, "server.py")
    impl = Impl("ours", "memshelf", [python, launcher],
                script=[python, os.path.join(code_dir, "memshelf.py")],
                server=[python, server] if os.path.exists(server) else None)
    impl.code_dir = code_dir
    return impl


def ref_impl(ref_cmd, ref_server_cmd=None):
    console = shlex.split(ref_cmd)
    if not console or not (os.path.exists(console[0]) or shutil.which(console[0])):
        return None
    server = shlex.split(ref_server_cmd) if ref_server_cmd else None
    if server is None:
        sibling = os.path.join(os.path.dirname(console[0]), "memshelf-mcp")
        server = [sibling] if os.path.exists(sibling) else None
    impl = Impl("ref", "memshelf-mcp 0.4.0", console, server=server, ref=True)
    try:  # the interpreter its launcher names, for the machine block
        with open(shutil.which(console[0]) or console[0], "rb") as f:
            first = f.readline().decode("utf-8", "replace").strip()
        if first.startswith("#!"):
            impl.interpreter = os.path.realpath(first[2:].split()[0])
    except OSError:
        pass
    return impl


# ==========================================================================================
# Running children
# ==========================================================================================

class Runner:
    """Runs one measured child per wrapper process and returns wall time, exit, RSS, output."""

    def __init__(self):
        self.tmp = os.path.join(CACHE, "tmp")
        os.makedirs(self.tmp, exist_ok=True)
        self.wrapper = os.path.join(self.tmp, "wrapper.py")
        with open(self.wrapper, "w") as f:
            f.write(WRAPPER)

    def run(self, argv, env, stdin_text=None, cwd=None, timeout=RUN_TIMEOUT):
        spec = {"mode": "run", "argv": argv, "env": env, "cwd": cwd, "timeout": timeout,
                "stdout": os.path.join(self.tmp, "out.txt"),
                "stderr": os.path.join(self.tmp, "err.txt")}
        if stdin_text is not None:
            spec["stdin"] = os.path.join(self.tmp, "in.txt")
            with open(spec["stdin"], "w", encoding="utf-8") as f:
                f.write(stdin_text)
        res = self._wrap(spec, timeout)
        res["stdout"] = _read(spec["stdout"])
        res["stderr"] = _read(spec["stderr"])
        return res

    def mcp_initialize(self, argv, env, timeout=120):
        spec = {"mode": "mcp", "argv": argv, "env": env, "timeout": timeout,
                "stderr": os.path.join(self.tmp, "err.txt"),
                "initialize": {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                               "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                                          "clientInfo": {"name": "memshelf-bench",
                                                         "version": "1"}}}}
        res = self._wrap(spec, timeout + 30)
        res["stdout"] = res.pop("response", "")
        res["stderr"] = _read(spec["stderr"])
        return res

    def _wrap(self, spec, timeout):
        path = os.path.join(self.tmp, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        try:
            proc = subprocess.run([PYTHON, "-S", self.wrapper, path], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, timeout=timeout + 60)
            return json.loads(proc.stdout)
        except (ValueError, subprocess.SubprocessError, OSError) as exc:
            return {"rc": "wrapper-failed", "wall": None, "maxrss_kb": None, "error": str(exc)}


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def failure(res, accept=(0,), need_output=False):
    """Why a run does not count (None when it does)."""
    err = res.get("stderr") or ""
    if "not implemented" in err:
        return "not implemented"
    if res.get("rc") not in accept:
        lines = [l.strip() for l in err.strip().splitlines()
                 if l.strip() and not l.strip().startswith("fix:")]
        detail = lines[-1] if lines else f"exit {res.get('rc')}"
        if res.get("rc") == "timeout":
            detail = "timed out"
        return f"exit {res.get('rc')}: {detail[:160]}"
    if "internal error" in err:
        return "internal error: " + err.strip().splitlines()[0][:160]
    if need_output and not (res.get("stdout") or "").strip():
        return "no output"
    return None


def cold(runner, argv_for, env, repeat, before=None, stdin_text=None, accept=(0,),
         need_output=False, warmup=True, first_k=0):
    """Cold measurement: one untimed warm-up, then `repeat` new processes; median and p90.
    Runs are numbered from first_k (argv_for and before see the number)."""
    if argv_for(first_k) is None:
        return {"status": "n/a", "reason": "no such verb"}
    walls, rss, last = [], [], None
    for k in range(first_k, first_k + repeat + (1 if warmup else 0)):
        if before:
            before(k)
        res = runner.run(argv_for(k), env, stdin_text=stdin_text)
        why = failure(res, accept, need_output)
        if why:
            return {"status": "n/a", "reason": why}
        last = res
        if warmup and k == first_k:
            continue
        walls.append(res["wall"])
        if res.get("maxrss_kb"):
            rss.append(res["maxrss_kb"])
    return dict(sample_stats(walls), status="ok",
                rss_mb=round(max(rss) / 1024, 1) if rss else None, rc=last.get("rc"),
                stdout=last.get("stdout", ""), stderr=last.get("stderr", ""))


def sample_stats(walls):
    return {"median": statistics.median(walls), "p90": percentile(walls, 90), "min": min(walls),
            "n": len(walls), "samples": [round(w, 5) for w in walls]}


def merge_rounds(results):
    """One result from a cold case measured one run per round: the samples pooled, the
    largest peak, the rest (rc, output, notes) from the last round; n/a if any round was."""
    for res in results:
        if res.get("status") != "ok":
            return res
    merged = dict(results[-1])
    merged.update(sample_stats([w for res in results for w in res["samples"]]))
    peaks = [res["rss_mb"] for res in results if res.get("rss_mb")]
    merged["rss_mb"] = max(peaks) if peaks else None
    return merged


# ==========================================================================================
# MCP client (warm calls)
# ==========================================================================================

class McpSession:
    """A minimal stdio MCP client: one request at a time, answers matched by id."""

    def __init__(self, argv, env, errfile):
        self.err = open(errfile, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, env=env)
        self.answers = queue.Queue()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and "id" in msg and ("result" in msg or "error" in msg):
                self.answers.put(msg)
        self.answers.put(None)

    def request(self, method, params=None, timeout=600):
        self.next_id += 1
        rid = self.next_id
        msg = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        t0 = time.perf_counter()
        self.proc.stdin.write((json.dumps(msg) + "\n").encode("utf-8"))
        self.proc.stdin.flush()
        deadline = t0 + timeout
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"{method}: no answer in {timeout} s")
            ans = self.answers.get(timeout=left)
            if ans is None:
                raise EOFError(f"{method}: the server exited")
            if ans.get("id") == rid:
                return ans, time.perf_counter() - t0

    def notify(self, method):
        self.proc.stdin.write((json.dumps({"jsonrpc": "2.0", "method": method}) + "\n").encode())
        self.proc.stdin.flush()

    def initialize(self):
        ans, _ = self.request("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                             "clientInfo": {"name": "memshelf-bench",
                                                            "version": "1"}}, timeout=120)
        self.notify("notifications/initialized")
        return ans

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def tool_failure(ans):
    if "error" in ans:
        err = ans["error"]
        return f"JSON-RPC error {err.get('code')}: {str(err.get('message'))[:160]}"
    res = ans.get("result") or {}
    if res.get("isError"):
        text = " ".join(c.get("text", "") for c in res.get("content", []) if isinstance(c, dict))
        return "tool error: " + text.strip()[:160]
    return None


def tool_text(ans):
    res = ans.get("result") or {}
    return "".join(c.get("text", "") for c in res.get("content", []) if isinstance(c, dict))


# ==========================================================================================
# Shelves: generate once, copy per implementation
# ==========================================================================================

def shelf_key(n, seed, raw_kb, fmt, git):
    return f"n{n}-s{seed}-r{raw_kb:g}-{fmt}" + ("-git" if git else "")


def ensure_shelf(n, seed, raw_kb, fmt, git, code_dir):
    """The cached base shelf for these parameters; regenerated when the generator changed,
    re-rendered (derived files) when memshelf.py changed."""
    base = os.path.join(CACHE, "shelves", shelf_key(n, seed, raw_kb, fmt, git))
    shelf, queries = os.path.join(base, "shelf"), os.path.join(base, "queries.tsv")
    stamp_path = os.path.join(base, "stamp.json")
    want = {"n": n, "seed": seed, "raw_kb": raw_kb, "format": fmt, "git": git,
            "generator": _file_hash(os.path.join(HERE, "gen_shelf.py"))}
    try:
        stamp = json.load(open(stamp_path))
    except (OSError, ValueError):
        stamp = {}
    code_hash = _file_hash(os.path.join(code_dir, "memshelf.py"))
    if stamp.get("params") != want or not os.path.isdir(shelf) or not os.path.exists(queries):
        log(f"bench: generating {n:,} episodes into {base} ...")
        summary = gen_shelf.generate(shelf, n=n, seed=seed, raw_kb=raw_kb, git=git, fmt=fmt,
                                     queries_path=queries, python=PYTHON, code_dir=code_dir,
                                     force=True, log=log)
        log(f"bench: generated in {summary['seconds']['total']} s")
        stamp = {"params": want, "summary": summary, "rendered_by": code_hash}
        json.dump(stamp, open(stamp_path, "w"), indent=2)
    elif stamp.get("rendered_by") != code_hash:
        log("bench: memshelf.py changed; re-rendering the cached shelf's derived files")
        proc = subprocess.run([PYTHON, os.path.join(code_dir, "memshelf.py"), "rebuild",
                               "--shelf", shelf, "--quiet"], env=clean_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        shutil.rmtree(os.path.join(shelf, ".memshelf"), ignore_errors=True)
        if proc.returncode != 0:  # keep the old render; try again on the next run
            log("bench: rebuild failed, derived files left as they were: "
                + proc.stderr.strip()[:200])
            return shelf, queries, stamp.get("summary", {})
        if git:
            st = subprocess.run(["git", "status", "--porcelain"], cwd=shelf, env=clean_env(),
                                stdout=subprocess.PIPE, text=True).stdout
            if st.strip():
                gen_shelf.git_commit_all(shelf, "bench: re-render derived files")
        stamp["rendered_by"] = code_hash
        json.dump(stamp, open(stamp_path, "w"), indent=2)
    return shelf, queries, stamp.get("summary", {})


def work_copy(base_shelf, impl, key):
    """A fresh copy for one implementation (its writes never touch the cached shelf)."""
    dest = os.path.join(CACHE, "work", f"{impl.key}-{key}", "shelf")
    if os.path.exists(os.path.dirname(dest)):
        shutil.rmtree(os.path.dirname(dest))
    shutil.copytree(base_shelf, dest, symlinks=True, ignore=shutil.ignore_patterns(".memshelf"))
    hooks = os.path.join(dest, ".git", "hooks")
    if os.path.isdir(hooks):
        for name in os.listdir(hooks):
            path = os.path.join(hooks, name)
            if "installed by memshelf" in _read(path):
                os.remove(path)  # 0.4.0 installs no hooks; ours must not run on its commits
        if not impl.ref:
            # the hooks memshelf's init writes, for this copy and the code and interpreter
            # under test (the cached shelf's hooks name whatever generated it)
            subprocess.run([impl.console[0], "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "import memshelf; memshelf._install_git_hooks(memshelf._Git(sys.argv[2]))",
                            impl.code_dir, dest], check=True, env=clean_env({}))
    # a copy's ctimes are now, and no call can age them: wait out the racy window (two seconds,
    # docs/architecture.md § The store), as a real shelf ages between the sessions that read it
    time.sleep(2.1)
    return dest


def read_queries(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            q, expected, label = line.split("\t")
            rows.append((q, expected, label))
    return rows


def pick_episode(shelf):
    topics = sorted(n[:-3] for n in os.listdir(os.path.join(shelf, "docs", "topics"))
                    if n.endswith(".md"))
    return topics[len(topics) // 2]


def section_text(shelf, episode, section):
    """`## <section>` + its stripped body, read straight from the episode file."""
    text = _read(os.path.join(shelf, "docs", "topics", episode + ".md"))
    lines, out, on = text.split("\n"), [], False
    for line in lines:
        if line.startswith("## "):
            if on:
                break
            on = line[3:].strip().lower() == section.lower()
            continue
        if on:
            out.append(line)
    return f"## {section}\n" + "\n".join(out).strip()


def shelf_facts(shelf):
    total, count = 0, 0
    for cat in ("topics", "research", "sessions"):
        d = os.path.join(shelf, "docs", cat)
        for n in os.listdir(d):
            if n.endswith(".md"):
                count += 1
                total += os.path.getsize(os.path.join(d, n))
    return {"episodes": count, "episode_mb": round(total / 1e6, 1)}


# ==========================================================================================
# Cases
# ==========================================================================================

class Bench:
    def __init__(self, args, impls, runner):
        self.args, self.impls, self.runner = args, impls, runner
        self.selected = set(args.cases)
        self.round = None   # (round, rounds) while a cold case runs one run per round

    def repeat_for(self, case, n):
        if case in HEAVY and n >= 100000 and not self.args.repeat_explicit:
            return min(self.args.repeat, 3)
        return self.args.repeat

    def run_size(self, n):
        a = self.args
        base, qpath, summary = ensure_shelf(n, a.seed, a.raw_kb, a.format, not a.plain,
                                            a.code)
        queries = read_queries(qpath)
        facts = shelf_facts(base)
        facts.update(seed=a.seed, raw_kb=a.raw_kb, format=a.format,
                     storage="plain" if a.plain else "git-local")
        episode = pick_episode(base)
        keyword_qs = [q for q, _, label in queries if label == "keyword"] or ["cache"]
        out = {"shelf": facts, "cases": {}, "tokens": {}, "retrieval": {}, "questions": {}}
        ctxs = []
        for impl in self.impls:
            log(f"bench: {n:,} episodes, {impl.label}: copying the shelf ...")
            shelf = work_copy(base, impl, shelf_key(n, a.seed, a.raw_kb, a.format, not a.plain))
            ctxs.append({"n": n, "shelf": shelf, "episode": episode, "queries": queries,
                         "keyword_qs": keyword_qs, "impl": impl})
        # case by case, each implementation in turn; a cold case alternates the
        # implementations run by run (ours, 0.4.0, ours, ...): a machine whose speed drifts
        # over the seconds of a case slows both alike, and no ratio is skewed by it
        for case in CASE_NAMES:
            if case not in self.selected or case in ("tokens", "retrieval", "questions"):
                continue
            rounds = self.repeat_for(case, n) if case in CASE_GROUPS["cold"] else 1
            spent = {ctx["impl"].key: 0.0 for ctx in ctxs}   # seconds each implementation took
            results = {ctx["impl"].key: [] for ctx in ctxs}
            for r in range(rounds):
                self.round = (r, rounds) if case in CASE_GROUPS["cold"] else None
                for ctx in ctxs:
                    got = results[ctx["impl"].key]
                    if got and got[-1].get("status") != "ok":
                        continue   # n/a once is n/a
                    t0 = time.perf_counter()
                    try:
                        got.append(getattr(self, "case_" + case.replace("-", "_"))(ctx))
                    except Exception as exc:  # a harness must report, never crash
                        got.append({"status": "n/a",
                                    "reason": f"harness: {type(exc).__name__}: {exc}"})
                    spent[ctx["impl"].key] += time.perf_counter() - t0
            self.round = None
            for ctx in ctxs:
                impl = ctx["impl"]
                res = merge_rounds(results[impl.key])
                log(f"bench: {n:,} {impl.key}: {case}: "
                    + (fmt_s(res.get("median")) if res["status"] == "ok"
                       else "n/a (" + str(res.get("reason")) + ")")
                    + f"  [{spent[impl.key]:.1f} s]")
                out["cases"].setdefault(case, {})[impl.key] = res
        for ctx in ctxs:
            impl, shelf = ctx["impl"], ctx["shelf"]
            if "retrieval" in self.selected:
                log(f"bench: {n:,} {impl.key}: retrieval")
                out["retrieval"][impl.key] = self.retrieval(ctx)
            if "questions" in self.selected and not impl.ref:
                log(f"bench: {n:,} {impl.key}: questions")
                out["questions"][impl.key] = self.questions(impl)
            if "tokens" in self.selected:
                log(f"bench: {n:,} {impl.key}: tokens")
                out["tokens"][impl.key] = self.token_economy(ctx, out["cases"])
            if not a.keep_work:
                shutil.rmtree(os.path.dirname(shelf), ignore_errors=True)
        for res in out["cases"].values():
            for r in res.values():
                r.pop("stdout", None)
                r.pop("stderr", None)
        out["floors"] = floors(out["cases"])
        return out

    # --- cold CLI cases --------------------------------------------------------------------

    def _cold(self, ctx, case, verb, before=None, **kw):
        impl, shelf = ctx["impl"], ctx["shelf"]
        return self.cold(ctx, case, lambda k: impl.argv(verb, shelf, **kw), before=before,
                         **self._opts(case))

    def cold(self, ctx, case, argv_for, **kw):
        warmup = not self.args.smoke
        if self.round is None:
            return cold(self.runner, argv_for, ctx["impl"].env(), self.repeat_for(case, ctx["n"]),
                        warmup=warmup, **kw)
        r = self.round[0]   # one timed run per round, the warm-up before the first
        return cold(self.runner, argv_for, ctx["impl"].env(), 1, warmup=warmup and r == 0,
                    first_k=r + (1 if warmup and r else 0), **kw)

    @staticmethod
    def _opts(case):
        if case in ("doctor-empty", "doctor-warm", "rebuild-check"):
            return {"accept": (0, 1)}
        return {}

    def _drop_cache(self, ctx):
        return lambda k: shutil.rmtree(os.path.join(ctx["shelf"], ".memshelf"), ignore_errors=True)

    def case_version(self, ctx):
        res = self._cold(ctx, "version", "version")
        if res["status"] == "ok":
            ctx["impl"].version = res["stdout"].strip()
        return res

    def case_index(self, ctx):
        return self._cold(ctx, "index", "index")

    def case_interpreter_floor(self, ctx):
        impl = ctx["impl"]
        if impl.ref:
            return {"status": "n/a", "reason": "a property of the interpreter and the machine"}
        return self.cold(ctx, "interpreter-floor", lambda k: [impl.console[0], "-c", "pass"])

    def case_index_script(self, ctx):
        return self._cold(ctx, "index-script", "index-script")

    def case_index_floor(self, ctx):
        impl, shelf = ctx["impl"], ctx["shelf"]
        if impl.ref:
            return {"status": "n/a", "reason": "a property of the shelf and the machine"}
        return self.cold(ctx, "index-floor", lambda k: [impl.console[0], "-c", FLOOR, shelf])

    def case_index_script_floor(self, ctx):
        impl, shelf = ctx["impl"], ctx["shelf"]
        if impl.ref:
            return {"status": "n/a", "reason": "a property of the shelf, the code and the machine"}
        return self.cold(ctx, "index-script-floor", lambda k: [
            impl.console[0], "-c", COMPILE + FLOOR, shelf, os.path.join(impl.code_dir,
                                                                       "memshelf.py")])

    def case_recall_section(self, ctx):
        return self._cold(ctx, "recall-section", "recall", episode=ctx["episode"],
                          section="Decisions")

    def case_recall_script(self, ctx):
        return self._cold(ctx, "recall-script", "recall-script", episode=ctx["episode"],
                          section="Decisions")

    def case_stats(self, ctx):
        return self._cold(ctx, "stats", "stats")

    def case_hook_session_start(self, ctx):
        impl, shelf = ctx["impl"], ctx["shelf"]
        res = self.cold(ctx, "hook-session-start",
                        lambda k: impl.argv("hook-session-start", shelf),
                        stdin_text=HOOK_STDIN, need_output=True)
        if res["status"] == "ok":
            ctx["hook_payload"] = res["stdout"]
        return res

    def case_rebuild_empty(self, ctx):
        return self._cold(ctx, "rebuild-empty", "rebuild", before=self._drop_cache(ctx))

    def case_rebuild_warm(self, ctx):
        return self._cold(ctx, "rebuild-warm", "rebuild")

    def case_rebuild_check(self, ctx):
        res = self._cold(ctx, "rebuild-check", "rebuild-check")
        if res.get("rc") == 1:
            res["note"] = "drift reported"
        return res

    def case_doctor_empty(self, ctx):
        return self._doctor(ctx, "doctor-empty", self._drop_cache(ctx))

    def case_doctor_warm(self, ctx):
        return self._doctor(ctx, "doctor-warm", None)

    def _doctor(self, ctx, case, before):
        res = self._cold(ctx, case, "doctor", before=before)
        if res.get("rc") == 1:
            res["note"] = "doctor reported errors"
        return res

    def case_search_build(self, ctx):
        if ctx["impl"].ref:
            return {"status": "n/a", "reason": "0.4.0 keeps no search index"}
        return self._cold(ctx, "search-build", "search", before=self._drop_cache(ctx),
                          query=ctx["keyword_qs"][0])

    def case_search(self, ctx):
        return self._cold(ctx, "search", "search", query=ctx["keyword_qs"][0])

    def _shelve(self, ctx, case, mode, verb="shelve"):
        impl, shelf = ctx["impl"], ctx["shelf"]
        cfg = os.path.join(shelf, "memshelf.json")
        want = json.dumps({"derived": mode}, indent=2) + "\n"
        # written only when the mode changes: a settings file is in the store key, and a shelf
        # whose settings are rewritten before every shelve never keeps its render memo
        if not impl.ref and _read(cfg) != want:
            with open(cfg, "w") as f:
                f.write(want)
        tag = {"shelve-auto": "a", "shelve-bot": "b"}.get(case, "s")

        def argv(k):
            return impl.argv(verb, shelf, slug=f"2026-01-15-bench-{tag}-{impl.key}-{k}",
                             digest=SHELVE_DIGEST.format(k=k))
        res = self.cold(ctx, case, argv)
        if res["status"] == "ok":
            res["note"] = "episode-only commit" if impl.ref else f"derived: {mode}"
        return res

    def case_shelve_auto(self, ctx):
        return self._shelve(ctx, "shelve-auto", "auto")

    def case_shelve_bot(self, ctx):
        return self._shelve(ctx, "shelve-bot", "bot")

    def case_shelve_script(self, ctx):
        return self._shelve(ctx, "shelve-script", "auto", "shelve-script")

    def case_shelve_floor(self, ctx):
        impl, shelf = ctx["impl"], ctx["shelf"]
        if impl.ref:
            return {"status": "n/a", "reason": "a property of the shelf, git and the machine"}
        res = self.cold(ctx, "shelve-floor", lambda k: [impl.console[0], "-c", SHELVE_FLOOR,
                                                          shelf, str(k)])
        # its derived files are only a line longer: render and commit them for the cases after
        subprocess.run(impl.argv("rebuild", shelf) + ["--commit"], env=impl.env(),
                       capture_output=True, timeout=RUN_TIMEOUT)
        return res

    # --- in-process and MCP cases ----------------------------------------------------------

    def case_search_incremental(self, ctx):
        impl = ctx["impl"]
        if impl.ref:
            return {"status": "n/a", "reason": "0.4.0 keeps no search index"}
        code = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import memshelf
root, query, repeat = sys.argv[2], sys.argv[3], int(sys.argv[4])
memshelf.search(shelf_path=root, query=query)
times = []
for k in range(repeat):
    slug = "2026-01-20-bench-incremental-%d" % k
    with open(os.path.join(root, "docs", "topics", slug + ".md"), "w", encoding="utf-8") as f:
        f.write("# %s\n\n---\nid: %s\nkind: topic\nspan: 2026-01-20\ndate: 2026-01-20\n"
                "tags: [bench]\napprox_tokens: 0\napprox_tokens_source: unmeasured\nmode: live\n"
                "---\n\n## Digest\nBench Runner added episode %d for the incremental case.\n\n"
                "## Decisions\n- Keep it small.\n" % (slug, slug, k))
    t0 = time.perf_counter()
    memshelf.search(shelf_path=root, query=query)
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
'''
        argv = [PYTHON, "-c", code, self.args.code, ctx["shelf"], ctx["keyword_qs"][0],
                str(max(self.args.repeat, 3))]
        res = self.runner.run(argv, impl.env())
        why = failure(res)
        if why:
            return {"status": "n/a", "reason": why}
        try:
            times = json.loads(res["stdout"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"status": "n/a", "reason": "no timings: " + res["stdout"][-160:]}
        return {"status": "ok", "median": statistics.median(times), "p90": percentile(times, 90),
                "min": min(times), "n": len(times), "samples": [round(t, 5) for t in times],
                "rss_mb": round(res["maxrss_kb"] / 1024, 1) if res.get("maxrss_kb") else None,
                "note": "warm process"}

    def case_mcp_initialize(self, ctx):
        impl = ctx["impl"]
        if not impl.server:
            return {"status": "n/a", "reason": "no MCP server"}
        walls, rss, idle, resp = [], [], [], ""
        warm = 0 if self.args.smoke else 1
        for k in range(self.args.repeat + warm):
            res = self.runner.mcp_initialize(impl.server, impl.env(ctx["shelf"]))
            if res.get("rc") != 0 or res.get("wall") is None:
                lines = [l for l in (res.get("stderr") or "").splitlines() if l.strip()]
                return {"status": "n/a", "reason": f"{res.get('rc')}: "
                        + (lines[-1][:160] if lines else "no answer")}
            resp = res.get("stdout", "")
            if k < warm:
                continue
            walls.append(res["wall"])
            if res.get("maxrss_kb"):
                rss.append(res["maxrss_kb"])
            if res.get("idle_rss_kb"):
                idle.append(res["idle_rss_kb"])
        try:
            ctx["instructions"] = json.loads(resp)["result"].get("instructions", "")
        except (ValueError, KeyError, TypeError):
            pass
        return {"status": "ok", "median": statistics.median(walls),
                "p90": percentile(walls, 90), "min": min(walls), "n": len(walls),
                "samples": [round(w, 5) for w in walls],
                "rss_mb": round(max(rss) / 1024, 1) if rss else None,
                "idle_rss_mb": round(statistics.median(idle) / 1024, 1) if idle else None}

    def _mcp_warm(self, ctx, tool, args_for):
        impl = ctx["impl"]
        if not impl.server:
            return {"status": "n/a", "reason": "no MCP server"}
        calls = 5 if self.args.smoke else max(10, self.args.repeat * 3)
        session = McpSession(impl.server, impl.env(ctx["shelf"]),
                             os.path.join(self.runner.tmp, "mcp-err.txt"))
        try:
            ans = session.initialize()
            if "result" not in ans:
                return {"status": "n/a", "reason": "initialize failed"}
            times = []
            for k in range(calls + 1):
                ans, secs = session.request("tools/call", {"name": tool,
                                                           "arguments": args_for(k)})
                why = tool_failure(ans)
                if why:
                    return {"status": "n/a", "reason": why}
                if k:
                    times.append(secs)
            return {"status": "ok", "median": statistics.median(times),
                    "p90": percentile(times, 90), "p95": percentile(times, 95),
                    "min": min(times), "n": len(times), "samples": [round(t, 5) for t in times],
                    "note": "p50 / p95"}
        except (OSError, EOFError, TimeoutError, queue.Empty) as exc:
            return {"status": "n/a", "reason": f"{type(exc).__name__}: {exc}"}
        finally:
            session.close()

    def case_mcp_recall(self, ctx):
        impl = ctx["impl"]
        return self._mcp_warm(ctx, "memshelf_recall", lambda k: impl.tool_args(
            ctx["shelf"], episode_id=ctx["episode"], section="Decisions"))

    def case_mcp_search(self, ctx):
        impl, qs = ctx["impl"], ctx["keyword_qs"]
        return self._mcp_warm(ctx, "memshelf_search", lambda k: impl.tool_args(
            ctx["shelf"], query=qs[k % len(qs)]))

    # --- retrieval -------------------------------------------------------------------------

    def retrieval(self, ctx):
        impl, shelf = ctx["impl"], ctx["shelf"]
        per_label, limit = {}, self.args.retrieval_queries
        for q, expected, label in ctx["queries"]:
            bucket = per_label.setdefault(label, [])
            if len(bucket) < limit:
                bucket.append((q, expected))
        if impl.ref:
            ranked = self._ranked_cli(impl, shelf, per_label)
        else:
            ranked = self._ranked_in_process(impl, shelf, per_label)
        if isinstance(ranked, str):
            return {"status": "n/a", "reason": ranked}
        out = {}
        for label, items in per_label.items():
            hits, rr = 0, 0.0
            for (q, expected), ids in zip(items, ranked[label]):
                if expected in ids:
                    rank = ids.index(expected) + 1
                    rr += 1.0 / rank
                    hits += rank <= 5
            out[label] = {"n": len(items), "hit@5": round(hits / len(items), 3),
                          "mrr": round(rr / len(items), 3)}
        return {"status": "ok", "labels": out,
                "method": "CLI per query" if impl.ref else "memshelf.search() in one process"}

    def questions(self, impl):
        """`search-bench` of bench/questions.tsv (section level: `id § Section`) on the shelf
        bench/design_docs.py builds; the same at every size (a small shelf of its own)."""
        work = tempfile.mkdtemp(prefix="memshelf-questions-")   # outside this repository
        shelf = os.path.join(work, "shelf")
        here = os.path.dirname(os.path.abspath(__file__))
        code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import design_docs,"
                " memshelf; root = design_docs.build(sys.argv[3], sys.argv[1]); print(json.dumps("
                "memshelf.search_bench(root, sys.argv[4], k=5)))")
        res = self.runner.run([PYTHON, "-c", code, self.args.code, here, shelf,
                               os.path.join(here, "questions.tsv")], impl.env())
        shutil.rmtree(work, ignore_errors=True)
        why = failure(res)
        if why:
            return {"status": "n/a", "reason": why}
        (lexical,) = json.loads(res["stdout"].strip().splitlines()[-1])["modes"]
        return {"status": "ok", "engine": lexical["engine"], "labels": {
            lb: {"n": v["queries"], "hit@1": v["hit_at_1"], "hit@5": v["hit_at_k"],
                 "mrr": v["mrr"]} for lb, v in lexical["labels"].items()}}

    def _ranked_cli(self, impl, shelf, per_label):
        ranked, env = {}, impl.env()
        for label, items in per_label.items():
            ranked[label] = []
            for q, _ in items:
                res = self.runner.run(impl.argv("search", shelf, query=q, max_results=10,
                                                json=True), env)
                why = failure(res)
                if why:
                    return why
                ids = self._hit_ids(impl, res["stdout"])
                if ids is None:
                    return "unreadable search output"
                ranked[label].append(ids)
        return ranked

    def _ranked_in_process(self, impl, shelf, per_label):
        """The same ranking as the CLI, without a process per query."""
        code = r'''
import json, os, sys
sys.path.insert(0, sys.argv[1])
import memshelf
root, per_label = sys.argv[2], json.load(open(sys.argv[3], encoding="utf-8"))
out = {}
for label, items in per_label.items():
    out[label] = []
    for q, _ in items:
        res = memshelf.search(shelf_path=root, query=q, max_results=10)
        out[label].append([h.get("id") or os.path.basename(h.get("address", ""))[:-3]
                           for h in res.get("hits", [])])
print(json.dumps(out))
'''
        qfile = os.path.join(self.runner.tmp, "retrieval.json")
        with open(qfile, "w", encoding="utf-8") as f:
            json.dump(per_label, f, ensure_ascii=False)
        res = self.runner.run([PYTHON, "-c", code, self.args.code, shelf, qfile], impl.env())
        why = failure(res)
        if why:
            return why
        try:
            raw = json.loads(res["stdout"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            return "unreadable search output"
        ranked = {}
        for label, lists in raw.items():
            ranked[label] = []
            for ids in lists:
                seen, ordered = set(), []
                for i in ids:  # episode level: the first hit of an episode counts
                    if i not in seen:
                        seen.add(i)
                        ordered.append(i)
                ranked[label].append(ordered)
        return ranked

    @staticmethod
    def _hit_ids(impl, stdout):
        ids = []
        if impl.ref:  # one `<address>\t<score>\t<snippet>` line per hit
            for line in stdout.splitlines():
                addr = line.split("\t", 1)[0].strip()
                if addr.endswith(".md"):
                    ids.append(os.path.basename(addr)[:-3])
        else:
            try:
                data = json.loads(stdout)
            except ValueError:
                return None
            for hit in data.get("hits", []):
                ident = hit.get("id") or os.path.basename(hit.get("address", ""))[:-3]
                ids.append(ident)
        seen, ordered = set(), []
        for i in ids:  # episode level: the first hit of an episode counts
            if i not in seen:
                seen.add(i)
                ordered.append(i)
        return ordered

    # --- token economy ---------------------------------------------------------------------

    def token_economy(self, ctx, cases):
        impl, shelf, env = ctx["impl"], ctx["shelf"], ctx["impl"].env()
        t = {}
        if impl.ref:  # 0.4.0's own render, after its rebuild cases (docshelf format)
            self.runner.run(impl.argv("rebuild", shelf), env)
            t["index_docshelf"] = index_cost(_read(os.path.join(shelf, "INDEX.md")))
        else:
            for fmt in ("docshelf", "compact"):  # compact last: the copy ends as it began
                res = self.runner.run(impl.argv("index-format", shelf, format=fmt), env)
                why = failure(res)
                t["index_" + fmt] = ({"status": "n/a", "reason": why} if why else
                                     index_cost(_read(os.path.join(shelf, "INDEX.md"))))
            c, d = t["index_compact"], t["index_docshelf"]
            if c.get("per_entry") and d.get("per_entry"):
                t["compact_vs_docshelf"] = round(c["per_entry"] / d["per_entry"], 3)
        # envelope: recalled text minus the section itself
        section = section_text(shelf, ctx["episode"], "Decisions")
        res = self.runner.run(impl.argv("recall", shelf, episode=ctx["episode"],
                                        section="Decisions"), env)
        if not failure(res, need_output=True):
            recalled = res["stdout"].rstrip("\n")
            t["section_tokens"] = tokens(section)
            t["recalled_tokens"] = tokens(recalled)
            t["envelope_overhead"] = tokens(recalled) - tokens(section)
        if ctx.get("hook_payload") is None and not impl.ref:
            res = self.runner.run(impl.argv("hook-session-start", shelf), env,
                                  stdin_text=HOOK_STDIN)
            if not failure(res, need_output=True):
                ctx["hook_payload"] = res["stdout"]
        if ctx.get("hook_payload"):
            t["session_start_chars"] = len(ctx["hook_payload"])
            if "recalled_tokens" in t:
                t["recall_cost_per_question"] = tokens(ctx["hook_payload"]) + t["recalled_tokens"]
        if ctx.get("instructions") is not None:
            t["instructions_chars"] = len(ctx["instructions"])
        res = self.runner.run(impl.argv("stats", shelf) + ([] if impl.ref else ["--json"]), env)
        if not failure(res):
            try:
                st = json.loads(res["stdout"])
                eps = st.get("episodes") or 0
                t["standing_cost"] = st.get("standing_cost")
                t["standing_cost_per_episode"] = (round(st["standing_cost"] / eps, 1)
                                                  if eps and st.get("standing_cost") else None)
                t["compression_ratio"] = st.get("compression_ratio")
            except (ValueError, TypeError, KeyError):
                pass
        if impl.server:
            t.update(self._mcp_sizes(impl, shelf))
        return t

    def _mcp_sizes(self, impl, shelf):
        out = {}
        session = McpSession(impl.server, impl.env(shelf),
                             os.path.join(self.runner.tmp, "mcp-err.txt"))
        try:
            init = session.initialize()
            out["instructions_chars"] = len((init.get("result") or {}).get("instructions") or "")
            ans, _ = session.request("tools/list", {})
            tools = (ans.get("result") or {}).get("tools", [])
            out["tools"] = len(tools)
            out["tools_list_chars"] = len(json.dumps(tools, separators=(",", ":"),
                                                     ensure_ascii=False))
            ans, _ = session.request("tools/call", {"name": "memshelf_index",
                                                    "arguments": impl.tool_args(shelf)})
            if not tool_failure(ans):
                out["index_tool_default_chars"] = len(tool_text(ans))
        except (OSError, EOFError, TimeoutError, queue.Empty) as exc:
            out["mcp_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            session.close()
        return out


def index_cost(text):
    """INDEX cost: base = header, preamble, headings and footer; per entry = (tokens - base) / entries."""
    lines = text.split("\n")
    entries = [l for l in lines if l.startswith("- ")]
    if not entries:
        return {"status": "n/a", "reason": "no entries"}
    base = (len(text) - sum(len(l) + 1 for l in entries)) // 4
    return {"chars": len(text), "tokens": tokens(text), "entries": len(entries),
            "base_tokens": base, "per_entry": round((tokens(text) - base) / len(entries), 2)}


# ==========================================================================================
# Targets, tables, files
# ==========================================================================================

def floors(cases):
    """{case: {floor, floor_s, ratio, above_s}} for every cold case of ours whose floor cases
    ran: the floor's name (its parts joined by " + "), its median in seconds, ours / floor and
    ours − floor (FLOORS_OF)."""
    def median(name):
        res = cases.get(name, {}).get("ours") or {}
        return res.get("median") if res.get("status") == "ok" else None

    def part(name):
        if name not in FLOOR_PARTS:
            return median(name)
        whole, less = (median(n) for n in FLOOR_PARTS[name])
        return None if whole is None or less is None else max(whole - less, 0.0)
    out = {}
    for case, parts in FLOORS_OF.items():
        ours, got = median(case), [part(p) for p in parts]
        if ours is None or not ours or any(g is None for g in got):
            continue
        floor = sum(got)
        out[case] = {"floor": " + ".join(parts), "floor_s": round(floor, 5),
                     "ratio": round(ours / floor, 3) if floor else None,
                     "above_s": round(ours - floor, 5)}
    return out


def load_targets():
    with open(TARGETS, encoding="utf-8") as f:
        return json.load(f)


def case_value(res, metric):
    if not res or res.get("status") != "ok":
        return None
    return res.get({"median": "median", "p50": "median", "p95": "p95", "p90": "p90"}[metric])


def evaluate(results, targets):
    """Every target against the measurements: list of {what, size, value, limit, ok}."""
    verdicts = []
    for size, data in results["sizes"].items():
        cases = data["cases"]
        for name, tgt in targets["cases"].items():
            if name not in cases:
                continue
            limit = tgt.get("limit", {}).get(size)
            ours = cases[name].get("ours")
            value = case_value(ours, tgt.get("metric", "median"))
            if limit is not None:
                verdicts.append({"what": name, "size": size, "value": value, "limit": limit,
                                 "unit": "s", "ok": value is not None and value <= limit})
            ratio_min = tgt.get("ref_ratio_min")
            ref_val = case_value(cases[name].get("ref"), tgt.get("metric", "median"))
            if ratio_min and size == targets.get("ratio_size", "10000") and ref_val and value:
                r = ref_val / value
                verdicts.append({"what": name + " vs 0.4.0", "size": size, "value": round(r, 2),
                                 "limit": ratio_min, "unit": "x", "ok": r >= ratio_min,
                                 "higher_is_better": True})
        fl = data.get("floors") or floors(cases)
        for name, spec in targets.get("floors", {}).items():
            if name not in cases or (spec.get("size") and spec["size"] != size):
                continue
            got = fl.get(name)
            if "ratio_max" in spec:
                v = round(got["ratio"], 2) if got else None
                verdicts.append({"what": f"{name} / its floor ({FLOORS_OF[name][0]})",
                                 "size": size, "value": v, "limit": spec["ratio_max"],
                                 "unit": "x", "ok": v is not None and v <= spec["ratio_max"]})
            if "above_max" in spec:
                v = got["above_s"] if got else None
                verdicts.append({"what": f"{name} above its floor ({got['floor'] if got else 'n/a'})",
                                 "size": size, "value": v, "limit": spec["above_max"],
                                 "unit": "s", "ok": v is not None and v <= spec["above_max"]})
        mem = targets.get("memory", {})
        every_limit = mem.get("every_process_mb", {}).get(size)
        if every_limit:
            peaks = {c: r["ours"].get("rss_mb") for c, r in cases.items()
                     if r.get("ours", {}).get("status") == "ok"
                     and r["ours"].get("rss_mb") is not None}
            if peaks:
                worst = max(peaks, key=peaks.get)
                verdicts.append({"what": f"every process's peak (largest: {worst})",
                                 "size": size, "value": peaks[worst], "limit": every_limit,
                                 "unit": "MB", "ok": peaks[worst] <= every_limit})
        peak_limit = mem.get("peak_mb", {}).get(size)
        peaks = [cases[c]["ours"].get("rss_mb") for c in mem.get("peak_cases", [])
                 if c in cases and cases[c].get("ours", {}).get("status") == "ok"]
        if peak_limit and peaks and all(p is not None for p in peaks):
            verdicts.append({"what": "peak memory", "size": size, "value": max(peaks),
                             "limit": peak_limit, "unit": "MB", "ok": max(peaks) <= peak_limit})
        init = cases.get("mcp-initialize", {}).get("ours")
        if init and mem.get("server_idle_mb"):
            v = init.get("idle_rss_mb") if init.get("status") == "ok" else None
            verdicts.append({"what": "server idle memory", "size": size, "value": v,
                             "limit": mem["server_idle_mb"], "unit": "MB",
                             "ok": v is not None and v <= mem["server_idle_mb"]})
        tok = data.get("tokens", {}).get("ours")
        if tok:
            for key, spec in targets.get("tokens", {}).items():
                if spec.get("size") and spec["size"] != size:
                    continue
                v = _token_value(tok, key)
                if "max" in spec:
                    verdicts.append({"what": key, "size": size, "value": v, "limit": spec["max"],
                                     "unit": spec.get("unit", ""),
                                     "ok": v is not None and v <= spec["max"]})
            ref_tok = data.get("tokens", {}).get("ref")
            if ref_tok and tok.get("compression_ratio") and ref_tok.get("compression_ratio"):
                verdicts.append({"what": "compression ratio vs 0.4.0", "size": size,
                                 "value": tok["compression_ratio"],
                                 "limit": ref_tok["compression_ratio"], "unit": ":1",
                                 "ok": tok["compression_ratio"] > ref_tok["compression_ratio"],
                                 "higher_is_better": True})
        ret = data.get("retrieval") or {}
        ours = ret.get("ours", {})
        for label, floor in targets.get("retrieval", {}).get("hit_at_5_min", {}).items():
            if not ours:
                break
            v = (ours.get("labels", {}).get(label) or {}).get("hit@5") \
                if ours.get("status") == "ok" else None
            verdicts.append({"what": f"hit@5 {label}", "size": size, "value": v, "limit": floor,
                             "unit": "", "ok": v is not None and v >= floor,
                             "higher_is_better": True})
        ref = ret.get("ref", {})
        if ours.get("status") == "ok" and ref.get("status") == "ok":
            for label, r in ref["labels"].items():
                o = ours["labels"].get(label)
                if o is None:
                    continue
                for m in ("hit@5", "mrr"):
                    verdicts.append({"what": f"{m} {label} vs 0.4.0", "size": size,
                                     "value": o[m], "limit": r[m], "unit": "",
                                     "ok": o[m] >= r[m], "higher_is_better": True})
    return verdicts


def _token_value(tok, key):
    if key == "index_tokens_per_entry":
        return (tok.get("index_compact") or {}).get("per_entry")
    if key == "index_base_tokens":
        return (tok.get("index_compact") or {}).get("base_tokens")
    if key == "index_compact_vs_docshelf":
        return tok.get("compact_vs_docshelf")
    return tok.get(key)


def target_text(targets, case, size):
    tgt = targets["cases"].get(case)
    if not tgt:
        return ""
    limit = tgt.get("limit", {}).get(size)
    parts = []
    if limit is not None:
        parts.append("≤ " + fmt_s(limit))
    return " ".join(parts)


def floor_text(fl, case):
    """The floor and ratio cells of a case's row: `name` median | ratio (+ above)."""
    f = fl.get(case)
    if not f:
        return " |"
    above = ("+" if f["above_s"] >= 0 else "−") + fmt_s(abs(f["above_s"]))
    return (f"{' + '.join('`%s`' % p for p in f['floor'].split(' + '))} {fmt_s(f['floor_s'])} | "
            f"{f['ratio']:.2f}× ({above})" if f["ratio"] else " |")


def markdown(results, targets, check):
    env, cfg = results["environment"], results["config"]
    out = [f"# memshelf benchmark — {env['date']}", ""]
    out.append(f"- Machine: {env['cpu']} ({env['cores']} cores), {env['os']}")
    out.append(f"- Python {env['python']} (`{env['python_path']}`), {env['git']}, "
               f"SQLite {env['sqlite']}, FTS5 {'yes' if env['fts5'] else 'no'}")
    out.append(f"- memshelf: {results['versions'].get('ours') or 'n/a'}"
               + (f" (commit {env['memshelf_commit']})" if env.get("memshelf_commit") else ""))
    if results["versions"].get("ref"):
        out.append(f"- reference: {results['versions']['ref']} (`{cfg['ref_cmd']}`"
                   + (f" on `{cfg['ref_interpreter']}`" if cfg.get("ref_interpreter") else "")
                   + ")")
    out.append(f"- repeat {cfg['repeat']} (cold: new process per run after one untimed "
               f"warm-up; median and p90)" + (", smoke run: no thresholds" if cfg["smoke"] else ""))
    for size, data in results["sizes"].items():
        sh = data["shelf"]
        out += ["", f"## {int(size):,} episodes", "",
                f"Shelf: {sh['episodes']:,} episodes, {sh['episode_mb']} MB of episodes, seed "
                f"{sh['seed']}, raw-kb {sh['raw_kb']}, {sh['format']} INDEX, {sh['storage']}.", ""]
        has_ref = any("ref" in r for r in data["cases"].values())
        fl = data.get("floors") or floors(data["cases"])
        head = "| case | median | p90 | peak RSS | target | floor | ours / floor |"
        rule = "|---|---:|---:|---:|---|---|---:|"
        if has_ref:
            head += " 0.4.0 median | 0.4.0 / ours | ratio target |"
            rule += "---:|---:|---|"
        out += [head, rule]
        notes = []
        for case, what in CASES:
            if case not in data["cases"]:
                continue
            r = data["cases"][case]
            o = r.get("ours", {})
            tgt = targets["cases"].get(case, {})
            p90 = o.get("p95") if case.startswith("mcp-") and case != "mcp-initialize" \
                else o.get("p90")
            rss = o.get("rss_mb")
            if case == "mcp-initialize" and o.get("idle_rss_mb") is not None:
                rss_text = f"{rss} MB (idle {o['idle_rss_mb']} MB)"
            else:
                rss_text = f"{rss} MB" if rss is not None else ""
            med = fmt_s(o.get("median")) if o.get("status") == "ok" else "n/a"
            if o.get("status") != "ok":
                notes.append(f"{case} (memshelf): {o.get('reason')}")
            label = f"{what}"
            row = (f"| {label} | {med} | {fmt_s(p90) if o.get('status') == 'ok' else ''} | "
                   f"{rss_text} | {target_text(targets, case, size)} | {floor_text(fl, case)} |")
            if has_ref:
                rf = r.get("ref")
                if rf is None:
                    row += " | | |"
                else:
                    rmed = fmt_s(rf.get("median")) if rf.get("status") == "ok" else "n/a"
                    if rf.get("status") != "ok" and rf.get("reason") not in (
                            "no such verb", "0.4.0 keeps no search index"):
                        notes.append(f"{case} (0.4.0): {rf.get('reason')}")
                    ratio = ""
                    if rf.get("status") == "ok" and o.get("status") == "ok" and o.get("median"):
                        ratio = f"{rf['median'] / o['median']:.1f}×"
                    rt = tgt.get("ref_ratio_min")
                    row += f" {rmed} | {ratio} | {('≥ %g× at 10k' % rt) if rt else ''} |"
            out.append(row)
        if data.get("tokens"):
            out += ["", "### Token economy (chars/4)", ""]
            impls = [k for k in ("ours", "ref") if k in data["tokens"]]
            out.append("| metric | " + " | ".join("memshelf" if k == "ours" else "0.4.0"
                                                   for k in impls) + " | target |")
            out.append("|---|" + "---:|" * len(impls) + "---|")
            for key, label, tgt in TOKEN_ROWS:
                vals = [_fmt_token(data["tokens"][k], key) for k in impls]
                if all(v == "" for v in vals):
                    continue
                out.append(f"| {label} | " + " | ".join(vals) + f" | {tgt} |")
        if data.get("retrieval"):
            out += ["", "### Retrieval (`search`, k = 5, episode level)", ""]
            impls = [k for k in ("ours", "ref") if k in data["retrieval"]]
            head = "| label | queries |" + "".join(
                f" {'memshelf' if k == 'ours' else '0.4.0'} hit@5 | "
                f"{'memshelf' if k == 'ours' else '0.4.0'} MRR |" for k in impls) + " target |"
            out += [head, "|---|---:|" + "---:|---:|" * len(impls) + "---|"]
            hit_floors = targets.get("retrieval", {}).get("hit_at_5_min", {})
            labels = []
            for k in impls:
                r = data["retrieval"][k]
                if r.get("status") == "ok":
                    labels += [lb for lb in r["labels"] if lb not in labels]
                else:
                    notes.append(f"retrieval ({'memshelf' if k == 'ours' else '0.4.0'}): "
                                 f"{r.get('reason')}")
            for lb in labels:
                row, count = f"| {lb} |", ""
                cells = ""
                for k in impls:
                    r = data["retrieval"][k]
                    v = r.get("labels", {}).get(lb) if r.get("status") == "ok" else None
                    count = count or (str(v["n"]) if v else "")
                    cells += (f" {v['hit@5']:.2f} | {v['mrr']:.2f} |" if v else " n/a | n/a |")
                floor = hit_floors.get(lb)
                out.append(row + f" {count} |" + cells +
                           (f" hit@5 ≥ {floor:.2f} |" if floor else " reported |"))
        q = (data.get("questions") or {}).get("ours")
        if q:
            out += ["", "### Questions (`search-bench`, bench/questions.tsv, section level)", "",
                    "| label | queries | hit@1 | hit@5 | MRR |", "|---|---:|---:|---:|---:|"]
            if q.get("status") != "ok":
                notes.append(f"questions: {q.get('reason')}")
            for lb, v in sorted(q.get("labels", {}).items()):
                out.append(f"| {lb} | {v['n']} | {v['hit@1']:.2f} | {v['hit@5']:.2f} | "
                           f"{v['mrr']:.2f} |")
        if notes:
            out += ["", "n/a and notes:", ""] + [f"- {n}" for n in notes]
    if check is not None:
        misses = [v for v in check if not v["ok"]]
        out += ["", f"## Check against bench/targets.json: {len(check) - len(misses)} met, "
                    f"{len(misses)} missed", ""]
        for v in misses:
            out.append(f"- MISS {v['what']} at {int(v['size']):,}: "
                       f"{_fmt_verdict(v['value'], v['unit'])} vs "
                       f"{'≥' if v.get('higher_is_better') else '≤'} "
                       f"{_fmt_verdict(v['limit'], v['unit'])}")
    out += ["", "Columns: bench/README.md.", ""]
    return "\n".join(out)


TOKEN_ROWS = [
    ("index_compact.per_entry", "INDEX tokens per entry, compact", "≤ 27 (10k)"),
    ("index_docshelf.per_entry", "INDEX tokens per entry, docshelf", ""),
    ("compact_vs_docshelf", "compact / docshelf per entry", "≤ 0.7"),
    ("index_compact.base_tokens", "INDEX base (compact)", "≤ 120"),
    ("index_compact.tokens", "INDEX tokens (compact)", ""),
    ("index_docshelf.tokens", "INDEX tokens (docshelf)", ""),
    ("envelope_overhead", "envelope overhead (recall − section)", "≤ 45"),
    ("recall_cost_per_question", "recall cost per question (hook INDEX + section)", "reported"),
    ("standing_cost_per_episode", "standing cost per episode", "reported"),
    ("compression_ratio", "compression ratio (stats)", "> 0.4.0"),
    ("tools", "tools listed", ""),
    ("tools_list_chars", "`tools/list` characters", "≤ 18,000"),
    ("instructions_chars", "`instructions` characters", "≤ 1,000"),
    ("session_start_chars", "SessionStart payload characters", "≤ 9,500"),
    ("index_tool_default_chars", "`memshelf_index` default answer characters", "≤ 32,000"),
]


def _fmt_token(tok, key):
    cur = tok
    for part in key.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(part)
    if cur is None:
        return ""
    return fmt_num(cur, 2 if isinstance(cur, float) and cur < 10 else 1)


def _fmt_verdict(v, unit):
    if v is None:
        return "n/a"
    if unit == "s":
        return fmt_s(v)
    return f"{v:g} {unit}".strip()


def write_files(results, text, want_json, want_md, out_dir):
    if want_json or want_md:
        os.makedirs(out_dir, exist_ok=True)
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in results["environment"]["host"])
    stem = os.path.join(out_dir, f"{datetime.date.today().isoformat()}-{host}")
    written = []
    if want_json:
        with open(stem + ".json", "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, ensure_ascii=False)
            f.write("\n")
        written.append(stem + ".json")
    if want_md:
        with open(stem + ".md", "w", encoding="utf-8") as f:
            f.write(text)
        written.append(stem + ".md")
    return written


# ==========================================================================================
# Main
# ==========================================================================================

def parse_args(argv):
    ap = argparse.ArgumentParser(description="memshelf benchmark harness (bench/README.md).")
    ap.add_argument("--sizes", default="1000,10000", help="comma-separated shelf sizes")
    ap.add_argument("--cases", default="all",
                    help=f"comma-separated case names or groups ({', '.join(CASE_GROUPS)}); "
                         "all: " + ",".join(CASE_NAMES))
    ap.add_argument("--repeat", type=int, default=None, help="timed runs per cold case (7)")
    ap.add_argument("--smoke", action="store_true",
                    help="1,000 episodes, one repetition, no thresholds")
    ap.add_argument("--json", action="store_true", help="write results/<date>-<host>.json")
    ap.add_argument("--md", action="store_true", help="write results/<date>-<host>.md")
    ap.add_argument("--out-dir", default=RESULTS, help="where --json/--md write")
    ap.add_argument("--check", action="store_true",
                    help="compare with bench/targets.json; exit 1 on a miss")
    ap.add_argument("--ref", action="store_true", help="also run memshelf-mcp 0.4.0's CLI")
    ap.add_argument("--ref-cmd", default=DEFAULT_REF, help="reference CLI command")
    ap.add_argument("--ref-server-cmd", default=None,
                    help="reference MCP server command (default: memshelf-mcp next to --ref-cmd)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--raw-kb", type=float, default=6.4, help="mean Raw excerpts size")
    ap.add_argument("--format", choices=("compact", "docshelf"), default="compact")
    ap.add_argument("--plain", action="store_true", help="plain storage instead of git-local")
    ap.add_argument("--code", default=REPO, help="folder holding memshelf.py and server.py")
    ap.add_argument("--python", default=None,
                    help="interpreter for memshelf's children (default: this one, resolved)")
    ap.add_argument("--retrieval-queries", type=int, default=None,
                    help="queries per label for retrieval (50; smoke 3)")
    ap.add_argument("--keep-work", action="store_true", help="keep the per-run shelf copies")
    args = ap.parse_args(argv)
    args.repeat_explicit = args.repeat is not None
    if args.smoke:
        args.sizes = "1000"
        args.repeat = 1 if args.repeat is None else args.repeat
        args.retrieval_queries = args.retrieval_queries or 3
    args.repeat = 7 if args.repeat is None else args.repeat
    args.retrieval_queries = args.retrieval_queries or 50
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    try:
        args.size_list = [int(s.replace("_", "").replace(",", "")) for s in
                          args.sizes.split(",") if s.strip()]
    except ValueError:
        ap.error("--sizes takes integers, e.g. 1000,10000")
    chosen = []
    for part in (p.strip() for p in args.cases.split(",")):
        if part == "all":
            chosen += CASE_NAMES
        elif part in CASE_GROUPS:
            chosen += CASE_GROUPS[part]
        elif part in CASE_NAMES:
            chosen.append(part)
        elif part:
            ap.error(f"unknown case {part!r}; known: {', '.join(CASE_NAMES)}")
    args.cases = [c for c in CASE_NAMES if c in chosen]
    args.code = os.path.abspath(args.code)
    return args


def main(argv=None, force_ref=False):
    global PYTHON
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.python:
        PYTHON = os.path.realpath(shutil.which(args.python) or args.python)
    if force_ref:
        args.ref = True
    runner = Runner()
    impls = [our_impl(args.code)]
    if args.ref:
        ref = ref_impl(args.ref_cmd, args.ref_server_cmd)
        if ref is None:
            log(f"bench: reference command {args.ref_cmd!r} not found; running memshelf only")
        else:
            impls.append(ref)
    t0 = time.perf_counter()
    results = {"environment": environment(args.code),
               "config": {"sizes": args.size_list, "repeat": args.repeat, "smoke": args.smoke,
                          "cases": args.cases, "ref_cmd": args.ref_cmd if len(impls) > 1 else None,
                          "retrieval_queries_per_label": args.retrieval_queries,
                          "interpreter": PYTHON, "venv": impls[0].console[0],
                          "ref_interpreter": impls[1].interpreter if len(impls) > 1 else None},
               "versions": {}, "sizes": {}}
    bench = Bench(args, impls, runner)
    for n in args.size_list:
        results["sizes"][str(n)] = bench.run_size(n)
    for impl in impls:
        if impl.version is None:
            res = runner.run(impl.argv("version", "."), impl.env())
            impl.version = res["stdout"].strip() if not failure(res) else None
        results["versions"][impl.key] = impl.version
    results["seconds"] = round(time.perf_counter() - t0, 1)
    targets = load_targets()
    verdicts = None
    if args.check and not args.smoke:
        verdicts = evaluate(results, targets)
        results["check"] = verdicts
    text = markdown(results, targets, verdicts)
    sys.stdout.write(text)
    for path in write_files(results, text, args.json, args.md, args.out_dir):
        log(f"bench: wrote {path}")
    log(f"bench: done in {results['seconds']} s")
    if verdicts is not None and any(not v["ok"] for v in verdicts):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
