"""stats: claimed economy from the episodes, realized economy from the recall log, the banner,
the chart, and the CLI's handling of bad input (docs/verbs.md § stats and advise)."""
import datetime
import json
import os
import shutil
import subprocess
import sys

import pytest

import memshelf
from conftest import chart_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "ref040", "shelf-docshelf")

DIGEST_A = "Dana chose JWT middleware for the auth refactor; sessions were rejected."
DIGEST_B = "Redis eviction research: Priya chose allkeys-lru; volatile-ttl was rejected."
DIGEST_C = "Release prep session: Dana decided to ship Thursday. Open: the changelog draft."
DIGEST_D = "The archived cache note: Priya decided to keep the warm-up job."

ARCHIVED = """# 2026-06-01-cache-note

---
id: 2026-06-01-cache-note
kind: topic
span: 2026-06-01
date: 2026-06-01
tags: []
approx_tokens: 5000
approx_tokens_source: estimate
mode: live
---

## Digest
{digest}

## Decisions
- keep the warm-up job
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("MEMSHELF_SHELF", "MEMSHELF_SHELF_PATH", "MEMSHELF_ROOT",
                 "MEMSHELF_CONTEXT_WINDOW"):
        monkeypatch.delenv(name, raising=False)


def cli(*args, env=None):
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run([sys.executable, os.path.join(REPO, "memshelf.py"), *args],
                          capture_output=True, text=True, env=full, timeout=120)


@pytest.fixture
def shelf(tmp_path):
    """Four episodes: estimated, measured over the window, unmeasured, archived."""
    root = str(tmp_path / "shelf")
    memshelf.init(shelf_path=root, storage="plain")
    memshelf.shelve(shelf_path=root, slug="2026-07-22-auth", kind="topic", digest=DIGEST_A,
                    sections={"Decisions": "- JWT"}, approx_tokens=18000)
    memshelf.shelve(shelf_path=root, slug="2026-07-25-redis", kind="research", digest=DIGEST_B,
                    sections={"Findings": "lru wins"}, approx_tokens=300000,
                    approx_tokens_source="measured")
    memshelf.shelve(shelf_path=root, slug="2026-07-26-release", kind="session", digest=DIGEST_C,
                    sections={"Timeline": "- merged", "Open threads": "- changelog"})
    os.makedirs(os.path.join(root, "archive", "docs", "topics"))
    with open(os.path.join(root, "archive", "docs", "topics", "2026-06-01-cache-note.md"),
              "w", encoding="utf-8") as f:
        f.write(ARCHIVED.format(digest=DIGEST_D))
    today = datetime.datetime.now(datetime.timezone.utc).date()
    old = today - datetime.timedelta(days=60)
    with open(os.path.join(root, "recall-log.tsv"), "w", encoding="utf-8") as f:
        f.write("episode_id\tsection\tfetched_tokens\tdate\n"
                "2026-07-22-auth\t\t500\n"
                f"2026-07-22-auth\tDecisions\t40\t{today.isoformat()}\n"
                f"2026-07-25-redis\t\t250000\t{today.isoformat()}\n"
                f"2026-07-26-release\tTimeline\t100\t{old.isoformat()}\n"
                "2026-07-22-auth\tbroken row\n")
    return root


def index_tokens(root):
    with open(os.path.join(root, "INDEX.md"), encoding="utf-8") as f:
        return len(f.read()) // 4


def test_numbers_by_hand(shelf):
    r = memshelf.stats(shelf_path=shelf)
    idx = index_tokens(shelf)
    # archived episodes are counted apart: their digests are not loaded, their mass is held
    # by a rollup (issue 30)
    digests = len(DIGEST_A) // 4 + len(DIGEST_B) // 4 + len(DIGEST_C) // 4
    with open(os.path.join(shelf, "INDEX.md"), encoding="utf-8") as f:
        entry_lines = [l for l in f.read().splitlines() if l.startswith("- ")]
    assert r["status"] == "ok"
    assert r["episodes"] == 3 and r["episodes_archived"] == 1 and r["archived_mass"] == 5000
    assert r["index_tokens"] == idx and r["index_entries"] == 3
    assert r["index_tokens_per_entry"] == round(sum(map(len, entry_lines)) / 4 / 3, 1) > 0
    assert r["digest_tokens"] == digests
    assert r["standing_index_only"] == idx and r["standing_cost"] == idx + digests
    assert r["work_volume"] == 18000 + 300000
    assert r["shelved_mass"] == 18000 + 200000
    assert r["capped_episodes"] == 1 and r["context_window"] == 200000
    assert r["unmeasured_episodes"] == 1
    assert r["unmeasured_digest_tokens"] == len(DIGEST_C) // 4
    assert r["compression_ratio"] == round(218000 / (idx + digests - len(DIGEST_C) // 4), 1)
    # realized: the redis recall fetched more than its capped mass, the session is unmeasured
    assert r["recalls"] == 4 and r["episodes_recalled"] == 3
    assert r["fetched_tokens"] == 500 + 40 + 250000 + 100
    assert r["realized_savings"] == (18000 - 500) + (18000 - 40)
    assert r["recall_cost_per_question"] == idx + (100 + 500) / 2
    assert r["recalls_30d"] == 2
    assert r["ledger_lag"] == 1          # the archived episode was placed by hand
    assert "note" not in r
    h = memshelf._human_count
    assert r["banner"] == (
        f"memshelf: 3 episodes (+1 archived) · standing {h(idx + digests)} tok (INDEX {h(idx)} "
        f"+ digests {h(digests)}) · holds ~218K est. ({r['compression_ratio']}:1) · "
        "1 unmeasured · 1 clipped to a 200K window · realized saved 35K")
    memshelf.rebuild(shelf_path=shelf)
    assert memshelf.stats(shelf_path=shelf)["ledger_lag"] == 0


def test_same_numbers_from_cache_columns_and_from_the_files(shelf):
    # stats reads summary columns of the cache; a cold cache parses the files instead
    shutil.rmtree(os.path.join(shelf, ".memshelf"), ignore_errors=True)
    cold = memshelf.stats(shelf_path=shelf, per_episode=True)
    warm = memshelf.stats(shelf_path=shelf, per_episode=True)
    assert cold == warm
    assert [e["archived"] for e in warm["per_episode"]] == [True, False, False, False]
    charted = memshelf.stats(shelf_path=shelf, per_episode=True, chart=True)
    charted.pop("chart")
    assert charted == warm


def test_window_cap(shelf, monkeypatch):
    r = memshelf.stats(shelf_path=shelf, context_window=10000)
    assert r["shelved_mass"] == 10000 + 10000   # the archived episode's 5000 counted apart
    assert r["capped_episodes"] == 2
    assert r["realized_savings"] == (10000 - 500) + (10000 - 40)
    assert "2 clipped to a 10K window" in r["banner"]
    monkeypatch.setenv("MEMSHELF_CONTEXT_WINDOW", "20000")
    assert memshelf.stats(shelf_path=shelf)["context_window"] == 20000
    monkeypatch.delenv("MEMSHELF_CONTEXT_WINDOW")
    with open(os.path.join(shelf, "memshelf.json"), "w", encoding="utf-8") as f:
        json.dump({"derived": "auto", "context_window": 30000}, f)
    assert memshelf.stats(shelf_path=shelf)["context_window"] == 30000
    assert memshelf.stats(shelf_path=shelf, context_window=40000)["context_window"] == 40000


def test_per_episode_breakdown(shelf):
    r = memshelf.stats(shelf_path=shelf, per_episode=True)
    rows = {row["id"]: row for row in r["per_episode"]}
    assert set(rows) == {"2026-07-22-auth", "2026-07-25-redis", "2026-07-26-release",
                         "2026-06-01-cache-note"}
    auth = rows["2026-07-22-auth"]
    assert (auth["recalls"], auth["fetched_tokens"], auth["realized_savings"]) == \
        (2, 540, 17500 + 17960)
    assert rows["2026-07-25-redis"]["capped"] is True
    assert rows["2026-07-25-redis"]["mass"] == 200000
    assert rows["2026-07-26-release"]["approx_tokens_source"] == "unmeasured"
    assert rows["2026-07-26-release"]["mass"] == 0
    assert rows["2026-06-01-cache-note"]["archived"] is True
    assert sum(row["realized_savings"] for row in r["per_episode"]) == r["realized_savings"]
    assert "per_episode" not in memshelf.stats(shelf_path=shelf)


def test_no_recalls_note_and_banner_key(tmp_path):
    root = str(tmp_path / "empty")
    memshelf.init(shelf_path=root, storage="plain")
    r = memshelf.stats(shelf_path=root)
    assert r["episodes"] == 0 and r["recalls"] == 0
    assert r["recall_cost_per_question"] is None
    assert r["compression_ratio"] == 0.0
    assert "note" in r and r["banner"].startswith("memshelf: 0 episodes")


def test_chart(shelf):
    memshelf.rebuild(shelf_path=shelf)
    svg = os.path.join(shelf, "stats.svg")
    with open(svg, "rb") as f:
        rebuilt = f.read()
    os.remove(svg)
    r = memshelf.stats(shelf_path=shelf, chart=True)
    assert r["chart"] == "stats.svg"
    with open(svg, "rb") as f:
        assert f.read() == rebuilt
    # drawn from the records, it is the chart 0.4.0 draws from the ledger's text
    with open(os.path.join(shelf, "ledger.tsv"), encoding="utf-8") as f:
        sums = memshelf._chart_sums(chart_rows(f.read()))
    assert memshelf._render_chart(sums).encode() == rebuilt


@pytest.mark.slow
def test_chart_with_nothing_to_chart(tmp_path):
    root = str(tmp_path / "empty")
    memshelf.init(shelf_path=root, storage="plain")
    r = cli("stats", "--shelf", root, "--chart")
    assert r.returncode == 1
    assert "nothing to chart" in r.stderr
    assert not os.path.exists(os.path.join(root, "stats.svg"))


@pytest.mark.slow
def test_cli_banner_json_and_bad_input(shelf, tmp_path):
    r = cli("stats", "--shelf", shelf, "--banner")
    assert r.returncode == 0
    assert r.stdout == memshelf.stats(shelf_path=shelf)["banner"] + "\n"
    r = cli("stats", "--shelf", shelf, "--json")
    data = json.loads(r.stdout)
    assert data["banner"].startswith("memshelf: 3 episodes (+1 archived)")
    assert r.returncode == 0
    r = cli("stats", "--shelf", shelf, "--context-window", "-5")
    assert r.returncode == 2
    r = cli("stats", "--shelf", shelf, "--context-window", "0")
    assert r.returncode == 2
    with pytest.raises(memshelf.ShelfError) as exc:
        memshelf.stats(shelf_path=shelf, context_window=-1)
    assert exc.value.code == "usage"
    r = cli("stats", "--shelf", str(tmp_path / "not-here"))
    assert r.returncode == 1
    assert "not a shelf" in r.stderr or "does not exist" in r.stderr


def test_interop_fixture_numbers(tmp_path):
    """memshelf-mcp 0.4.0's stats on its own fixture shelf: the same claimed and realized
    numbers (its recall log has 3-cell rows)."""
    root = str(tmp_path / "fx")
    shutil.copytree(FIXTURE, root)
    r = memshelf.stats(shelf_path=root)
    assert (r["episodes"], r["index_tokens"], r["digest_tokens"], r["standing_cost"]) == \
        (7, 359, 365, 724)
    assert (r["shelved_mass"], r["work_volume"], r["compression_ratio"]) == \
        (139000, 139000, 203.2)
    assert (r["recalls"], r["episodes_recalled"], r["fetched_tokens"],
            r["realized_savings"]) == (2, 2, 219, 58781)
    assert (r["unmeasured_episodes"], r["unmeasured_digest_tokens"]) == (1, 40)
    assert r["recalls_30d"] == 0 and r["ledger_lag"] == 0
    assert r["banner"] == ("memshelf: 7 episodes · standing 724 tok (INDEX 359 + digests "
                           "365) · holds ~139K est. (203.2:1) · 1 unmeasured · realized saved "
                           "59K")
