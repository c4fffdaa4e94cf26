"""Issue 30: every answer true and every chore one command. Amend that keeps, purge --id,
batch shelving, the digest contract without false alarms, secrets in prose and in tool
shapes, numbers that agree, help that says the rules. The real CLI as a subprocess, and the
real server (server.py) driven by an MCP client where the verb is a tool."""
import json
import os
import random
import string
import sys
import time

import pytest

import memshelf
from conftest import SERVER, git, run_cli, snapshot
from mcp_client import McpClient, clean_env

STEM = "2026-07-22-queue"
DOC = f"""# {STEM}

---
id: {STEM}
kind: topic
display_title: "Job queue"
status: open
priority: 5
team:
- infra
- ops
---

## Digest
Dana chose RabbitMQ over Kafka for the job queue. Open: retention policy.

## Decisions
- RabbitMQ with quorum queues.

## Rejected alternatives
- Kafka: too heavy for two services.

## Artifacts
- infra/queue.tf
"""


def episode(shelf, stem=STEM, category="topics"):
    return (shelf / "docs" / category / f"{stem}.md").read_text(encoding="utf-8")


@pytest.fixture
def queue(shelf, tmp_path):
    """An episode shelved from a document, then hand-edited to a custom section order (the
    order a writer chose), committed."""
    doc = tmp_path / "queue.md"
    doc.write_text(DOC, encoding="utf-8")
    r = run_cli("shelve", "--shelf", shelf, "--file", doc, "--tag", "infra", "--description",
                "Queue choice.")
    assert r.code == 0, r
    path = shelf / "docs/topics" / f"{STEM}.md"
    text = path.read_text(encoding="utf-8")
    head, rest = text.split("## Decisions", 1)
    decisions, rest = rest.split("## Artifacts", 1)
    artifacts, rejected = rest.split("## Rejected alternatives", 1)
    path.write_text(head + "## Decisions" + decisions + "## Rejected alternatives" +
                    rejected.rstrip("\n") + "\n\n## Artifacts" + artifacts.rstrip("\n") + "\n",
                    encoding="utf-8")
    git(shelf, "commit", "-qam", "hand edit: section order")
    return shelf


def server(cwd):
    env = clean_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for key, value in (("GIT_AUTHOR_NAME", "Test"), ("GIT_AUTHOR_EMAIL", "test@example.com"),
                       ("GIT_COMMITTER_NAME", "Test"), ("GIT_COMMITTER_EMAIL", "test@example.com")):
        env.setdefault(key, value)
    client = McpClient([sys.executable, SERVER], env=env, cwd=str(cwd))
    client.initialize()
    client.list_tools()
    return client


def structured(result):
    assert not result.get("isError"), result
    return result["structuredContent"]


# --- 1. amend keeps what it is not given ---------------------------------------------------

def test_amend_without_kind_or_digest_keeps_everything_else(queue):
    before = episode(queue)
    r = run_cli("shelve", "--shelf", queue, "--amend", "--slug", STEM, "--approx-tokens",
                "22000", "--tag", "queue")
    assert r.code == 0, r
    assert "changed: tags, approx_tokens, approx_tokens_source" in r.out
    text = episode(queue)
    assert "tags: [queue]" in text and "approx_tokens: 22000" in text
    # every field, key and section not given, as it was written, sections in their order
    for kept in ("kind: topic", 'display_title: "Job queue"', 'description: "Queue choice."',
                 "status: open", "priority: 5", "team:\n- infra\n- ops",
                 "## Digest\nDana chose RabbitMQ over Kafka for the job queue. Open: retention "
                 "policy.", "## Decisions\n- RabbitMQ with quorum queues."):
        assert kept in text, (kept, text)
    order = [line for line in text.splitlines() if line.startswith("## ")]
    assert order == [line for line in before.splitlines() if line.startswith("## ")] == [
        "## Digest", "## Decisions", "## Rejected alternatives", "## Artifacts"]
    assert git(queue, "log", "-1", "--format=%s").strip() == f"shelve: {STEM} (amend)"
    assert git(queue, "status", "--porcelain").strip() == ""


@pytest.mark.slow
def test_amend_appends_replaces_and_clears(queue):
    r = run_cli("shelve", "--shelf", queue, "--amend", "--slug", STEM,
                "--append-section", "Artifacts=- infra/queue-alerts.tf",
                "--section", "Decisions=- RabbitMQ 3.13 with quorum queues.",
                "--display-title", "", "--tag", "")
    assert r.code == 0, r
    text = episode(queue)
    assert "## Artifacts\n- infra/queue.tf\n- infra/queue-alerts.tf" in text
    assert "## Decisions\n- RabbitMQ 3.13 with quorum queues." in text
    assert "quorum queues.\n\n## Rejected alternatives" in text   # the order is kept
    assert "display_title" not in text and "tags: []" in text
    assert "status: open" in text
    # a section that does not exist yet is added by an append
    r = run_cli("shelve", "--shelf", queue, "--amend", "--slug", STEM, "--append-section",
                "Open threads=- retention policy (Dana)")
    assert r.code == 0, r
    assert episode(queue).rstrip().endswith("## Open threads\n- retention policy (Dana)")


def test_append_section_needs_amend_and_refusals_write_nothing(queue):
    snap = snapshot(queue)
    for args, code, words in (
            (["--slug", "2026-07-30-new", "--kind", "topic", "--digest", "Dana chose X.",
              "--section", "Decisions=- X", "--append-section", "Artifacts=- y"], 2, "--amend"),
            (["--amend", "--slug", STEM, "--append-section", "Artifacts=- y", "--section",
              "Artifacts=- z"], 2, "one of the three"),
            (["--slug", "2026-07-30-new", "--section", "Decisions=- X"], 2, "--kind")):
        r = run_cli("shelve", "--shelf", queue, *args)
        assert r.code == code and words in r.err and "fix:" in r.err, (args, r)
        assert snapshot(queue) == snap


def test_amend_over_mcp(queue):
    client = server(queue)
    try:
        res = structured(client.call_tool("memshelf_shelve", {
            "shelf_path": str(queue), "slug": STEM, "amend": True, "approx_tokens": 22000,
            "tags": ["queue"], "append_sections": {"Artifacts": "- infra/queue-alerts.tf"}}))
        assert res["amended"] and res["kind"] == "topic"
        text = episode(queue)
        assert "tags: [queue]" in text and "approx_tokens: 22000" in text
        assert "status: open" in text and "Dana chose RabbitMQ" in text
        assert "- infra/queue.tf\n- infra/queue-alerts.tf" in text
        assert text.index("## Rejected alternatives") < text.index("## Artifacts")
        # a new episode still needs a kind and a digest
        bad = client.call_tool("memshelf_shelve", {"shelf_path": str(queue),
                                                   "slug": "2026-07-30-new"})
        assert bad.get("isError") and "kind" in json.dumps(bad)
    finally:
        assert client.close() == 0


# --- 2. purge --id -----------------------------------------------------------------------

@pytest.mark.slow
def test_purge_by_id_cli(queue):
    snap = snapshot(queue)
    r = run_cli("purge", "--shelf", queue, "--id", STEM)
    assert r.code == 0 and "dry run" in r.out and f"docs/topics/{STEM}.md" in r.out, r
    assert "git history still holds" in r.out and f"--path docs/topics/{STEM}.md" in r.out
    assert snapshot(queue) == snap
    r = run_cli("purge", "--shelf", queue, "--id", STEM[:-1])
    assert r.code == 1 and f"did you mean: {STEM}" in r.err, r
    assert snapshot(queue) == snap
    head = git(queue, "rev-parse", "HEAD")
    r = run_cli("purge", "--shelf", queue, "--id", STEM, "--apply", "--json")
    assert r.code == 0, r
    res = r.json()
    assert res["deleted"] == [f"docs/topics/{STEM}.md"] and res["committed"]
    assert "git filter-repo" in res["note"]
    assert not (queue / "docs/topics" / f"{STEM}.md").exists()
    assert STEM not in (queue / "INDEX.md").read_text()
    assert git(queue, "rev-list", "--count", f"{head.strip()}..HEAD").strip() == "1"
    assert git(queue, "log", "-1", "--format=%s").strip() == \
        f"purge: 1 episode(s) named by id: {STEM}"
    assert git(queue, "status", "--porcelain").strip() == ""
    doctor = run_cli("doctor", "--shelf", queue, "--json").json()
    assert not [f for f in doctor["findings"] if f["level"] == "error"]


def test_purge_by_id_over_mcp(queue):
    client = server(queue)
    try:
        dry = structured(client.call_tool("memshelf_purge", {
            "shelf_path": str(queue), "episode_ids": [STEM]}))
        assert not dry["applied"] and dry["count"] == 1
        assert (queue / "docs/topics" / f"{STEM}.md").exists()
        done = structured(client.call_tool("memshelf_purge", {
            "shelf_path": str(queue), "episode_ids": [STEM], "apply": True}))
        assert done["applied"] and done["committed"] and "history" in done["note"]
        assert not (queue / "docs/topics" / f"{STEM}.md").exists()
    finally:
        assert client.close() == 0


# --- 3. batch shelving -------------------------------------------------------------------

def record(i, digest=None):
    stem = f"2026-07-2{i}-record-{i}"
    return stem, (f"# {stem}\n\n---\nid: {stem}\nkind: topic\n---\n\n## Digest\n"
                  f"{digest or f'Dana chose option {i} for record {i}. Open: rollout.'}\n\n"
                  f"## Decisions\n- Option {i}.\n\n```yaml\n---\nid: not-a-document\n---\n```\n")


def test_batch_shelve_one_lock_one_commit(shelf, tmp_path):
    docs = {i: record(i) for i in range(1, 6)}
    folder = tmp_path / "folder"
    folder.mkdir()
    for i in (1, 2):
        (folder / f"r{i}.md").write_text(docs[i][1], encoding="utf-8")
    single = tmp_path / "r3.md"
    single.write_text(docs[3][1], encoding="utf-8")
    stream = docs[4][1] + docs[5][1]   # two documents on stdin
    head = git(shelf, "rev-parse", "HEAD").strip()
    r = run_cli("shelve", "--shelf", shelf, "--file", folder, "--file", single, "--file", "-",
                "--tag", "records", input=stream)
    assert r.code == 0, r
    for i, (stem, _) in docs.items():
        assert f"shelved {stem}" in r.out
        text = episode(shelf, stem)
        assert "tags: [records]" in text and "id: not-a-document" in text
    assert "one commit for 5 episodes" in r.out
    assert git(shelf, "rev-list", "--count", f"{head}..HEAD").strip() == "1"
    assert git(shelf, "log", "-1", "--format=%s").strip() == "shelve: 5 episodes"
    assert git(shelf, "status", "--porcelain").strip() == ""
    # an amend of them all in one more commit
    r = run_cli("shelve", "--shelf", shelf, "--amend", "--file", folder, "--tag", "batch")
    assert r.code == 0 and "tags: [batch]" in episode(shelf, docs[1][0]), r


def test_batch_refused_as_a_whole(shelf, tmp_path):
    good, bad, dup = record(1), record(2, "We chose option 2."), record(1)
    for name, (_, text) in (("a.md", good), ("b.md", bad), ("c.md", dup)):
        (tmp_path / name).write_text(text, encoding="utf-8")
    snap = snapshot(shelf)
    r = run_cli("shelve", "--shelf", shelf, *[x for n in ("a.md", "b.md", "c.md")
                                              for x in ("--file", tmp_path / n)], "--json")
    assert r.code == 1, r
    err = r.json()["error"]
    assert "2 of 3 episode documents refused, so none was shelved" in err["message"]
    assert {d["document"].rsplit("/", 1)[-1] for d in err["details"]["refused"]} == \
        {"b.md", "c.md"}
    assert snapshot(shelf) == snap
    r = run_cli("shelve", "--shelf", shelf, "--slug", "2026-07-30-x", "--file", tmp_path / "a.md",
                "--file", tmp_path / "b.md")
    assert r.code == 2 and "--slug names one episode" in r.err


def test_lint_digest_takes_several_files(tmp_path):
    ok, bad = tmp_path / "ok.txt", tmp_path / "bad.txt"
    ok.write_text("Priya chose Redis; open: TTL audit.", encoding="utf-8")
    bad.write_text("We chose Redis.", encoding="utf-8")
    r = run_cli("lint-digest", "--digest-file", ok, "--digest-file", bad)
    assert r.code == 1 and f"{ok}: digest ok" in r.out and f"{bad}: [error] referent-we" in r.out
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in (1, 2):
        (docs / f"r{i}.md").write_text(record(i)[1], encoding="utf-8")
    r = run_cli("lint-digest", "--file", docs, "--json")
    assert r.code == 0 and r.json()["passed"] and len(r.json()["digests"]) == 2, r


# --- 4. the digest contract without false alarms ------------------------------------------

def test_identifiers_are_not_pronouns_and_changes_are_decisions():
    r = run_cli("lint-digest", "--digest", "The platform team keeps the certificates in "
                "us-east-1 and eu-west-1; Dana decided to rotate them yearly.")
    assert r.code == 0 and r.out.startswith("digest ok"), r
    r = run_cli("lint-digest", "--digest", "Dana told us to ship. Open: docs.")
    assert r.code == 1 and "referent-we" in r.out
    for verb in ("moved Redis to Elasticache", "adopted Terraform", "uses Postgres 16",
                 "replaced cron with Airflow", "switched to pnpm", "kept the monolith",
                 "retired the v1 API", "deprecated the XML feed", "removed the cache tier"):
        r = run_cli("lint-digest", "--digest", f"The team {verb}.")
        assert r.code == 0 and "thin" not in r.out, (verb, r)


def test_one_rule_for_secrets_in_a_digest(shelf):
    digest = "Dana rotated the key sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc" + "; open: audit."
    lint = run_cli("lint-digest", "--digest", digest, "--json")
    shelved = run_cli("shelve", "--shelf", shelf, "--slug", "2026-07-30-keys", "--kind", "topic",
                      "--digest", digest, "--section", "Decisions=- rotate", "--json")
    assert lint.code == shelved.code == 0, (lint, shelved)
    assert [w["code"] for w in lint.json()["warnings"]] == \
        [w["code"] for w in shelved.json()["digest_warnings"]] == ["secret-masked"]
    assert "4eC39Hq" not in lint.out + shelved.out + episode(shelf, "2026-07-30-keys")
    strict = run_cli("lint-digest", "--digest", digest, "--strict")
    refused = run_cli("shelve", "--shelf", shelf, "--slug", "2026-07-30-keys2", "--kind", "topic",
                      "--digest", digest, "--section", "Decisions=- rotate", "--strict")
    assert strict.code == refused.code == 1
    assert "lint-digest applies the same rule" in refused.err


@pytest.mark.slow
def test_dry_run_warns_like_the_real_shelve_and_takes_no_lock(shelf):
    args = ["shelve", "--shelf", shelf, "--slug", "2026-07-30-build", "--kind", "topic",
            "--digest", "Dana fixed the build.", "--section", "Decisions=- pin the toolchain"]
    env = {"MEMSHELF_LOCK_TIMEOUT": "2"}
    with memshelf._ShelfLock(str(shelf)):
        start = time.monotonic()
        dry = run_cli(*args, "--dry-run", env=env)
        assert dry.code == 0 and time.monotonic() - start < 10, dry
        busy = run_cli(*args, env=env)
        assert busy.code == 1 and "lock" in busy.err
    real = run_cli(*args)
    assert real.code == 0
    warn = "warning: thin: no decision or open thread"
    assert warn in dry.err and warn in real.err


@pytest.mark.slow
def test_rollup_keeps_the_digest_and_the_mass(shelf):
    for i, tokens in ((1, 12000), (2, 30000)):
        stem, _ = record(i)
        r = run_cli("shelve", "--shelf", shelf, "--slug", stem, "--kind", "topic", "--digest",
                    f"Dana chose option {i}.", "--section", "Decisions=- x", "--approx-tokens",
                    tokens, "--tag", "queue")
        assert r.code == 0, r
    snap = snapshot(shelf)
    r = run_cli("rollup", "--shelf", shelf, "--until", "2026-07-31", "--dry-run")
    assert r.code == 0 and "would fold 2 episodes" in r.out and "record-1" in r.out, r
    assert snapshot(shelf) == snap
    digest = "Dana chose options 1 and 2 for the records; open: rollout."
    r = run_cli("rollup", "--shelf", shelf, "--slug", "2026-07-31-records", "--digest", digest,
                "--until", "2026-07-31")
    assert r.code == 0, r
    text = episode(shelf, "2026-07-31-records")
    assert f"## Digest\n{digest}\n" in text and "Keywords:" not in text.split("## Digest")[1]
    assert "approx_tokens: 42000" in text and "approx_tokens_source: absorbed" in text
    assert "keywords: [" in text
    assert "Keywords:" in (shelf / "INDEX.md").read_text()   # the INDEX line carries them
    st = run_cli("stats", "--shelf", shelf, "--json").json()
    assert st["shelved_mass"] == 42000 and st["episodes"] == 1
    assert st["episodes_archived"] == 2 and st["archived_mass"] == 42000
    assert st["index_tokens_per_entry"] > 0
    assert "1 episode (+2 archived)" in st["banner"]
    doctor = run_cli("doctor", "--shelf", shelf, "--json").json()
    assert not [f for f in doctor["findings"] if f["level"] == "error"], doctor


# --- 5. secrets --------------------------------------------------------------------------

def _rand(n, alphabet=string.ascii_letters + string.digits, seed=[30]):
    seed[0] += 1
    rng = random.Random(seed[0])
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.mark.parametrize("text,secret,kind", [
    ("the password is {s} for staging", "Tr0ub4dor-Larkspur-77", "env-secret"),
    ("The admin password was {s}, rotated since.", "hunter2-Blue-99", "env-secret"),
    ("password: {s} (ask Dana)", "Xk9mQ2z77pLq", "env-secret"),
    ("password = {s} for now", "Tr0ub4dor-Larkspur-77", "env-secret"),
    ("azurestorageaccountkey: {s}", _rand(86) + "==", "azure-storage-key"),
    ("Set-AzStorageAccount -storagekey {s}", _rand(86) + "==", "azure-storage-key"),
    ("ANTHROPIC_ADMIN_KEY={s}", "sk-ant-admin01-" + _rand(93) + "AA", "anthropic-key"),
    ("x-api-key: {s}", "da2-" + _rand(26, string.ascii_lowercase + string.digits),
     "aws-api-key"),
    ('client = Client("AC' + _rand(32, "0123456789abcdef") + '", "{s}")',
     _rand(32, "0123456789abcdef"), "twilio-token"),
])
def test_secrets_the_newcomer_saw_kept(text, secret, kind):
    r = run_cli("redact", input=text.format(s=secret) + "\n")
    assert r.code == 0 and secret not in r.out and f"«redacted:{kind}»" in r.out, r


@pytest.mark.parametrize("text", [
    "the password is required", "Password: reset flow decided", "password is SHA-256 hashed",
    "the password is stored in Vault", "AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE",
    "commit 4a3c2728b93e8319002d3167d53e5753 fixed it",
])
def test_prose_and_placeholders_stay(text):
    r = run_cli("redact", input=text + "\n")
    assert r.code == 0 and r.out == text + "\n", r


def test_password_in_prose_never_reaches_the_mirror(shelf, tmp_path):
    r = run_cli("shelve", "--shelf", shelf, "--slug", "2026-07-30-staging", "--kind", "topic",
                "--digest", "Dana chose a new staging login; open: rotation.", "--section",
                "Decisions=- the password is Tr0ub4dor-Larkspur-77 until Friday")
    assert r.code == 0, r
    out = tmp_path / "mirror.html"
    assert run_cli("mirror", "--shelf", shelf, "--all", "--out", out).code == 0
    assert "Larkspur" not in episode(shelf, "2026-07-30-staging") + out.read_text()


# --- 6. numbers that agree ---------------------------------------------------------------

@pytest.mark.slow
def test_recall_numbers_are_true(shelf):
    # many one-line sections: an outline lists each with its cost, more than the lines
    many = [x for i in range(30) for x in ("--section", f"Step {i}=- done {i}")]
    r = run_cli("shelve", "--shelf", shelf, "--slug", "2026-07-30-tiny", "--kind", "topic",
                "--digest", "Dana chose X.", "--section", "Decisions=- X", "--approx-tokens",
                "50", *many)
    assert r.code == 0, r
    r = run_cli("recall", "--shelf", shelf, "--id", "2026-07-30-tiny", "--outline", "--json")
    res = r.json()
    assert res["whole_tokens"] <= res["tokens"] and "recall it without --outline" in \
        res["summary"]
    r = run_cli("recall", "--shelf", shelf, "--id", "2026-07-30-tiny")
    assert "saved" not in r.err and "saved" not in r.out   # no saving to claim
    printed = r.out.rstrip("\n")
    assert r.err.startswith("memshelf: recalled ~") and r.err.count("\n") == 1
    quiet = run_cli("recall", "--shelf", shelf, "--id", "2026-07-30-tiny", "--quiet")
    assert quiet.err == "" and quiet.out == r.out
    rows = [l.split("\t") for l in (shelf / "recall-log.tsv").read_text().splitlines()[1:]]
    assert rows[0][1] == "(outline)" and int(rows[0][2]) == res["tokens"]
    assert int(rows[1][2]) == memshelf.tokens(printed)


@pytest.mark.slow
def test_stats_banner_json_and_demo_agree(shelf, tmp_path):
    for i in (1, 2):
        stem, _ = record(i)
        assert run_cli("shelve", "--shelf", shelf, "--slug", stem, "--kind", "topic", "--digest",
                       f"Dana chose option {i}.", "--section", "Decisions=- x",
                       "--approx-tokens", "9000").code == 0
    st = run_cli("stats", "--shelf", shelf, "--json").json()
    banner = run_cli("stats", "--shelf", shelf, "--banner").out.strip()
    h = memshelf._human_count
    assert banner == st["banner"]
    assert f"standing {h(st['standing_cost'])} tok (INDEX {h(st['standing_index_only'])} + " \
           f"digests {h(st['digest_tokens'])})" in banner
    assert st["standing_cost"] == st["index_tokens"] + st["digest_tokens"]
    assert f"({st['compression_ratio']}:1)" in banner
    # the chart's "saved" is another figure: the stats text names it with its definition, and
    # the number is the one stats.svg prints
    assert run_cli("stats", "--shelf", shelf, "--chart").code == 0
    svg = (shelf / "stats.svg").read_text()
    assert f"saved {st['chart_ratio']}:1<" in svg
    text = run_cli("stats", "--shelf", shelf).out
    assert f"stats.svg: saved {st['chart_ratio']}:1 = every ledger row's estimate" in text
    assert f"({st['compression_ratio']}:1)" in text
    last = run_cli("shelve", "--shelf", shelf, "--slug", "2026-07-29-three", "--kind", "topic",
                   "--digest", "Dana chose three.", "--section", "Decisions=- x", "--json")
    totals = last.json()["shelf_totals"]
    st = run_cli("stats", "--shelf", shelf, "--json").json()
    assert (totals["episodes"], totals["standing_cost"], totals["compression_ratio"]) == \
        (st["episodes"], st["standing_cost"], st["compression_ratio"])


# --- 7. help that says the rules ---------------------------------------------------------

def test_shelve_help_says_the_rules():
    text = " ".join(run_cli("shelve", "--help", env={"COLUMNS": "400"}).out.split())
    for words in ("topic: Decisions", "research: at least one more section",
                  "session: Timeline and Open threads", "cut to 120 characters",
                  "--approx-tokens is the size in tokens", "an empty value clears a field",
                  "--title is --display-title", "--display-title DISPLAY_TITLE, --title"):
        assert words in text, words


def test_shelf_from_the_variable_is_said_once(shelf):
    env = {"MEMSHELF_SHELF": str(shelf)}
    first = run_cli("index", env=env)
    second = run_cli("index", env=env)
    assert "shelf from $MEMSHELF_SHELF" in first.err
    assert first.code == second.code == 0 and "shelf from" not in second.err


@pytest.mark.slow
def test_demo_names_a_command_the_user_has(tmp_path):
    env = {"PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                   if not os.path.exists(os.path.join(p, "memshelf")))}
    r = run_cli("demo", env=env, timeout=120)
    assert r.code == 0, r
    last = r.out.rstrip().splitlines()[-1]
    assert last.startswith("Next: python3 ") and "memshelf.py init --shelf" in last
    assert "install-launcher" in last


# --- the same two tools through the official MCP SDK client --------------------------------

@pytest.mark.slow
def test_amend_and_purge_with_the_sdk_client(queue):
    pytest.importorskip("mcp", reason="the MCP Python SDK is not installed")
    anyio = pytest.importorskip("anyio")
    try:
        from mcp import Client
        from test_server_sdk import mode_kwargs, server_params, text_of
    except ImportError as exc:
        pytest.skip(f"this MCP SDK has no unified Client: {exc}")

    async def run():
        async with Client(server_params(queue, MEMSHELF_SHELF=str(queue)),
                          **mode_kwargs("legacy")) as client:
            amended = await client.call_tool("memshelf_shelve", {
                "slug": STEM, "amend": True, "approx_tokens": 22000, "tags": ["queue"]})
            assert not amended.is_error, text_of(amended)
            assert amended.structured_content["amended"] is True
            purged = await client.call_tool("memshelf_purge", {"episode_ids": [STEM],
                                                               "apply": True})
            assert not purged.is_error, text_of(purged)
            assert purged.structured_content["deleted"] == [f"docs/topics/{STEM}.md"]
    anyio.run(run)
    assert not (queue / "docs/topics" / f"{STEM}.md").exists()
    amended = git(queue, "show", f"HEAD~1:docs/topics/{STEM}.md")
    assert "approx_tokens: 22000" in amended and "status: open" in amended
    log = git(queue, "log", "--format=%s", "-2").split("\n")
    assert log[:2] == [f"purge: 1 episode(s) named by id: {STEM}", f"shelve: {STEM} (amend)"]
