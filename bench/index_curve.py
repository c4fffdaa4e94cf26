#!/usr/bin/env python3
"""INDEX.md size and served-view size against episode count (issue 28, docs/performance.md).

Per size: bench/gen_shelf.py with --long-descriptions (~150-character descriptions on every
episode; Raw excerpts off, they never reach the INDEX) -> INDEX.md in characters and tokens ->
what a model is handed instead: the session-start hook's whole JSON output, `index --budget`
and MCP `memshelf_index` (call_tool, as the server runs it), with their tiers and folds -> the
answer to the first fold's call -> the hook's time: cold processes with bytecode cached
(`python3 -m memshelf`, as the console script runs), one untimed warm-up, median of --repeat.

    python3 bench/index_curve.py --sizes 100,1000,10000,100000 [--format docshelf] [--md] [--json]
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
import gen_shelf  # noqa: E402
import memshelf  # noqa: E402

BUDGET = 9500
HOOK_STDIN = json.dumps({"session_id": "bench", "hook_event_name": "SessionStart",
                         "source": "startup"})


def shelf_for(n, fmt, cache):
    """The generated shelf of n episodes (made once; remade when the generator changes)."""
    out = os.path.join(cache, f"{n}-{fmt}", "shelf")
    stamp = os.path.join(cache, f"{n}-{fmt}", "generated.json")
    want = {"n": n, "format": fmt, "generator": gen_shelf.GENERATOR_VERSION, "long": True}
    try:
        with open(stamp, encoding="utf-8") as f:
            if json.load(f) == want and os.path.isdir(out):
                return out, None
    except (OSError, ValueError):
        pass
    t0 = time.perf_counter()
    gen_shelf.generate(out, n=n, seed=1, raw_kb=0, fmt=fmt, force=True, long_descriptions=True,
                       queries_path=os.path.join(cache, f"{n}-{fmt}", "queries.tsv"),
                       log=lambda msg: None)
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump(want, f)
    return out, round(time.perf_counter() - t0, 1)


def run(argv, stdin=None):
    t0 = time.perf_counter()
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, cwd=REPO)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr[-500:]}")
    return proc.stdout, elapsed


def measure(n, fmt, cache, repeat, python):
    shelf, generated = shelf_for(n, fmt, cache)
    with open(os.path.join(shelf, "INDEX.md"), encoding="utf-8") as f:
        index_md = f.read()
    hook = [python, "-m", "memshelf", "hook", "session-start", "--shelf", shelf]
    out, _ = run(hook, HOOK_STDIN)   # warm-up: bytecode and the shelf's cache
    times = [run(hook, HOOK_STDIN)[1] for _ in range(repeat)]
    ctx = json.loads(out)["hookSpecificOutput"]["additionalContext"]
    cli = memshelf.index(shelf_path=shelf, budget=BUDGET)
    mcp = memshelf.call_tool("memshelf_index", {"shelf_path": shelf})
    folds = re.findall(r"memshelf index --period (?:P, P one of: )?([\d.\-]+|undated)", ctx)
    first_fold = None
    if folds:
        answer = memshelf.index(shelf_path=shelf, period=folds[0])
        first_fold = {"period": folds[0], "chars": len(answer["index"]),
                      "folded_inside": answer.get("entries_folded", 0)}
    return {"episodes": n, "format": fmt, "generated_s": generated,
            "index_md_chars": len(index_md), "index_md_tokens": memshelf.tokens(index_md),
            "hook_output_chars": len(out.rstrip("\n")), "hook_context_tokens": memshelf.tokens(ctx),
            "hook_ms_median": round(statistics.median(times) * 1000, 1),
            "hook_ms_p90": round(sorted(times)[max(0, -(-len(times) * 9 // 10) - 1)] * 1000, 1),
            "cli_budget_chars": len(cli["index"]), "mcp_chars": len(mcp["index"]),
            "full": cli.get("entries_full", cli["entries_shown"]),
            "by_name": cli.get("entries_by_name", 0), "folded": cli.get("entries_folded", 0),
            "fold_lines": len(cli.get("folds", [])), "first_fold": first_fold}


def markdown(rows, machine):
    out = [f"INDEX size against episode count ({machine}); budget {BUDGET:,} characters.", "",
           "| episodes | format | INDEX.md chars | INDEX.md tokens | hook output chars | "
           "`index --budget` chars | MCP `memshelf_index` chars | in full / by name / folded | "
           "first fold's answer | hook median (p90) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fold = r["first_fold"]
        out.append(f"| {r['episodes']:,} | {r['format']} | {r['index_md_chars']:,} | "
                   f"{r['index_md_tokens']:,} | {r['hook_output_chars']:,} | "
                   f"{r['cli_budget_chars']:,} | {r['mcp_chars']:,} | {r['full']:,} / "
                   f"{r['by_name']:,} / {r['folded']:,} | " +
                   (f"`{fold['period']}`: {fold['chars']:,} chars" if fold else "—") +
                   f" | {r['hook_ms_median']} ms ({r['hook_ms_p90']} ms) |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100,1000,10000,100000")
    ap.add_argument("--format", choices=("compact", "docshelf"), default="compact")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--cache", default=os.path.join(HERE, ".cache", "curve"))
    ap.add_argument("--python", default=os.path.realpath(sys.executable))
    ap.add_argument("--json", action="store_true", help="write results/<date>-<host>-index-curve-"
                                                        "<format>.json")
    ap.add_argument("--md", action="store_true", help="the same as .md")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    machine = f"{platform.node()}, Python {platform.python_version()}, {os.cpu_count()} cores"
    rows = []
    for n in (int(s.replace(",", "").replace("_", "")) for s in args.sizes.split(",")):
        rows.append(measure(n, args.format, args.cache, args.repeat, args.python))
        sys.stderr.write(json.dumps(rows[-1]) + "\n")
    table = markdown(rows, machine)
    print(table)
    stem = os.path.join(args.out_dir, time.strftime("%Y-%m-%d") + "-" + platform.node() +
                        f"-index-curve-{args.format}")
    if args.json:
        with open(stem + ".json", "w", encoding="utf-8") as f:
            json.dump({"machine": machine, "budget": BUDGET, "rows": rows}, f, indent=2)
    if args.md:
        with open(stem + ".md", "w", encoding="utf-8") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
