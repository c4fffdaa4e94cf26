#!/usr/bin/env python3
"""Search quality on labelled question sets, memshelf beside a plain FTS5 baseline.

Every set is a shelf plus questions labelled with the episode and the section that answers
(`id § Section`). Each question is asked as an agent typed it; two rankings are scored on the
same section rows and the same queries:

- memshelf: `memshelf.search(root, q, max_results=10)` with its defaults;
- baseline: SQLite FTS5 with nothing tuned: one row per section (columns: the episode's id
  words, display title, description and tags; the heading; the body), the default `unicode61`
  tokenizer, the query's words OR'd, ordered by `bm25()` with its default weights.

Scores: episode hit@1 and hit@3 (an episode's rank is that of its first section), section
hit@1 / hit@3 / hit@5 and section MRR (over the top 10).

Sets:
  rfc16     16 Rust RFCs shelved by an agent and its 24 single-episode questions: a folder with
            shelf.tar.gz and questions.jsonl, bench/corpora/rfc16 (--rfc16 DIR or
            MEMSHELF_RFC16 for another copy)
  design    bench/design_docs.py and bench/questions.tsv (ten design docs, 32 questions with
            keyword twins)
  relnotes  bench/relnotes.py and bench/relnotes_questions.tsv (40 of Git's own release notes,
            read from /usr/share/doc/git/RelNotes at run time; skipped where they are absent)

    python3 bench/search_quality.py [--sets rfc16,design,relnotes] [--rfc16 DIR] [--code DIR] [--json]
                                    [--misses]
"""
import argparse
import json
import os
import re
import shutil
import sqlite3
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RFC16 = os.environ.get("MEMSHELF_RFC16") or os.path.join(os.path.dirname(os.path.abspath(
    __file__)), "corpora", "rfc16")   # the corpus folder; --rfc16 sets it
DEPTH = 10


# --- sets: (shelf folder, [(query, episode id, section, label)]) ---------------------------

def _tsv(path):
    out = []
    for line in open(path, encoding="utf-8"):
        if not line.strip() or line.startswith("#"):
            continue
        query, expected, label = (line.rstrip("\n").split("\t") + ["unlabelled"])[:3]
        ident, _, section = expected.partition(" § ")
        out.append((query, ident, section, label))
    return out


def set_rfc16(work, memshelf):
    if not RFC16:
        raise RuntimeError("no corpus: pass --rfc16 DIR (shelf.tar.gz and questions.jsonl)")
    folder = os.path.realpath(RFC16)
    if not os.path.isdir(folder):
        raise RuntimeError(f"{folder} is missing")
    with tarfile.open(os.path.join(folder, "shelf.tar.gz")) as tar:
        tar.extractall(work)
    questions = []
    for line in open(os.path.join(folder, "questions.jsonl"), encoding="utf-8"):
        q = json.loads(line)
        if isinstance(q.get("episode"), str) and q["episode"]:
            questions.append((q["q"], q["episode"], q["section"], q["kind"]))
    return os.path.join(work, "shelf.orig"), questions


def set_design(work, memshelf):
    sys.path.insert(0, HERE)
    import design_docs
    root = os.path.join(work, "design")
    design_docs.build(root)
    return root, _tsv(os.path.join(HERE, "questions.tsv"))


def set_relnotes(work, memshelf):
    sys.path.insert(0, HERE)
    import relnotes
    root = os.path.join(work, "relnotes")
    relnotes.build(root)
    return root, _tsv(os.path.join(HERE, "relnotes_questions.tsv"))


SETS = {"rfc16": set_rfc16, "design": set_design, "relnotes": set_relnotes}


# --- the plain FTS5 baseline ----------------------------------------------------------------

_H2 = re.compile(r"^## (.*)$", re.M)


def _frontmatter(text):
    """(fields as plain strings, body) by the simplest rule: the block between --- lines."""
    lines = text.split("\n")
    start = next((i for i, ln in enumerate(lines[:5]) if ln.strip() == "---"), None)
    if start is None:
        return {}, text
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() == "---"), None)
    if end is None:
        return {}, text
    fields = {}
    for ln in lines[start + 1:end]:
        key, sep, value = ln.partition(":")
        if sep and not ln.startswith(" "):
            fields[key.strip()] = value.strip().strip("'\"[]")
    return fields, "\n".join(lines[end + 1:])


def baseline_index(root):
    db = sqlite3.connect(":memory:")
    db.execute("CREATE VIRTUAL TABLE rows USING fts5(title, heading, body)")
    db.execute("CREATE TABLE sec(rowid INTEGER PRIMARY KEY, ident TEXT, heading TEXT)")
    n = 0
    for base, _, files in os.walk(os.path.join(root, "docs")):
        for name in sorted(files):
            if not name.endswith(".md"):
                continue
            fields, body = _frontmatter(open(os.path.join(base, name), encoding="utf-8").read())
            ident = name[:-3]
            title = " ".join([ident.replace("-", " ")] + [fields.get(k, "") for k in (
                "display_title", "description", "tags")])
            heads = list(_H2.finditer(body))
            for i, m in enumerate(heads):
                text = body[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(body)]
                n += 1
                db.execute("INSERT INTO rows(rowid, title, heading, body) VALUES (?,?,?,?)",
                           (n, title, m.group(1).strip(), text.strip()))
                db.execute("INSERT INTO sec VALUES (?,?,?)", (n, ident, m.group(1).strip()))
    return db


def baseline_search(db, query):
    words = re.findall(r"\w+", query)
    if not words:
        return []
    expr = " OR ".join('"' + w.replace('"', '') + '"' for w in words)
    return [(i, h) for i, h in db.execute(
        "SELECT s.ident, s.heading FROM rows JOIN sec s ON s.rowid = rows.rowid"
        " WHERE rows MATCH ? ORDER BY bm25(rows) LIMIT ?", (expr, DEPTH))]


# --- scoring --------------------------------------------------------------------------------

def score(ranked_lists, questions):
    """ranked_lists[i]: [(id, section)] best first, for questions[i]."""
    n = len(questions) or 1
    ep1 = ep3 = s1 = s3 = s5 = rr = 0.0
    misses = []
    for ranked, (query, ident, section, label) in zip(ranked_lists, questions):
        episodes = list(dict.fromkeys(i for i, _ in ranked))
        erank = episodes.index(ident) + 1 if ident in episodes else None
        srank = next((k for k, (i, s) in enumerate(ranked, 1)
                      if i == ident and s.casefold() == section.casefold()), None)
        ep1 += erank == 1
        ep3 += bool(erank and erank <= 3)
        s1 += srank == 1
        s3 += bool(srank and srank <= 3)
        s5 += bool(srank and srank <= 5)
        rr += 1.0 / srank if srank else 0.0
        if srank != 1:
            misses.append((query, f"{ident} § {section}", srank, ranked[:3]))
    return {"n": len(questions), "ep@1": ep1 / n, "ep@3": ep3 / n, "sec@1": s1 / n,
            "sec@3": s3 / n, "sec@5": s5 / n, "mrr": rr / n}, misses


def run_set(name, memshelf, show_misses):
    work = tempfile.mkdtemp(prefix=f"memshelf-quality-{name}-")
    try:
        root, questions = SETS[name](work, memshelf)
        base = baseline_index(root)
        ranked_base = [baseline_search(base, q) for q, *_ in questions]
        ranked_ours = []
        for q, *_ in questions:
            try:
                hits = memshelf.search(root, q, max_results=DEPTH)["hits"]
            except memshelf.ShelfError:
                hits = []
            ranked_ours.append([(h["id"], h["section"] or "") for h in hits])
        ours, ours_miss = score(ranked_ours, questions)
        plain, _ = score(ranked_base, questions)
        if show_misses:
            for query, want, rank, top in ours_miss:
                print(f"  miss {name}: {query!r} -> {want}: rank {rank}; top "
                      + "; ".join(f"{i} § {s}" for i, s in top), file=sys.stderr)
        return {"memshelf": ours, "baseline": plain}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(results):
    cols = ("ep@1", "ep@3", "sec@1", "sec@3", "sec@5", "mrr")
    lines = ["| set | ranking | n | " + " | ".join(cols) + " |",
             "|---|---|---:|" + "---:|" * len(cols)]
    for name, res in results.items():
        if "skipped" in res:
            lines.append(f"| {name} | skipped: {res['skipped']} |" + " |" * (len(cols) + 1))
            continue
        for who in ("memshelf", "baseline"):
            s = res[who]
            mark = [("**" if who == "memshelf" and s[c] < res["baseline"][c] - 1e-9 else "")
                    for c in cols]
            lines.append(f"| {name} | {who if who == 'memshelf' else 'plain FTS5 bm25()'} | "
                         f"{s['n']} | " + " | ".join(f"{m}{s[c]:.2f}{m}" for m, c in
                                                     zip(mark, cols)) + " |")
    return "\n".join(lines)


def main(argv=None):
    global RFC16
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", default="rfc16,design,relnotes")
    ap.add_argument("--rfc16", default=RFC16,
                    help="folder of the rfc16 corpus")
    ap.add_argument("--code", default=REPO, help="folder holding memshelf.py")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--misses", action="store_true", help="list memshelf's misses on stderr")
    args = ap.parse_args(argv)
    RFC16 = args.rfc16
    sys.path.insert(0, os.path.abspath(args.code))
    os.environ.setdefault("MEMSHELF_SEMANTIC", "off")
    import memshelf
    results = {}
    for name in args.sets.split(","):
        try:
            results[name] = run_set(name, memshelf, args.misses)
        except (RuntimeError, OSError, ImportError) as exc:
            results[name] = {"skipped": str(exc)}
    print(json.dumps(results, indent=1) if args.json else table(results))
    print("(bold: memshelf below the baseline)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
