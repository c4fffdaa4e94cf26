#!/usr/bin/env python3
"""Run every test, the test files split over one pytest process per core (two at most).

    python3 tests/run.py [pytest options]        # what README and .ci/run call
    MEMSHELF_TEST_JOBS=1 python3 tests/run.py    # one process: the same as python3 -m pytest

Most of a test's time is a child process (the CLI, git, the MCP server) while pytest waits for
it, so one pytest leaves a core idle; two processes over disjoint files finish in about half the
time. Each process's output is printed whole when it ends; the exit code is the worst of them.
"""
import glob
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# Seconds per file in one measured run (only to balance the groups; a file not listed counts 10).
WEIGHTS = {
    "test_sync.py": 88, "test_store.py": 73, "test_edges.py": 64, "test_interrupt.py": 63,
    "test_server_wire.py": 59, "test_index_budget.py": 56, "test_newcomer.py": 51,
    "test_render_memo.py": 46, "test_semantic.py": 36, "test_search.py": 35,
    "test_core_cli.py": 35, "test_workers.py": 26, "test_hooks.py": 23,
    "test_search_terms.py": 22, "test_views.py": 22, "test_chores.py": 22, "test_bundle.py": 22,
    "test_redaction.py": 20, "test_damage.py": 17, "test_multiwriter.py": 16,
    "test_doctor.py": 14, "test_interop.py": 12,
}


def groups(files, jobs):
    """The files in `jobs` groups of about equal weight, heaviest placed first."""
    out, loads = [[] for _ in range(jobs)], [0] * jobs
    for f in sorted(files, key=lambda f: (-WEIGHTS.get(os.path.basename(f), 10), f)):
        i = loads.index(min(loads))
        out[i].append(f)
        loads[i] += WEIGHTS.get(os.path.basename(f), 10)
    return [g for g in out if g]


def main(args):
    wanted = os.environ.get("MEMSHELF_TEST_JOBS") or str(min(os.cpu_count() or 1, 2))
    if not wanted.isdigit():
        print(f"tests/run.py: MEMSHELF_TEST_JOBS must be a whole number, got {wanted!r}",
              file=sys.stderr)
        return 2
    jobs = int(wanted)
    pytest = [sys.executable, "-m", "pytest"]
    if jobs <= 1:
        return subprocess.call(pytest + ["-q"] + args, cwd=os.path.dirname(HERE))
    split = groups(sorted(glob.glob(os.path.join(HERE, "test_*.py"))), jobs)
    print(f"tests: {len(split)} pytest processes over "
          f"{' + '.join(str(len(g)) for g in split)} files", flush=True)
    started, procs = time.monotonic(), []
    try:
        for n, files in enumerate(split, 1):
            log = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
            procs.append((n, log, subprocess.Popen(
                pytest + ["-q", "-p", "no:cacheprovider"] + args + files,
                cwd=os.path.dirname(HERE), stdout=log, stderr=subprocess.STDOUT)))
        codes = []
        for n, log, proc in procs:
            codes.append(proc.wait())
            log.seek(0)
            print(f"\n== group {n} (exit {codes[-1]}, {time.monotonic() - started:.0f} s)")
            sys.stdout.write(log.read())
            sys.stdout.flush()
    except KeyboardInterrupt:
        for _, _, proc in procs:
            proc.terminate()
        return 130
    return max(codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
