"""What search says about the query's words (issue 29), through the CLI and the MCP server:
which words matched and which matched nothing, stems (`retries` finds `retry`), identifiers
matched whole, `-1` as a word, and no hit without a query word."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import memshelf  # noqa: E402

MEMSHELF = os.path.join(ROOT, "memshelf.py")
SERVER = os.path.join(ROOT, "server.py")

EPISODES = [
    dict(slug="2026-02-01-http-client-retry", kind="topic",
         digest="The platform team chose one retry policy for every HTTP client. Open: none.",
         sections={"Decisions": "Retry idempotent calls three times with jittered backoff.",
                   "Artifacts": "- the prototype client in tools/proto-client"}),
    dict(slug="2026-02-02-service-mesh", kind="topic",
         digest="The platform team kept plain Kubernetes services and no mesh. Open: none.",
         sections={"Decisions": "No service mesh for now; mTLS terminates at the ingress.",
                   "Rejected alternatives": "A sidecar per pod doubled memory use."}),
    dict(slug="2026-02-03-integer-division", kind="research",
         digest="Sam measured what INT_MIN / -1 does on each target. Open: none.",
         sections={"Findings": "INT_MIN / -1 traps on x86 and wraps on ARM; 1 is never a "
                               "divisor that traps.",
                   "Decisions": "Check the divisor -1 explicitly before dividing."}),
    dict(slug="2026-02-04-js-globals", kind="topic",
         digest="The web team froze the _$proto global of the old bundle. Open: none.",
         sections={"Decisions": "Keep _$proto read-only; new code uses the module loader."}),
]


@pytest.fixture(scope="module")
def shelf(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("terms") / "shelf")
    memshelf.init(root, storage="plain")
    for ep in EPISODES:
        memshelf.shelve(root, **ep)
    return root


def cli(*args):
    return subprocess.run([sys.executable, "-m", "memshelf", *args], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, MEMSHELF_SEMANTIC="off"))


def cli_json(*args):
    r = cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def pairs(result):
    return [(h["id"], h["section"]) for h in result["hits"]]


# --- the CLI ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_unmatched_words_are_named(shelf):
    r = cli_json("search", "--shelf", shelf, "service", "mesh", "Istio", "Linkerd")
    assert r["unmatched"] == ["istio", "linkerd"] and r["matched"] == ["service", "mesh"]
    assert r["hits"] and all(set(h["terms"]) <= {"service", "mesh"} and h["terms"]
                             for h in r["hits"])
    text = cli("search", "--shelf", shelf, "service", "mesh", "Istio", "Linkerd").stdout
    assert "unmatched: istio, linkerd (on no section)" in text
    assert "(service, mesh)" in text.splitlines()[0]


@pytest.mark.slow
def test_a_stem_finds_its_inflections(shelf):
    r = cli_json("search", "--shelf", shelf, "retries")
    assert r["unmatched"] == [] and r["hits"]
    assert ("2026-02-01-http-client-retry", "Decisions") in pairs(r)
    assert all(h["terms"] == ["retries"] for h in r["hits"])


@pytest.mark.slow
def test_an_identifier_matches_whole(shelf):
    r = cli_json("search", "--shelf", shelf, "_$proto")
    assert {h["id"] for h in r["hits"]} == {"2026-02-04-js-globals"}   # never `prototype`
    r = cli_json("search", "--shelf", shelf, "proto")        # a plain word: no prefix either
    assert "prototype" not in json.dumps([h["snippet"] for h in r["hits"]]).lower() or \
        all("proto-client" in h["snippet"] or "_$proto" in h["snippet"] for h in r["hits"])
    r = cli_json("search", "--shelf", shelf, "proto-client")
    assert pairs(r) == [("2026-02-01-http-client-retry", "Artifacts")]


@pytest.mark.slow
def test_minus_one_is_a_word(shelf):
    r = cli_json("search", "--shelf", shelf, "INT_MIN", "/", "-1")
    assert r["hits"] and r["hits"][0]["id"] == "2026-02-03-integer-division"
    assert "1" in r["hits"][0]["terms"]
    # a dash before a letter still excludes
    r = cli_json("search", "--shelf", shelf, "team", "-mesh")
    assert "2026-02-02-service-mesh" not in {h["id"] for h in r["hits"]} and r["hits"]


@pytest.mark.slow
def test_no_hit_without_a_query_word(shelf):
    # "platform team" is in two digests; sections that do not hold it are no hits
    r = cli_json("search", "--shelf", shelf, "platform", "--max-results", "50")
    assert r["hits"] and all(h["terms"] == ["platform"] for h in r["hits"])
    assert {h["section"] for h in r["hits"]} == {"Digest"}
    for h in r["hits"]:
        body = memshelf.recall(shelf, h["id"], section=h["section"], log=False)["content"]
        assert "platform" in body.lower()
    none = cli("search", "--shelf", shelf, "recovery", "objective")
    assert none.returncode == 0 and none.stdout.strip() == "no hits for 'recovery objective'"
    # `times` is held as `time` (stemmed): the hit says which word it holds
    r = cli_json("search", "--shelf", shelf, "recovery", "time")
    assert [h["terms"] for h in r["hits"]] == [["time"]] and r["unmatched"] == ["recovery"]


@pytest.mark.slow
def test_typo_suggestion_is_labelled_when_it_runs(shelf):
    r = cli_json("search", "--shelf", shelf, "retyr")
    assert r["hits"] == [] or r.get("corrected_query")
    r = cli_json("search", "--shelf", shelf, "jitterd")
    assert r["did_you_mean"] == ["jittered"] and r["corrected_query"] == "jittered"
    text = cli("search", "--shelf", shelf, "jitterd").stdout
    assert text.startswith("no hits for 'jitterd'; hits for 'jittered':\n")


@pytest.mark.slow
def test_bad_per_episode_is_a_usage_error(shelf):
    r = cli("search", "--shelf", shelf, "retry", "--per-episode", "0")
    assert r.returncode == 2 and "fix:" in r.stderr
    assert "Max hits per episode (3)" in cli("search", "--help").stdout


# --- the MCP server (official SDK client) ---------------------------------------------------

def test_the_same_through_the_mcp_server(shelf, tmp_path):
    pytest.importorskip("mcp", reason="the MCP Python SDK is not installed")
    anyio = pytest.importorskip("anyio")
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    params = StdioServerParameters(command=sys.executable, args=[SERVER], cwd=str(tmp_path),
                                   env={"MEMSHELF_SHELF": shelf, "MEMSHELF_SEMANTIC": "off",
                                        "PATH": os.environ.get("PATH", "")})

    async def talk():
        out = {}
        async with Client(params) as client:
            for name, query in (("unmatched", "service mesh Istio Linkerd"),
                                ("stem", "retries"), ("ident", "_$proto"),
                                ("minus", "INT_MIN / -1"), ("platform", "platform")):
                res = await client.call_tool("memshelf_search", {"query": query})
                assert not res.is_error, res
                out[name] = res.structured_content
            bad = await client.call_tool("memshelf_search", {"query": "x", "per_episode": 0})
            assert bad.is_error
            again = await client.call_tool("memshelf_search", {"query": "retry"})
            assert not again.is_error   # still serving
        return out

    out = anyio.run(talk)
    assert out["unmatched"]["unmatched"] == ["istio", "linkerd"]
    assert all(h["terms"] for h in out["unmatched"]["hits"])
    assert ("2026-02-01-http-client-retry", "Decisions") in pairs(out["stem"])
    assert {h["id"] for h in out["ident"]["hits"]} == {"2026-02-04-js-globals"}
    assert out["minus"]["hits"][0]["id"] == "2026-02-03-integer-division"
    assert all(h["terms"] == ["platform"] for h in out["platform"]["hits"])


@pytest.mark.slow
def test_status_reaches_search_hits(tmp_path):
    """--status round-trips into search results (issue 28): the hit carries it and the text
    marks a deprecated or proposed episode; amend keeps it."""
    root = str(tmp_path / "shelf")
    memshelf.init(root, storage="plain")
    memshelf.shelve(root, slug="2026-03-01-queue-choice", kind="topic", status="deprecated",
                    digest="Ana chose RabbitMQ for the billing queue. Open: none.",
                    sections={"Decisions": "RabbitMQ with quorum queues."})
    r = cli_json("search", "--shelf", root, "rabbitmq")
    assert r["hits"] and {h["status"] for h in r["hits"]} == {"deprecated"}
    assert "[deprecated]" in cli("search", "--shelf", root, "rabbitmq").stdout
    assert cli("shelve", "--shelf", root, "--amend", "--slug", "2026-03-01-queue-choice",
               "--tag", "queue").returncode == 0
    r = cli_json("search", "--shelf", root, "quorum")
    assert r["hits"][0]["status"] == "deprecated"


@pytest.mark.slow
def test_rebuild_full_drops_the_search_rows_and_search_builds_them_again(tmp_path):
    root = str(tmp_path / "shelf")
    memshelf.init(root, storage="plain")
    memshelf.shelve(root, **EPISODES[0])
    assert cli_json("search", "--shelf", root, "jittered")["hits"]
    assert cli("rebuild", "--shelf", root, "--full").returncode == 0
    import sqlite3
    db = sqlite3.connect(os.path.join(root, ".memshelf", "shelf.sqlite"))
    tables = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    db.close()
    assert "search_fts" not in tables            # rebuild --full indexes no section
    memshelf.shelve(root, **EPISODES[1])
    r = cli_json("search", "--shelf", root, "jittered", "sidecar")
    assert {h["id"] for h in r["hits"]} == {"2026-02-01-http-client-retry",
                                            "2026-02-02-service-mesh"}
