"""Interop both ways with memshelf-mcp 0.4.0 (PyPI), the public package of the same design.

Fixture shelves it wrote are committed under tests/fixtures/ref040/ (see MAKE.md there). The
live tests install memshelf-mcp 0.4.0 into a throwaway virtual environment (reused between
runs from the user cache) and run its real CLI against shelves our CLI wrote, and ours against
shelves its CLI wrote.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, chart_rows, run_cli, shelve_args

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "ref040")


def copy_fixture(name, dest):
    shutil.copytree(os.path.join(FIXTURES, name), dest)
    for cat in ("topics", "research", "sessions"):   # git keeps no empty folders
        os.makedirs(os.path.join(dest, "docs", cat), exist_ok=True)
    return dest


def episodes_of(root):
    out = []
    for cat in ("topics", "research", "sessions"):
        for n in sorted(os.listdir(os.path.join(root, "docs", cat))):
            if n.endswith(".md"):
                out.append((cat, n[:-3]))
    return out


# --- shelves written by 0.4.0, read by us (committed fixtures) ------------------------------

@pytest.mark.slow
def test_fixture_shelf_reads_recalls_and_rebuilds_byte_identically(tmp_path):
    root = copy_fixture("shelf-docshelf", str(tmp_path / "fx"))
    before = {p: open(os.path.join(root, p), "rb").read()
              for p in ("INDEX.md", "ledger.tsv", "stats.svg", "docs/topics/.meta.json")}
    r = run_cli("rebuild", "--shelf", root, "--check", "--json")
    assert r.code == 0, r
    assert r.json()["drifted"] == []
    r = run_cli("rebuild", "--shelf", root, "--json")
    assert r.code == 0 and r.json()["written"] == []
    for p, data in before.items():
        assert open(os.path.join(root, p), "rb").read() == data, p
    r = run_cli("index", "--shelf", root, "--json")
    assert r.code == 0 and r.json()["format"] == "docshelf"
    assert r.json()["index"] == before["INDEX.md"].decode()
    for cat, stem in episodes_of(root):
        r = run_cli("recall", "--shelf", root, "--id", stem, "--no-log", "--outline", "--json")
        assert r.code == 0, (stem, r)
        res = r.json()
        first = res["sections"][0]["section"]
        r = run_cli("recall", "--shelf", root, "--id", stem, "--section", first, "--no-log")
        assert r.code == 0 and f"## {first}" in r.out


def test_fixture_recall_log_three_cells_is_read(tmp_path):
    root = copy_fixture("shelf-docshelf", str(tmp_path / "fx"))
    log = open(os.path.join(root, "recall-log.tsv")).read()
    assert log.startswith("episode_id\tsection\tfetched_tokens\n")
    _, stem = episodes_of(root)[0]
    assert run_cli("recall", "--shelf", root, "--id", stem).code == 0
    rows = open(os.path.join(root, "recall-log.tsv")).read().strip().split("\n")
    assert rows[0] == "episode_id\tsection\tfetched_tokens"   # the old header is kept
    assert len(rows[-1].split("\t")) == 4


def test_fixture_doctor_has_no_error(tmp_path):
    root = copy_fixture("shelf-docshelf", str(tmp_path / "fx"))
    r = run_cli("doctor", "--shelf", root, "--json")
    if "not implemented" in r.out + r.err:
        pytest.skip("doctor is not implemented yet")
    res = r.json()
    assert [f for f in res["findings"] if f["level"] == "error"] == [], res["findings"]


def test_empty_fixture_and_init_keeps_its_format(tmp_path):
    root = copy_fixture("shelf-empty", str(tmp_path / "e"))
    assert run_cli("rebuild", "--shelf", root, "--check").code == 0
    r = run_cli("init", "--shelf", root, "--storage", "plain", "--json")
    assert r.code == 0, r
    assert "generated_by: docshelf-mcp" in open(os.path.join(root, "shelf.yml")).read()
    pre = json.load(open(os.path.join(root, ".docshelf.json")))["preamble"]
    assert pre and "memshelf" in pre.lower()       # 0.4.0's own memory preamble is kept
    assert run_cli("rebuild", "--shelf", root, "--check").code == 0


def test_chart_fixtures_are_byte_identical():
    import memshelf
    base = os.path.join(FIXTURES, "charts")
    for name in sorted(os.listdir(base)):
        with open(os.path.join(base, name, "ledger.tsv"), encoding="utf-8") as f:
            rows = chart_rows(f.read())
        with open(os.path.join(base, name, "stats.svg"), encoding="utf-8") as f:
            assert memshelf._render_chart(memshelf._chart_sums(rows)) == f.read(), name


# --- live: the real memshelf-mcp 0.4.0 CLI ---------------------------------------------------

@pytest.fixture(scope="session")
def ref040():
    """The memshelf-mcp 0.4.0 CLI from a throwaway venv (built once, then reused)."""
    for candidate in (os.environ.get("MEMSHELF_REF040_BIN"), "/tmp/ref040/bin/memshelf"):
        if candidate and os.path.exists(candidate):
            return candidate
    cache = os.path.join(os.path.expanduser("~"), ".cache", "memshelf-tests", "ref040")
    exe = os.path.join(cache, "bin", "memshelf")
    if not os.path.exists(exe):
        try:
            subprocess.run([sys.executable, "-m", "venv", cache], check=True,
                           capture_output=True, timeout=120)
            subprocess.run([os.path.join(cache, "bin", "pip"), "install", "-q",
                            "memshelf-mcp==0.4.0"], check=True, capture_output=True,
                           timeout=600)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            shutil.rmtree(cache, ignore_errors=True)
            pytest.skip(f"memshelf-mcp 0.4.0 could not be installed: {exc}")
    return exe


def run_ref(exe, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHELF_")}
    proc = subprocess.run([exe, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)
    return proc


def ref_doctor_errors(exe, root):
    proc = run_ref(exe, "doctor", "--shelf", root)
    data = json.loads(proc.stdout)
    return [f for f in data["findings"] if f["level"] == "error"]


INTEROP_DIGESTS = [
    ("2026-07-20-auth-middleware", "topic", "Dana chose JWT middleware over sessions; "
     "per-route decorators were rejected. Open: key rotation."),
    ("2026-07-22-vector-db-survey", "research", "Priya compared three vector stores and "
     "chose pgvector for the prototype."),
    ("2026-07-24-release-prep", "session", "Release prep: Dana merged the middleware; decided "
     "to ship Thursday. Open: changelog."),
]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["docshelf", "compact"])
def test_our_shelf_is_read_by_040(tmp_path, ref040, fmt):
    root = tmp_path / "ours"
    assert run_cli("init", "--shelf", root, "--index-format", fmt).code == 0
    for slug, kind, digest in INTEROP_DIGESTS:
        # a status field (docs/frontmatter.md) must not trouble 0.4.0
        status = ["--status", "deprecated"] if kind == "topic" else []
        r = run_cli(*shelve_args(root, slug=slug, kind=kind, digest=digest, extra=[
            "--tag", "interop", "--approx-tokens", "5000", "--display-title", f"Title {kind}"]
            + status))
        assert r.code == 0, r
    for slug, kind, _ in INTEROP_DIGESTS:
        p = run_ref(ref040, "recall", "--shelf", root, "--id", slug, "--no-log")
        assert p.returncode == 0, p.stderr
        assert slug in p.stdout
    assert ref_doctor_errors(ref040, root) == []
    if fmt == "docshelf":
        p = run_ref(ref040, "rebuild", "--shelf", root, "--check")
        assert p.returncode == 0, p.stdout + p.stderr
        before = {n: (root / n).read_bytes() for n in ("INDEX.md", "ledger.tsv", "stats.svg")}
        p = run_ref(ref040, "rebuild", "--shelf", root)
        assert p.returncode == 0, p.stderr
        for n, data in before.items():
            assert (root / n).read_bytes() == data, f"0.4.0 re-rendered {n} differently"
    # and our doctor and rebuild still agree after 0.4.0 touched the shelf
    assert run_cli("rebuild", "--shelf", root, "--check").code in (0, 1)


@pytest.mark.slow
def test_040_shelf_is_read_by_us(tmp_path, ref040):
    root = tmp_path / "theirs"
    p = run_ref(ref040, "init", "--shelf", root)
    assert p.returncode == 0, p.stderr
    for slug, kind, digest in INTEROP_DIGESTS:
        args = ["shelve", "--shelf", root, "--slug", slug, "--kind", kind, "--digest", digest,
                "--tag", "interop", "--approx-tokens", "4000"]
        if kind == "topic":
            args += ["--section", "Decisions=- JWT in middleware"]
        elif kind == "session":
            args += ["--section", "Timeline=1. merged", "--section", "Open threads=- changelog"]
        else:
            args += ["--section", "Findings=pgvector wins"]
        p = run_ref(ref040, *args)
        assert p.returncode == 0, p.stderr
    p = run_ref(ref040, "rebuild", "--shelf", root)
    assert p.returncode == 0, p.stderr
    r = run_cli("rebuild", "--shelf", root, "--check", "--json")
    assert r.code == 0, r
    for slug, _, _ in INTEROP_DIGESTS:
        r = run_cli("recall", "--shelf", root, "--id", slug, "--no-log")
        assert r.code == 0 and slug in r.out
    # our write on their shelf: still fine for them
    r = run_cli(*shelve_args(root, slug="2026-07-28-ours-on-theirs"))
    assert r.code == 0, r
    assert ref_doctor_errors(ref040, root) == []
    p = run_ref(ref040, "recall", "--shelf", root, "--id", "2026-07-28-ours-on-theirs",
                "--section", "Decisions", "--no-log")
    assert p.returncode == 0 and "JWT" in p.stdout
    r = run_cli("doctor", "--shelf", root, "--json")
    if "not implemented" not in r.out + r.err:
        assert [f for f in r.json()["findings"] if f["level"] == "error"] == []
