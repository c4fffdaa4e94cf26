#!/usr/bin/env python3
"""The structural measures issue 32 compares: top-level functions and classes, function
lengths (median / p95 / max lines), and the share of comment and docstring lines.

    python3 bench/code_shape.py [file ...]      # default: memshelf.py
"""
import ast
import io
import os
import statistics
import sys
import tokenize


def shape(path):
    text = open(path, encoding="utf-8").read()
    tree = ast.parse(text)
    lines = text.count("\n") or 1
    top_functions = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in tree.body)
    top_classes = sum(isinstance(n, ast.ClassDef) for n in tree.body)
    lengths = sorted(n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    doc_lines = 0
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = n.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and \
                    isinstance(body[0].value.value, str):
                doc_lines += body[0].end_lineno - body[0].lineno + 1
    # lines that are a comment alone (a comment after code counts with the code)
    comment_lines = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                     if tok.type == tokenize.COMMENT and tok.line.lstrip().startswith("#")}
    p95 = lengths[min(len(lengths) - 1, int(round(0.95 * (len(lengths) - 1))))]
    return {"file": os.path.basename(path), "lines": lines, "top_functions": top_functions,
            "top_classes": top_classes, "functions": len(lengths),
            "median": statistics.median(lengths), "p95": p95, "max": lengths[-1],
            "comments": 100 * len(comment_lines) / lines, "docstrings": 100 * doc_lines / lines}


def main(paths):
    print("| file | lines | top-level functions / classes | function lines median / p95 / max "
          "| comments / docstrings |")
    print("|---|---:|---:|---:|---:|")
    for p in paths:
        s = shape(p)
        print(f"| {s['file']} | {s['lines']:,} | {s['top_functions']} / {s['top_classes']} | "
              f"{s['median']:g} / {s['p95']} / {s['max']} | "
              f"{s['comments']:.1f} % / {s['docstrings']:.1f} % |")


if __name__ == "__main__":
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:] or [os.path.join(here, "memshelf.py")])
