"""The benchmark shelf generator: a small real shelf, checked by memshelf itself."""
import glob
import os
import re
import subprocess
import sys

import pytest

import memshelf

pytestmark = pytest.mark.slow   # runs the shelf generator: the full run only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN = os.path.join(ROOT, "bench", "gen_shelf.py")
LABELS = {"exact-id", "keyword", "cjk", "cyrillic", "paraphrase"}


def _generate(tmp_path, name, n=50, seed=3):
    out = tmp_path / name / "shelf"
    proc = subprocess.run([sys.executable, GEN, "--n", str(n), "--seed", str(seed),
                           "--raw-kb", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out, tmp_path / name / "queries.tsv"


def _episodes(shelf):
    return {os.path.basename(p)[:-3]: open(p, encoding="utf-8").read()
            for p in glob.glob(os.path.join(str(shelf), "docs", "*", "*.md"))}


def _queries(path):
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            cells = line.split("\t")
            assert len(cells) == 3, line
            rows.append(cells)
    return rows


def test_generated_shelf_is_clean_and_queries_are_answerable(tmp_path):
    shelf, queries = _generate(tmp_path, "a")
    episodes = _episodes(shelf)
    assert len(episodes) == 50
    check = memshelf.rebuild(shelf_path=str(shelf), check=True)
    assert check["ok"] and not check["drifted"], check
    rows = _queries(queries)
    assert {label for _, _, label in rows} == LABELS
    for query, expected, label in rows:
        assert query.strip() and expected in episodes, (query, expected)
        text = episodes[expected]
        if label == "cjk":  # the planted string lives in exactly one episode
            assert [i for i, t in episodes.items() if query in t] == [expected]
        elif label == "keyword":
            word = query.split()[0]
            assert [i for i, t in episodes.items() if word in t] == [expected]
        elif label == "cyrillic":
            assert all(w[:-2] in text for w in query.split()), query
        elif label == "exact-id":
            assert query == expected or re.search(re.escape(query) + r"\b", text)


def test_generator_is_deterministic_and_writes_what_shelve_writes(tmp_path):
    first, _ = _generate(tmp_path, "a", n=12, seed=9)
    second, _ = _generate(tmp_path, "b", n=12, seed=9)
    episodes = _episodes(first)
    assert episodes == _episodes(second)
    for stem in sorted(episodes)[:4]:
        text = episodes[stem]
        fields, body = memshelf.parse_frontmatter(text)
        parts = re.split(r"^## (.+)$", body, flags=re.M)
        pairs = [(parts[i], parts[i + 1].strip()) for i in range(1, len(parts), 2)]
        result = memshelf.shelve(
            shelf_path=str(first), slug=fields["id"], kind=fields["kind"], digest=pairs[0][1],
            sections=dict(pairs[1:]), display_title=fields.get("display_title"),
            description=fields.get("description"), tags=fields["tags"], span=fields["span"],
            date=fields["date"], session=fields.get("session"), agent=fields.get("agent"),
            notes=fields.get("notes"), retain_until=fields.get("retain_until"),
            supersedes=fields.get("supersedes") or [],
            approx_tokens=int(fields["approx_tokens"]),
            approx_tokens_source=fields["approx_tokens_source"], mode=fields["mode"],
            amend=True, dry_run=True)
        assert result["episode_text"] == text
        assert not result["digest_warnings"] and not result["redaction"]["total"]
