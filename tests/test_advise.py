"""advise: the window breakdown from caller-reported occupants, verified "already shelved"
claims, proposals net of the measured per-episode standing cost; it writes nothing."""
import json
import random
import shutil

import pytest

import memshelf
from conftest import git, run_cli, snapshot


def put(root, slug, **kw):
    return memshelf.shelve(shelf_path=str(root), slug=slug, kind="topic",
                           digest=kw.pop("digest", f"Dana chose the {slug[11:]} plan; open: "
                                                   "a follow-up review."),
                           sections={"Decisions": "- Decided."}, **kw)


@pytest.fixture(scope="module")
def small_template(tmp_path_factory):
    """Two live episodes and one archived one (under a rollup): four episodes in all."""
    root = tmp_path_factory.mktemp("small") / "shelf"
    memshelf.init(shelf_path=str(root), hooks=False)
    put(root, "2026-01-05-auth-refactor", display_title="Auth refactor")
    put(root, "2026-01-06-old-cache")
    put(root, "2026-02-01-redis-cache")
    memshelf.rollup(shelf_path=str(root), slug="2026-01-31-january",
                    episode_ids=["2026-01-06-old-cache"],
                    digest="January: Dana chose the cache plan. Open: review.")
    return root


@pytest.fixture(scope="module")
def big_template(tmp_path_factory):
    """Eight episodes with long titles: the standing cost is measured, INDEX is heavy."""
    root = tmp_path_factory.mktemp("big") / "shelf"
    memshelf.init(shelf_path=str(root), hooks=False)
    for day in range(1, 9):
        put(root, f"2026-03-{day:02d}-a-rather-long-episode-slug-number-{day}",
            display_title=f"Title {day} " + "x" * 190,
            description="A description that runs on for the whole width allowed. " * 3)
    return root


@pytest.fixture
def small(small_template, tmp_path):
    root = tmp_path / "shelf"
    shutil.copytree(small_template, root, symlinks=True)
    return root


@pytest.fixture
def big(big_template, tmp_path):
    root = tmp_path / "shelf"
    shutil.copytree(big_template, root, symlinks=True)
    return root


def advise(root, occupants=(), **kw):
    return memshelf.call_tool("memshelf_advise", dict({"shelf_path": str(root),
                                                       "occupants": list(occupants)}, **kw))


OCCUPANTS = [
    {"label": "system prompt", "approx_tokens": 8000, "kind": "instructions"},
    {"label": "billing topic", "approx_tokens": 30000, "state": "closed", "kind": "topic"},
    {"label": "stale research", "approx_tokens": 5000, "idle_turns": 12, "kind": "research"},
    {"label": "fresh thread", "approx_tokens": 4000, "idle_turns": 3},
    {"label": "current work", "approx_tokens": 7000, "state": "live"},
    {"label": "tiny closed", "approx_tokens": 1500, "state": "closed"},
    {"label": "auth notes", "approx_tokens": 6000, "state": "live",
     "episode_id": "2026-01-05-auth-refactor"},
    {"label": "old cache notes", "approx_tokens": 3000, "episode_id": "2026-01-06-old-cache.md"},
    {"label": "claimed but missing", "approx_tokens": 9000, "state": "closed",
     "episode_id": "2026-09-09-never-shelved"},
    {"label": "Auth refactor", "approx_tokens": 100},
]


def test_breakdown_arithmetic_and_verified_claims(small):
    r = advise(small, OCCUPANTS)
    st = memshelf.stats(shelf_path=str(small))
    assert r["episodes_on_shelf"] == 4
    assert r["episode_standing_cost"] == 200 and r["min_proposal_tokens"] == 2000
    assert r["memory_overhead"] == st["standing_cost"] == r["breakdown"]["memory"]
    assert r["index_tokens"] == st["index_tokens"]
    assert r["breakdown"]["static"] == 8000
    assert r["breakdown"]["live"] == 4000 + 7000 + 100
    assert r["breakdown"]["reclaimable"] == 30000 + 5000 + 1500 + 6000 + 3000 + 9000
    total = sum(o["approx_tokens"] for o in OCCUPANTS)
    assert r["accounted_tokens"] == total + r["memory_overhead"]
    assert r["headroom_tokens"] == 200000 - r["accounted_tokens"]
    got = [(p["action"], p["target"], p["tokens"]) for p in r["proposals"]]
    assert got == [("shelve", "billing topic", 29800),
                   ("shelve", "claimed but missing", 8800),
                   ("drop", "auth notes", 6000),
                   ("shelve", "stale research", 4800),
                   ("drop", "old cache notes", 3000)]
    assert r["reclaimable_tokens"] == sum(p["tokens"] for p in r["proposals"])
    drops = {p["target"]: p for p in r["proposals"] if p["action"] == "drop"}
    assert "--id 2026-01-05-auth-refactor --section" in drops["auth notes"]["command"]
    assert "archived as 2026-01-06-old-cache" in drops["old cache notes"]["why"]
    shelve = next(p for p in r["proposals"] if p["target"] == "stale research")
    assert "--kind research" in shelve["command"] and "--approx-tokens 5000" in shelve["command"]
    assert "idle for 12 turns" in shelve["why"]
    notes = "\n".join(r["notes"])
    assert "'claimed but missing' claims episode '2026-09-09-never-shelved'" in notes
    assert "dropping it would lose it" in notes
    assert "'Auth refactor' matches shelved episode '2026-01-05-auth-refactor'" in notes
    assert "1 reclaimable occupant(s) under 2000 tokens" in notes
    assert "1 occupant(s) reported neither a state nor idle turns" in notes
    assert r["summary"].startswith("context: ")
    assert "shelve  billing topic" in r["summary"]


def test_proposals_do_not_depend_on_input_order(small):
    first = advise(small, OCCUPANTS)
    shuffled = list(OCCUPANTS)
    random.Random(7).shuffle(shuffled)
    second = advise(small, shuffled)
    assert first["proposals"] == second["proposals"]
    assert first["breakdown"] == second["breakdown"]
    same = [{"label": "b", "approx_tokens": 5000, "state": "closed"},
            {"label": "a", "approx_tokens": 5000, "state": "closed"},
            {"label": "c", "approx_tokens": 5200, "episode_id": "2026-01-05-auth-refactor"}]
    order = [(p["action"], p["target"]) for p in advise(small, same)["proposals"]]
    assert order == [("drop", "c"), ("shelve", "a"), ("shelve", "b")]


@pytest.mark.slow
def test_standing_cost_is_measured_on_a_shelf_of_five_or_more(big):
    r = advise(big, [{"label": "done", "approx_tokens": 20000, "state": "closed"}])
    # the spec's measure, recomputed here from the files: mean INDEX line + mean digest
    index = (big / "INDEX.md").read_text(encoding="utf-8")
    lines = [l for l in index.split("\n") if l.startswith("- ")]
    ledger = (big / "ledger.tsv").read_text(encoding="utf-8").strip().split("\n")[1:]
    digests = [int(row.split("\t")[4]) for row in ledger]
    expected = round(sum((len(l) + 1) / 4 for l in lines) / len(lines) +
                     sum(digests) / len(digests))
    assert r["episode_standing_cost_source"] == "measured"
    assert r["episode_standing_cost"] == expected and expected != 200
    assert r["min_proposal_tokens"] == 10 * expected
    shelve = next(p for p in r["proposals"] if p["action"] == "shelve")
    assert shelve["tokens"] == 20000 - expected
    assert f"~{expected} tokens (measured)" in shelve["why"]


def test_rollup_proposed_when_index_outgrows_three_percent(big):
    r = advise(big, budget_tokens=10000)
    assert r["index_tokens"] > 300          # 3 % of the window
    roll = [p for p in r["proposals"] if p["action"] == "rollup"]
    assert len(roll) == 1
    p = roll[0]
    count, _, until = p["target"].partition(" episodes through ")
    assert int(count) >= 2 and memshelf._is_iso_date(until)
    assert f"--until {until}" in p["command"] and p["command"].startswith("memshelf rollup ")
    assert p["tokens"] > 0
    # INDEX is also over its per-entry budget here, which a rollup does not fix
    assert r["index_tokens"] > r["index_budget_tokens"]
    assert any("per-entry budget" in n and "index-bloat" in n for n in r["notes"])
    assert r["notes"][0].startswith("no occupants reported")
    # a large window: no rollup
    assert not [p for p in advise(big)["proposals"] if p["action"] == "rollup"]
    # the proposed command is a working rollup
    done = memshelf.rollup(shelf_path=str(big), slug=f"{until}-rollup", until=until,
                           digest="March work: Dana chose each plan. Open: review.")
    assert done["count"] == int(count)


def test_exclude_self_and_summary_only(small):
    r = run_cli("advise", "--shelf", small, "--occupant", "x=1000", "--exclude-self", "--json")
    assert r.code == 0, r
    res = r.json()
    assert res["memory_overhead"] == 0 and res["breakdown"]["memory"] == 0
    assert res["accounted_tokens"] == 1000
    r = run_cli("advise", "--shelf", small, "--occupant", "big=50000,closed", "--summary")
    assert r.code == 0, r
    assert r.out.strip().startswith("context: ") and len(r.out.strip().split("\n")) == 1
    r = run_cli("advise", "--shelf", small, "--occupant", "big=50000,closed")
    assert "$ memshelf shelve --shelf" in r.out


def test_cli_occupant_specs(small, tmp_path):
    r = run_cli("advise", "--shelf", small, "--json",
                "--occupant", "notes, with a comma=12000,closed,kind=research",
                "--occupant", "a label=3000,idle=15",
                "--occupant", "shelved=4000,live,episode=2026-02-01-redis-cache",
                "--occupant", "rules=900,kind=instructions",
                "--occupant", "mystery=700,unknown")
    assert r.code == 0, r
    res = r.json()
    got = {p["target"]: (p["action"], p["tokens"]) for p in res["proposals"]}
    assert got == {"notes, with a comma": ("shelve", 11800), "a label": ("shelve", 2800),
                   "shelved": ("drop", 4000)}
    assert res["breakdown"]["static"] == 900 and res["breakdown"]["live"] == 700
    # the JSON file form and stdin carry objects
    occ = [{"label": "from file", "approx_tokens": 6000, "state": "closed"}]
    path = tmp_path / "occ.json"
    path.write_text(json.dumps(occ))
    for args, stdin in ((["--occupants-json", path], None),
                        (["--occupants-json", "-"], json.dumps({"occupants": occ}))):
        r = run_cli("advise", "--shelf", small, "--json", *args, input=stdin)
        assert r.code == 0, r
        assert r.json()["proposals"][0]["target"] == "from file"


@pytest.mark.parametrize("spec, words", [
    ("x=12x", "'12x' is not a token count"),
    ("x=", "'' is not a token count"),
    ("noequals", "no '='"),
    ("=500", "label"),
    ("x=500,frozen", "unknown attribute 'frozen'"),
    ("x=500,idle=soon", "idle='soon' is not a number of turns"),
    ("x=500,kind=poem", "unknown kind 'poem'"),
    ("x=500,episode=../etc", "episode id"),
])
def test_malformed_specs_are_usage_errors_naming_the_part(small, spec, words):
    r = run_cli("advise", "--shelf", small, "--occupant", spec)
    assert r.code == 2, r
    assert words in r.err and f"--occupant {spec!r}" in r.err
    assert "Traceback" not in r.err


@pytest.mark.parametrize("occupant, words", [
    ({"label": "x", "approx_tokens": 5, "colour": "red"}, "unknown occupant key 'colour'"),
    ({"label": "x"}, "approx_tokens is required"),
    ({"label": "x", "approx_tokens": -1}, "approx_tokens must be a whole number"),
    ({"label": "x", "approx_tokens": True}, "approx_tokens must be a whole number"),
    ({"label": "x", "approx_tokens": 5, "state": "asleep"}, "unknown state 'asleep'"),
    ({"label": "x", "approx_tokens": 5, "idle_turns": 1.5}, "idle_turns must be"),
    ({"label": "", "approx_tokens": 5}, "label must be"),
    ({"label": "x", "approx_tokens": 5, "episode_id": 7}, "episode_id must be a string"),
    ("x=oops", "not a token count"),
])
def test_mcp_occupant_objects_are_validated(small, occupant, words):
    with pytest.raises(memshelf.ShelfError) as exc:
        advise(small, [{"label": "fine", "approx_tokens": 10}, occupant])
    assert exc.value.code == "usage"
    assert words in exc.value.message
    if isinstance(occupant, dict):
        assert "occupant 2" in exc.value.message


def test_advise_writes_nothing_and_reports_the_shelf_side_alone(small):
    before = snapshot(small), git(small, "rev-parse", "HEAD")
    r = run_cli("advise", "--shelf", small, "--json")
    assert r.code == 0, r
    res = r.json()
    assert res["proposals"] == [] and res["accounted_tokens"] == res["memory_overhead"]
    assert "no occupants reported" in res["notes"][0]
    assert "nothing to propose" in res["summary"]
    advise(small, OCCUPANTS)
    assert (snapshot(small), git(small, "rev-parse", "HEAD")) == before
    r = run_cli("advise", "--shelf", small, "--budget", "0")
    assert r.code == 2
