"""The INDEX a model is handed fits its budget at every shelf size (issue 28).

Driven through the real session-start hook (the CLI as Claude Code runs it) and the real MCP
server: at 60, 600, 6,000 and 60,000 episodes what they serve stays within 9,500 characters,
and every episode id is in the served view or in the answer of the one call a fold line names.
Also: bad budgets and periods, the status field, the default description, doctor and stats.
"""
import bisect
import datetime
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

import memshelf
from conftest import MEMSHELF, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcp_client import McpClient, clean_env  # noqa: E402

SERVER = os.path.join(ROOT, "server.py")
BUDGET = 9500
RFC16 = os.path.join(os.path.dirname(ROOT), "shared", "corpora", "rfc16", "shelf.tar.gz")
WORDS = ("cache billing auth search gateway scheduler queue ledger replica shard mailer export "
         "vpc eks iam terraform ingress rollout canary backup restore kafka postgres redis").split()
VERBS = ("adopt", "reject", "migrate", "split", "merge", "retire", "pin", "tune")
KINDS = (("topic", "topics", "## Decisions\n- Kept.\n"),
         ("research", "research", "## Findings\n- p99 at 40 ms.\n"),
         ("session", "sessions", "## Timeline\n1. Worked.\n\n## Open threads\n- None.\n"))


# --- a shelf of n episodes, written directly (60,000 in a few seconds) ------------------------

def write_shelf(root, n, seed=28, days=1100):
    """A plain shelf with n episodes over three years, ~150-character descriptions, every 97th
    deprecated and every 50th superseding an older one; returns the ids, oldest first."""
    memshelf.init(shelf_path=str(root), storage="plain")
    rng = random.Random(seed)
    first = datetime.date(2023, 1, 1)
    ids = []
    for i in range(n):
        day = (first + datetime.timedelta(days=rng.randrange(days))).isoformat()
        a, b = rng.sample(WORDS, 2)
        verb = rng.choice(VERBS)
        stem = f"{day}-{verb}-{a}-{b}-{i:x}"
        kind, folder, sections = KINDS[i % 3]
        desc = (f"The platform team chose to {verb} the {a} layer in front of {b}, after load "
                f"tests showed p99 regressions; the rollback plan and owners are recorded.")
        extra = "status: deprecated\n" if i % 97 == 5 else ""
        if i % 50 == 49 and ids:
            extra += f"supersedes: [{ids[rng.randrange(len(ids))]}]\n"
        text = (f"# {stem}\n\n---\nid: {stem}\nkind: {kind}\nspan: {day}\ndate: {day}\n"
                f'description: "{desc}"\ntags: [{a}, {b}]\n{extra}approx_tokens: 1200\n'
                f"approx_tokens_source: estimate\nmode: live\n---\n\n## Digest\n"
                f"Dana chose to {verb} the {a} layer for {b}.\n\n{sections}")
        with open(os.path.join(str(root), "docs", folder, stem + ".md"), "w",
                  encoding="utf-8") as f:
            f.write(text)
        ids.append(stem)
    return ids


_SHELVES = {}


@pytest.fixture(scope="module")
def shelves(tmp_path_factory):
    def make(n):
        if n not in _SHELVES:
            root = tmp_path_factory.mktemp(f"s{n}") / "shelf"
            _SHELVES[n] = (str(root), write_shelf(root, n))
        return _SHELVES[n]
    yield make
    _SHELVES.clear()


# --- reading a served view -----------------------------------------------------------------

def listed_ids(text):
    """Every id a served view shows: full lines, and day lines (date + "-" + name)."""
    ids, section = set(), None
    for line in text.split("\n"):
        if line.startswith("## "):
            section = line
            continue
        if not line.startswith("- "):
            continue
        if section == "## Earlier, by day":
            day, names = line[2:].split(": ", 1)
            for name in names.split(", "):
                ids.add(name.strip("`") if name.startswith("`") else f"{day}-{name}")
        elif section != "## Folded periods":
            m = re.match(r"- (?:`([^`]+)`|(\S+))", line)
            ids.add(m.group(1) or m.group(2))
    return ids


def fold_periods(text, cli):
    """The periods the fold lines name, each with the call in the caller's words."""
    section = text.split("## Folded periods\n", 1)
    if len(section) == 1:
        return []
    periods = []
    for line in section[1].split("\n"):
        if not line.startswith("- "):
            continue
        call = "memshelf index --period " if cli else "memshelf_index period="
        assert call in line, line   # the command for the host that asked
        if "P one of: " in line:
            periods += re.findall(r"([\d.\-]+|undated) \([\d,]+\)", line.split("P one of: ")[1])
        else:
            periods.append(line.rsplit(call, 1)[1].strip('"'))
    return periods


def expansions(root, periods, cli):
    """What the one further call answers for each period, rendered from the same records the
    real calls read (test_each_fold_call_is_the_expansion checks a real call equals it)."""
    with memshelf._Store(root) as store:
        records = [r for r in store.render_records() if not r.archived]
    superseded = memshelf._superseded_map(records)
    records.sort(key=lambda r: r.date)
    dates = [r.date for r in records]
    name = memshelf._docshelf_config(root)["name"]
    out = {}
    for period in periods:
        low, high = memshelf._period_bounds(period)
        inside = records[bisect.bisect_left(dates, low):bisect.bisect_right(dates, high)] \
            if high else [r for r in records if not r.date]
        out[period] = memshelf._served_index(name, inside, superseded, BUDGET, period, cli)[0]
    return out


def mcp_server(root):
    env = clean_env(MEMSHELF_SHELF=str(root))
    client = McpClient([sys.executable, SERVER], env=env, cwd=str(root), timeout=120)
    client.initialize()
    return client


def hook_context(root):
    payload = json.dumps({"session_id": "s-28", "cwd": str(root), "source": "startup",
                          "hook_event_name": "SessionStart"})
    r = run_cli("hook", "session-start", "--shelf", root, input=payload, timeout=300)
    assert r.code == 0, r
    assert len(r.out.rstrip("\n")) <= BUDGET, len(r.out)   # the whole output, JSON and all
    return json.loads(r.out)["hookSpecificOutput"]["additionalContext"]


# --- the served view at every size ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("n", [60, 600, 6000, 60000])
def test_hook_and_mcp_fit_the_budget_and_reach_every_episode(shelves, n):
    root, ids = shelves(n)
    everyone = set(ids)
    ctx = hook_context(root)
    with mcp_server(root) as client:
        result = client.call_tool("memshelf_index", {}, timeout=300)
        served = result["structuredContent"]
        assert len(served["index"]) <= BUDGET and served["entries_total"] == n
        assert "memshelf index --period" not in served["index"]   # tool words over MCP
    for text, cli in ((ctx, True), (served["index"], False)):
        periods = fold_periods(text, cli)
        reached = listed_ids(text)
        for period, answer in expansions(root, periods, cli).items():
            assert len(answer) <= BUDGET
            assert "## Folded periods" not in answer, period   # one call lists the fold
            reached |= listed_ids(answer)
        assert reached == everyone, sorted(everyone - reached)[:5]
        if n >= 600:
            assert periods
        if 600 <= n <= 6000:
            assert "## Earlier, by day" in text
    if n == 60:   # the 60 entries of the shelf: one fold at most, most of them in full
        assert ctx.count("\n- 20") >= 30


@pytest.mark.slow
def test_each_fold_call_is_the_expansion(shelves):
    """The call a fold line names, run for real (CLI and MCP), answers what the test expects."""
    root, _ = shelves(6000)
    ctx = hook_context(root)
    period = fold_periods(ctx, True)[0]
    r = run_cli("index", "--shelf", root, "--period", period)
    assert r.code == 0 and len(r.out) <= BUDGET + 1
    assert r.out == expansions(root, [period], True)[period]
    with mcp_server(root) as client:
        text = client.call_tool("memshelf_index", {})["structuredContent"]["index"]
        period = fold_periods(text, False)[-1]
        answer = client.call_tool("memshelf_index", {"period": period})["structuredContent"]
        assert answer["index"] == expansions(root, [period], False)[period]
        assert answer["view"] == "served" and answer["entries_folded"] == 0
        # the resource serves the view too
        res = client.request("resources/read", {"uri": "memshelf://index"})
        assert len(res["contents"][0]["text"]) <= BUDGET


def test_served_view_is_deterministic_and_demotes_superseded_and_deprecated(shelves):
    root, ids = shelves(600)
    first = memshelf.index(shelf_path=root, budget=4000)
    assert first == memshelf.index(shelf_path=root, budget=4000)
    assert len(first["index"]) <= 4000 and first["view"] == "served"
    full = {m.group(1) for m in re.finditer(r"^- (\S+) — ", first["index"], re.M)}
    assert full
    deprecated = {ids[i] for i in range(5, len(ids), 97)}
    superseded = set(memshelf._superseded_map(
        memshelf._Store(root).render_records()))
    assert not full & (deprecated | superseded)   # they give up their full line first
    newest_kept = [i for i in sorted(ids, reverse=True)
                   if i not in deprecated and i not in superseded][:len(full)]
    assert set(newest_kept) == full


def test_a_small_index_is_served_whole(tmp_path):
    root = str(tmp_path / "shelf")
    write_shelf(root, 5)
    memshelf.rebuild(shelf_path=root)
    res = memshelf.call_tool("memshelf_index", {"shelf_path": root})
    with open(os.path.join(root, "INDEX.md"), encoding="utf-8") as f:
        assert res["index"] == f.read() and res["view"] == "full"
    # the file on disk keeps every entry, whatever the budget
    run = memshelf.index(shelf_path=root, budget=1000)
    assert run["view"] == "served" and len(run["index"]) <= 1000


# --- bad input: exit 2 and nothing written; over MCP an error and the server serves on ---------

def tree(root):
    out = {}
    for base, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".memshelf"]
        for name in files:
            path = os.path.join(base, name)
            out[path] = os.stat(path).st_mtime_ns
    return out


@pytest.mark.slow
@pytest.mark.parametrize("args, said", [
    (["--budget", "0"], "budget must be a whole number"),
    (["--budget", "999"], "at least 1000"),
    (["--budget", "abc"], "not an integer"),
    (["--period", "20x7"], "is not YYYY"),
    (["--period", "2017-13"], "is not YYYY"),
    (["--period", "2018..2017"], "in order"),
    (["--period", "2017", "--category", "topics"], "do not combine"),
])
def test_bad_budget_or_period_on_the_cli(shelves, args, said):
    root, _ = shelves(60)
    before = tree(root)
    r = run_cli("index", "--shelf", root, *args)
    assert r.code == 2 and said in r.err and not r.out, r
    assert tree(root) == before


def test_bad_budget_or_period_over_mcp(shelves):
    root, _ = shelves(60)
    with mcp_server(root) as client:
        for arguments in ({"budget": 0}, {"budget": "abc"}, {"period": "20x7"},
                          {"period": "2017-02-30"}, {"period": 2017}):
            result = client.request("tools/call", {"name": "memshelf_index",
                                                   "arguments": arguments})
            assert result.get("isError") is True, arguments
        assert client.call_tool("memshelf_index", {"period": "2024"})["structuredContent"][
            "entries_total"] > 0   # still serving


# --- status ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_status_round_trips(tmp_path):
    root = str(tmp_path / "shelf")
    assert run_cli("init", "--shelf", root).code == 0
    shelve = ["shelve", "--shelf", root, "--kind", "topic", "--section", "Decisions=- Kept."]
    r = run_cli(*shelve, "--slug", "2024-03-01-old-queue", "--status", "deprecated",
                "--digest", "Dana chose the old queue for billing; Bo rejected polling.")
    assert r.code == 0, r
    run_cli(*shelve, "--slug", "2024-03-02-new-plan", "--status", "proposed",
            "--digest", "Bo proposed a new plan for billing retries.")
    run_cli(*shelve, "--slug", "2024-03-03-kept", "--status", "accepted",
            "--digest", "Dana chose to keep the ledger as it is.")
    index = memshelf.index(shelf_path=root)["index"]
    assert re.search(r"^- 2024-03-01-old-queue — .* \[deprecated\]$", index, re.M)
    assert re.search(r"^- 2024-03-02-new-plan — .* \[proposed\]$", index, re.M)
    assert re.search(r"^- 2024-03-03-kept — [^\[]*$", index, re.M)   # accepted: no mark
    # amend keeps it; rebuild renders the same; recall says it
    r = run_cli(*shelve, "--slug", "2024-03-01-old-queue", "--amend",
                "--digest", "Dana chose the old queue for billing; Bo rejected polling twice.")
    assert r.code == 0, r
    with open(os.path.join(root, "docs", "topics", "2024-03-01-old-queue.md"),
              encoding="utf-8") as f:
        assert "\nstatus: deprecated\n" in f.read()
    with open(os.path.join(root, "INDEX.md"), encoding="utf-8") as f:
        before = f.read()
    assert "[deprecated]" in before
    assert run_cli("rebuild", "--shelf", root, "--full").code == 0
    with open(os.path.join(root, "INDEX.md"), encoding="utf-8") as f:
        assert f.read() == before
    rec = memshelf.recall(shelf_path=root, episode_id="2024-03-01-old-queue", log=False)
    assert rec["episode_status"] == "deprecated" and "Its status is deprecated." in rec["content"]
    assert memshelf.recall(shelf_path=root, episode_id="2024-03-03-kept",
                           log=False)["episode_status"] == "accepted"
    # a status can be set back; an unknown one is refused before anything is written
    r = run_cli(*shelve, "--slug", "2024-03-02-new-plan", "--amend", "--status", "accepted",
                "--digest", "Bo proposed a new plan for billing retries; Dana accepted it.")
    assert r.code == 0 and "[proposed]" not in memshelf.index(shelf_path=root)["index"]
    before = tree(root)
    r = run_cli(*shelve, "--slug", "2024-03-04-x", "--status", "obsolete", "--digest", "Bo chose x.")
    assert r.code == 2 and "status" in r.err and tree(root) == before


def test_status_over_mcp_and_in_the_served_view(tmp_path):
    root = str(tmp_path / "shelf")
    write_shelf(root, 5)
    res = memshelf.call_tool("memshelf_shelve", {
        "shelf_path": root, "slug": "2024-06-01-dropped-plan", "kind": "topic",
        "digest": "Dana chose to drop the plan.", "sections": {"Decisions": "- Dropped."},
        "status": "deprecated"})
    assert res["status"] == "ok"
    view = memshelf.index(shelf_path=root, budget=1000)["index"]
    assert "2024-06-01" in view and "dropped-plan" in view
    with pytest.raises(memshelf.ShelfError):
        memshelf.call_tool("memshelf_shelve", {
            "shelf_path": root, "slug": "2024-06-02-x", "kind": "topic", "digest": "Bo chose x.",
            "sections": {"Decisions": "- x"}, "status": "superseded"})


# --- the default description ----------------------------------------------------------------

_BOUNDARY_AFTER = re.compile(r"(?:[,;:]\s|\s[—–-]\s|\s\(|[.!?。！？；，]|\Z)")


def ends_at_clause(description, digest):
    """The description is the digest's text (its first letter maybe capitalised) up to a
    clause end: what follows it in the digest opens a new clause, or it ends a sentence."""
    flat = " ".join(digest.split())
    at = flat.find(description[1:])
    if at < 1:
        return False
    before, after = flat[:at - 1], flat[at - 1 + len(description):]
    whole_start = not before or not before[-1].isalnum()
    return whole_start and (description[-1] in ".!?" or bool(_BOUNDARY_AFTER.match(after)))


@pytest.mark.slow
def test_rfc16_default_descriptions_end_at_a_clause(tmp_path):
    if not os.path.exists(RFC16):
        pytest.skip("the rfc16 corpus is not here")
    with tarfile.open(RFC16) as tar:
        tar.extractall(str(tmp_path))
    root = os.path.join(str(tmp_path), "shelf.orig")
    # the shelf renders byte for byte as it was written
    assert run_cli("rebuild", "--shelf", root, "--check").code == 0
    with memshelf._Store(root) as store:
        records = store.records()
    assert len(records) == 16
    for rec in records:
        title = rec.display_title
        desc = memshelf._default_description(rec.digest, title)
        assert desc and len(desc) <= memshelf.MAX_DESCRIPTION_CHARS and "…" not in desc
        assert ends_at_clause(desc, rec.digest), (rec.stem, desc)
        assert title.casefold() not in desc.casefold()
        number = re.match(r"RFC \d+", title).group(0)
        assert not desc.startswith(number), desc   # the title's words are not repeated
    # shelve derives it when no description is given, and keeps a given one as it is
    rec = records[0]
    r = run_cli("shelve", "--shelf", root, "--slug", "2024-01-01-rfc-copy", "--kind", "research",
                "--digest", rec.digest, "--section", "Findings=- copy",
                "--display-title", rec.display_title, "--no-commit")
    assert r.code == 0, r
    fields = memshelf.parse_frontmatter(open(os.path.join(
        root, "docs", "research", "2024-01-01-rfc-copy.md"), encoding="utf-8").read())[0]
    assert fields["description"] == memshelf._default_description(
        rec.digest, rec.display_title)
    given = "Kept exactly; as the writer put it, commas and all."
    r = run_cli("shelve", "--shelf", root, "--slug", "2024-01-02-rfc-given", "--kind", "research",
                "--digest", rec.digest, "--section", "Findings=- copy", "--description", given,
                "--no-commit")
    assert r.code == 0 and f'description: "{given}"' in open(os.path.join(
        root, "docs", "research", "2024-01-02-rfc-given.md"), encoding="utf-8").read()
    assert "120" in run_cli("shelve", "--help").out


def test_fuzzed_digests_get_descriptions_at_a_clause(tmp_path):
    rng = random.Random(2028)
    vocab = ("Dana Bo Priya chose kept rejected the a cache billing queue for over because with "
             "latency load retries owner tier layer option plan v2 rollout API p99 ms 40 JSON "
             "Kubernetes migration cluster").split()
    joints = (", ", "; ", ": ", " — ", " (", " and ", " ", " ", " ", " ")
    for _ in range(400):
        sentences = []
        for _ in range(rng.randrange(1, 5)):
            words = [rng.choice(vocab) for _ in range(rng.randrange(3, 40))]
            text = words[0].capitalize()
            for n, word in enumerate(words[1:]):
                # clauses of at most ~14 words: real prose has a clause end within the cap
                joint = rng.choice(joints) if n % 14 else ", "
                text += joint + word + (")" if joint == " (" else "")
            sentences.append(text + rng.choice(".!?"))
        digest = " ".join(sentences)
        title = " ".join(rng.sample(vocab, 2)) if rng.random() < 0.5 else None
        desc = memshelf._default_description(digest, title)
        assert desc and len(desc) <= memshelf.MAX_DESCRIPTION_CHARS and "…" not in desc, digest
        assert ends_at_clause(desc, digest), (digest, desc)
    # the decision's sentence, not metadata; code spans hold no sentence end; no title twice
    assert memshelf._default_description(
        "ADR 0001 records decisions (dated 2017-06-30, status Accepted). Dana decided to keep "
        "one file per decision.") == "Dana decided to keep one file per decision."
    assert memshelf._default_description(
        "Priya added a `catch { .. }` block that scopes `?`. Bo asked why.") == \
        "Priya added a `catch { .. }` block that scopes `?`."
    assert memshelf._default_description(
        "RFC 560 (integer overflow) makes overflow a program error in debug builds.",
        "RFC 560: integer overflow") == "Makes overflow a program error in debug builds."
    # one clause longer than the cap: whole words, still no ellipsis
    long_clause = " ".join(["word"] * 60) + "."
    desc = memshelf._default_description(long_clause)
    assert len(desc) <= 120 and "…" not in desc and desc.endswith("word.")


# --- doctor and stats -----------------------------------------------------------------------

@pytest.mark.slow
def test_doctor_warns_and_stats_measures_against_the_budget(shelves):
    root, _ = shelves(600)
    memshelf.rebuild(shelf_path=root)
    found = [f for f in memshelf.doctor(shelf_path=root)["findings"]
             if f["code"] == "index-injection-cap"]
    assert found and found[0]["level"] == "warning"
    assert "folds" in found[0]["detail"] and "period" in found[0]["detail"]
    stats = memshelf.stats(shelf_path=root)
    assert stats["index_chars"] > stats["index_budget_chars"] == BUDGET
    assert stats["served_index_chars"] <= BUDGET and stats["served_index_folded"] > 0
    r = run_cli("stats", "--shelf", root)
    assert r.code == 0 and "9,500-char budget" in r.out and "served view" in r.out
