"""The episode store's one freshness rule (docs/architecture.md): every reader sees an episode
changed behind the tool's back — edited in place with the same size, deleted, added, renamed —
and they all agree, whatever the directory times say."""
import json
import os
import time

import pytest

from conftest import age_files, copy_of_template, edit_in_place, memo_current, run_cli

pytestmark = pytest.mark.slow

DIGEST = "Ana chose option A over option B for speed. Open: none."
SLUGS = ("2026-01-01-alpha-cache", "2026-01-02-beta-queue", "2026-01-03-gamma-auth")


def _shelve_three(root):
    assert run_cli("init", "--shelf", root).code == 0
    for slug in SLUGS:
        r = run_cli("shelve", "--shelf", root, "--slug", slug, "--kind", "topic",
                    "--digest", DIGEST, "--description", f"Ana picked a plan for {slug[11:]}",
                    "--section", "Decisions=- option A")
        assert r.code == 0, r


@pytest.fixture
def three(tmp_path, tmp_path_factory):
    # the shelved shelf is built once and copied; aging the files voids the store's stamps
    # and the render memo's key in the copy as it does in the original
    root = copy_of_template(tmp_path_factory, tmp_path / "shelf", "store-three", _shelve_three)
    age_files(root)
    assert run_cli("rebuild", "--shelf", root).code == 0
    # every reader once, so each has whatever it remembers
    for args in (("index",), ("stats",), ("search", "option"), ("doctor",),
                 ("rebuild", "--check")):
        run_cli(*args, "--shelf", root)
    return root


def readers(root):
    """What each reader says about the shelf, as text."""
    hook_in = json.dumps({"session_id": "s1", "cwd": str(root), "source": "startup",
                          "hook_event_name": "SessionStart"})
    index = run_cli("index", "--shelf", root, "--json").json()
    return {
        "index": index,
        "hook": run_cli("hook", "session-start", input=hook_in,
                        env={"MEMSHELF_SHELF": str(root)}).out,
        "search": run_cli("search", "--shelf", root, "Bob", "--json").out,
        "recall": run_cli("recall", "--shelf", root, "--id", SLUGS[1]).out,
        "stats": run_cli("stats", "--shelf", root, "--json").json(),
        "doctor": run_cli("doctor", "--shelf", root, "--json"),
        "check": run_cli("rebuild", "--shelf", root, "--check", "--json"),
    }


def doctor_codes(result):
    return {f["code"] for f in result.json().get("findings", [])}


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_an_edit_in_place_is_seen_by_every_reader(three, keep_mtime):
    root = three
    path = os.path.join(root, "docs", "topics", SLUGS[1] + ".md")
    if keep_mtime:
        # the edit lands within the timestamp granularity of the last render and leaves size,
        # mtime and inode as they were: only the racy rule can tell
        now = time.time()
        for dirpath, _, names in os.walk(os.path.join(root, "docs")):
            for name in names:
                os.utime(os.path.join(dirpath, name), (now, now))
        assert run_cli("rebuild", "--shelf", root).code == 0
        assert run_cli("index", "--shelf", root).code == 0
    edit_in_place(path, "Ana picked", "Bob picked", keep_mtime=keep_mtime)
    seen = readers(root)
    assert "Bob picked" in seen["index"]["index"]
    assert seen["index"]["on_disk"] == "stale"
    assert "Bob picked" in seen["hook"]
    assert SLUGS[1] in seen["search"]
    assert "Bob picked" in seen["recall"]
    assert "stale-index" in doctor_codes(seen["doctor"])
    check = seen["check"]
    assert check.code == 1 and "INDEX.md" in check.json()["drifted"]
    # and after a rebuild every reader agrees again
    assert run_cli("rebuild", "--shelf", root).code == 0
    again = readers(root)
    assert again["index"]["on_disk"] == "current" and "Bob picked" in again["index"]["index"]
    assert "stale-index" not in doctor_codes(again["doctor"])
    assert again["check"].code == 0


def test_an_edit_that_puts_the_old_mtime_back_is_seen_by_its_ctime(three):
    """An old file, read long after its last change, then rewritten in place with its size,
    inode and mtime put back (cp -p over it, rsync --inplace -t): the stamp is the same, but the
    change moved its ctime, which no caller can set, so every reader re-reads it."""
    root = three
    time.sleep(2.2)   # a ctime cannot be put in the past: let the aged files' ctimes age
    for args in (("index",), ("stats",), ("search", "option"), ("doctor",), ("rebuild",)):
        run_cli(*args, "--shelf", root)   # every cache row and memo now dated after the ctimes
    path = os.path.join(root, "docs", "topics", SLUGS[1] + ".md")
    before = os.stat(path)
    edit_in_place(path, "Ana picked", "Bob picked", keep_mtime=True)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == \
        (before.st_size, before.st_mtime_ns, before.st_ino)
    seen = readers(root)
    assert "Bob picked" in seen["index"]["index"] and seen["index"]["on_disk"] == "stale"
    assert "Bob picked" in seen["hook"] and SLUGS[1] in seen["search"]
    assert "stale-index" in doctor_codes(seen["doctor"]) and seen["check"].code == 1


def test_index_verify_compares_content(three):
    """--verify parses every episode and compares, trusting no cached row and no memo."""
    root = three
    path = os.path.join(root, "docs", "topics", SLUGS[0] + ".md")
    edit_in_place(path, "Ana picked", "Eve picked", keep_mtime=True)
    r = run_cli("index", "--shelf", root, "--verify", "--json").json()
    assert "Eve picked" in r["index"] and r["on_disk"] == "stale"


def test_deleted_added_and_renamed_behind_the_tools_back(three):
    root = three
    topics = os.path.join(root, "docs", "topics")
    parent = os.stat(topics)
    os.unlink(os.path.join(topics, SLUGS[0] + ".md"))
    text = open(os.path.join(topics, SLUGS[2] + ".md"), encoding="utf-8").read()
    renamed = "2026-01-04-gamma-auth-renamed"
    os.rename(os.path.join(topics, SLUGS[2] + ".md"), os.path.join(topics, renamed + ".md"))
    added = "2026-01-05-delta-added"
    with open(os.path.join(topics, added + ".md"), "w", encoding="utf-8") as f:
        f.write(text.replace(SLUGS[2], added))
    # directory times put back: only the files' own listing can tell
    os.utime(topics, ns=(parent.st_atime_ns, parent.st_mtime_ns))
    seen = readers(root)
    idx = seen["index"]["index"]
    assert SLUGS[0] not in idx and SLUGS[2] not in idx
    assert renamed in idx and added in idx
    assert seen["index"]["on_disk"] == "stale"
    assert added in seen["hook"] and SLUGS[0] not in seen["hook"]
    assert seen["stats"]["shelf_totals"]["episodes"] == 3 if "shelf_totals" in seen["stats"] \
        else True
    assert "stale-index" in doctor_codes(seen["doctor"])
    assert seen["check"].code == 1
    hits = run_cli("search", "--shelf", root, "gamma", "--json").out
    assert SLUGS[2] not in hits.replace(renamed, "")
    assert run_cli("recall", "--shelf", root, "--id", SLUGS[0]).code != 0
    assert run_cli("recall", "--shelf", root, "--id", added).code == 0


def test_a_render_of_files_just_written_is_remembered_by_their_content(tmp_path):
    """Right after a shelve every episode is within the timestamp granularity: the render is
    remembered under their content, so the next reader needs no render, and an edit that keeps
    the stamp is still seen."""
    import memshelf
    root = tmp_path / "shelf"
    assert run_cli("init", "--shelf", root).code == 0
    r = run_cli("shelve", "--shelf", root, "--slug", SLUGS[0], "--kind", "topic", "--digest",
                DIGEST, "--description", "Ana picked a plan", "--section", "Decisions=- A")
    assert r.code == 0, r
    assert memo_current(str(root))
    path = os.path.join(root, "docs", "topics", SLUGS[0] + ".md")
    edit_in_place(path, "Ana picked", "Bob picked", keep_mtime=True)
    assert not memo_current(str(root))
    assert "Bob picked" in run_cli("index", "--shelf", root).out


def test_doctor_sees_a_same_stamp_edit_of_a_file_it_checked(tmp_path):
    """A doctor verdict is a value the store remembers: a file rewritten within the timestamp
    granularity of its check, stamp unchanged, is checked again."""
    root = tmp_path / "shelf"
    assert run_cli("init", "--shelf", root, "--storage", "plain").code == 0
    r = run_cli("shelve", "--shelf", root, "--slug", SLUGS[0], "--kind", "topic", "--digest",
                DIGEST, "--section", "Decisions=- keep the value XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX here")
    assert r.code == 0, r
    first = run_cli("doctor", "--shelf", root, "--json")
    assert "secret-at-rest" not in doctor_codes(first)
    path = os.path.join(root, "docs", "topics", SLUGS[0] + ".md")
    edit_in_place(path, "XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX",
                  "ghp_" + "Z9yX8wV7uT6sR5qP4oN3mL2kJ1iH0gF9eD8c", keep_mtime=True)
    assert "secret-at-rest" in doctor_codes(run_cli("doctor", "--shelf", root, "--json"))


def test_a_cached_record_reads_back_as_the_record_it_was(three):
    """The row cache answers whole-record readers (doctor, rollup, views): a record stored and
    read back is the same record, so an unchanged file is not parsed again."""
    import memshelf
    rel = f"docs/topics/{SLUGS[0]}.md"
    rec = memshelf._read_episode(str(three), rel)
    assert memshelf._record_from_row(memshelf._record_to_row(rec)).as_dict() == rec.as_dict()


def _text_or_none(path):
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except FileNotFoundError:
        return None


def test_shelve_updates_the_derived_files_for_its_episode_as_a_rebuild_would(tmp_path):
    """On fuzzed shelves (new episodes, amends, a kind change that moves the file, ties on the
    date, titles and descriptions that need quoting, supersedes that reach other lines) the
    derived files shelve writes equal what rebuild writes."""
    import random
    import memshelf
    rng = random.Random(20261202)
    root = str(tmp_path / "shelf")
    memshelf.init(root, storage="plain")
    sections = {"topic": {"Decisions": "- keep it"},
                "session": {"Timeline": "- 10:00 start", "Open threads": "- none"},
                "research": {"Findings": "- it works"}}
    slugs, spliced = [], 0
    for n in range(70):
        amend = bool(slugs) and rng.random() < 0.35
        if amend:
            slug = rng.choice(slugs)
        else:
            slug = f"2026-0{rng.randint(1, 3)}-{rng.choice(['01', '02', '15'])}-ep-{n}"
            slugs.append(slug)
        kind = rng.choice(["topic", "topic", "session", "research"])
        title = rng.choice([None, f"Plan {n}", "Cache **layer** v2", "Ünïcode — title"])
        desc = rng.choice([None, f"Ana settled item {n}.", 'Quotes "and" back\\slash.'])
        sup = [rng.choice(slugs)] if rng.random() < 0.1 and len(slugs) > 1 else None
        r = memshelf.shelve(root, slug=slug, kind=kind, amend=amend, display_title=title,
                            description=desc, supersedes=sup,
                            date=rng.choice([None, "2026-02-01", "2026-02-02"]),
                            digest=f"Ana closed item {n} with option A. Open: none.",
                            sections=sections[kind])
        assert r["status"] == "ok", r
        with open(os.path.join(root, ".memshelf", "state.json"), encoding="utf-8") as f:
            remembered = json.load(f)["render_memo"]
        spliced += remembered["spliced"]
        # the entry count index answers with, moved by the splice, is the file's own
        index_text = _text_or_none(os.path.join(root, "INDEX.md"))
        assert remembered["entries"]["INDEX.md"] == memshelf._entry_count(index_text), n
        assert memshelf.index(root)["entries_total"] == memshelf._entry_count(index_text)
        # a full render from the episodes alone: no memo, no cached row (index --verify's)
        whole = memshelf._render_derived(root, verify=True)
        full = whole["files"]
        # the banner's totals, moved by the splice, are those of every episode summed again
        assert r["shelf_totals"] == memshelf._shelf_totals(root, records=whole["records"]), n
        on_disk = {rel: _text_or_none(os.path.join(root, rel)) for rel in full}
        drift = [rel for rel in full if on_disk[rel] != full[rel]]
        assert not drift, (n, slug, amend, kind, drift)
        for rel, text in full.items():   # _meta_entry writes json.dumps's own layout by hand
            if rel.endswith(".meta.json") and text:
                assert text == json.dumps(json.loads(text), indent=2, ensure_ascii=False) + "\n"
        assert memshelf.rebuild(root, check=True)["ok"]
    # most shelves moved their episode's lines in the texts (_render_splice), the rest rendered
    assert 35 <= spliced < 70, spliced
    # moving the last episode out of its category takes its heading and .meta.json with it
    for kind in ("session", "topic"):
        slug = "2026-04-01-only-session"
        assert memshelf.shelve(root, slug=slug, kind=kind, amend=kind == "topic",
                               digest="Ana closed the lone session. Open: none.",
                               sections=sections[kind])["status"] == "ok"
    for base in ("sessions", "research"):
        for name in os.listdir(os.path.join(root, "docs", base)):
            if name.endswith(".md"):
                memshelf.shelve(root, slug=name[:-3], kind="topic", amend=True,
                                digest="Ana moved it to topics. Open: none.",
                                sections=sections["topic"])
    full = memshelf._render_derived(root, verify=True)["files"]
    assert [rel for rel in full if _text_or_none(os.path.join(root, rel)) != full[rel]] == []
    assert "## Sessions" not in _text_or_none(os.path.join(root, "INDEX.md"))


def _state(root):
    with open(os.path.join(root, ".memshelf", "state.json"), encoding="utf-8") as f:
        return json.load(f)


def _vouch_for_index(root, text):
    """INDEX.md written as `text`, and the render memo told it holds that (as a hand edit of
    state.json would)."""
    import memshelf
    with open(os.path.join(root, "INDEX.md"), "w", encoding="utf-8") as f:
        f.write(text)
    state = _state(root)
    state["render_memo"]["files"]["INDEX.md"] = memshelf._text_digest(text)
    with open(os.path.join(root, ".memshelf", "state.json"), "w", encoding="utf-8") as f:
        json.dump(state, f)


def _shelve_rendered_whole(root, slug):
    """A shelve of `slug` that the splice declined: its derived files are a full render's."""
    import memshelf
    r = run_cli("shelve", "--shelf", root, "--slug", slug, "--kind", "topic", "--digest",
                DIGEST, "--section", "Decisions=- option A")
    assert r.code == 0, r
    assert _state(root)["render_memo"]["spliced"] is False
    full = memshelf._render_derived(root, verify=True)["files"]
    assert {rel: _text_or_none(os.path.join(root, rel)) for rel in full} == full


def test_a_splice_trusts_another_category_by_its_stamp_and_mends_a_hand_edit(tmp_path):
    """Shelve's splice reads INDEX, the ledger and its own category's .meta.json; another
    category's .meta.json it takes on the stamp a read that hashed it took, kept in the memo.
    A hand edit there moves that stamp: the next shelve reads the file, finds it is not what
    the memo says, renders whole, and writes and commits the right file."""
    import subprocess
    import memshelf
    root = str(tmp_path / "shelf")
    memshelf.init(root)

    def shelve(slug, kind="topic", **sections):
        r = memshelf.shelve(root, slug=slug, kind=kind, digest=DIGEST,
                            sections=sections or {"Decisions": "- option A"})
        assert r["status"] == "ok", r
        return _state(root)["render_memo"]

    shelve("2026-01-01-a-session", "session",
           **{"Timeline": "- 10:00 start", "Open threads": "- none"})
    shelve("2026-01-02-alpha")
    time.sleep(2.1)   # the session category's .meta.json settles: a stamp can vouch for it
    sessions = "docs/sessions/.meta.json"
    memo = shelve("2026-01-03-beta")
    assert memo["spliced"] is True and sessions in memo["stamps"], memo
    memo = shelve("2026-01-04-gamma")   # trusted by its stamp, which the next memo keeps
    assert memo["spliced"] is True and sessions in memo["stamps"], memo
    path = os.path.join(root, *sessions.split("/"))
    with open(path, encoding="utf-8") as f:
        good = f.read()
    edit_in_place(path, "a-session", "A-SESSION")
    memo = shelve("2026-01-05-delta")
    assert memo["spliced"] is False
    full = memshelf._render_derived(root, verify=True)["files"]
    assert full[sessions] == good
    with open(path, encoding="utf-8") as f:
        assert f.read() == good
    assert subprocess.run(["git", "-C", root, "show", "HEAD:" + sessions], capture_output=True,
                          text=True, check=True).stdout == good
    assert memshelf.rebuild(root, check=True)["ok"]


def test_a_bot_mode_shelve_moves_the_remembered_totals(tmp_path):
    """With derived files left to a bot, a shelve still answers the shelf's totals: those
    remembered before its write, moved by its episode, and remembered for the next reader."""
    import memshelf
    root = str(tmp_path / "shelf")
    memshelf.init(root, storage="plain")
    with open(os.path.join(root, "memshelf.json"), "w", encoding="utf-8") as f:
        json.dump({"derived": "bot"}, f)
    for n, (slug, amend) in enumerate([(SLUGS[0], False), (SLUGS[1], False), (SLUGS[0], True),
                                       (SLUGS[2], False)]):
        r = memshelf.shelve(root, slug=slug, kind="topic", amend=amend, approx_tokens=1000 * n,
                            digest=f"Ana closed item {n} with option A. Open: none.",
                            sections={"Decisions": "- keep it"})
        assert r["status"] == "ok" and r["derived"]["mode"] == "bot", r
        whole = memshelf._render_derived(root, verify=True)["records"]
        assert r["shelf_totals"] == memshelf._shelf_totals(root, records=whole), n
        key = memshelf._render_key(root, memshelf._index_format(root))[0]
        assert memshelf._remembered(root, "aggregate", key) is not None, n


def test_rebuild_check_renders_what_a_splice_left_and_finds_a_wrong_line(three):
    """rebuild --check compares the derived files with a render from the episodes: a memo made
    by shelve's splice is not taken as that render, so a wrong line it vouches for is found."""
    root = str(three)
    r = run_cli("shelve", "--shelf", root, "--slug", "2026-01-04-delta-cache", "--kind",
                "topic", "--digest", DIGEST, "--section", "Decisions=- option A")
    assert r.code == 0, r
    assert _state(root)["render_memo"]["spliced"] is True
    with open(os.path.join(root, "INDEX.md"), encoding="utf-8") as f:
        _vouch_for_index(root, f.read().replace("Ana picked a plan for", "Ana picked no plan for",
                                                1))
    assert memo_current(root)   # the spliced memo vouches for the wrong file
    check = run_cli("rebuild", "--shelf", root, "--check", "--json")
    assert check.code == 1 and "INDEX.md" in check.json()["drifted"], check


def test_a_shelf_whose_ids_are_not_their_stems_is_rendered_whole(three):
    """The splice finds a line by its stem's date in the ledger, which names episodes by id: on
    a shelf where an id is not its file's stem the render is made whole, and is right."""
    root = str(three)
    path = os.path.join(root, "docs", "topics", SLUGS[1] + ".md")
    edit_in_place(path, f"id: {SLUGS[1]}", "id: 2026-01-02-beta-qveve")
    assert run_cli("rebuild", "--shelf", root).code == 0
    assert _state(root)["render_memo"]["plain"] is False
    _shelve_rendered_whole(root, "2026-01-04-delta-cache")


def test_a_splice_declines_a_line_it_cannot_place(three):
    """An INDEX line whose stem the ledger does not list (a hand edit the memo was told of)
    leaves the splice unsure: the shelve renders the whole shelf instead, and it is right."""
    root = str(three)
    with open(os.path.join(root, "INDEX.md"), encoding="utf-8") as f:
        text = f.read()
    odd = text.replace(f"- {SLUGS[0]} ", "- 2026-01-01-not-on-this-shelf ", 1)
    assert odd != text
    _vouch_for_index(root, odd)
    _shelve_rendered_whole(root, "2026-01-01-zeta-cache")


def test_doctor_renders_the_index_itself_and_never_trusts_the_memo(three):
    """A wrong INDEX remembered as a full render (a state.json edited by hand) is current to the
    fast readers, but doctor renders from the episodes and names it."""
    import memshelf
    root = str(three)
    path = os.path.join(root, "INDEX.md")
    with open(path, encoding="utf-8") as f:
        good = f.read()
    wrong = good.replace("Ana picked a plan for", "Ana picked no plan for", 1)
    assert wrong != good
    with open(path, "w", encoding="utf-8") as f:
        f.write(wrong)
    state_path = os.path.join(root, ".memshelf", "state.json")
    with open(state_path, encoding="utf-8") as f:
        state = json.load(f)
    state["render_memo"]["files"]["INDEX.md"] = memshelf._text_digest(wrong)
    with open(state_path, "w", encoding="utf-8") as f:
        json.dump(state, f)
    assert memo_current(root)   # the memo now vouches for the wrong file
    r = run_cli("doctor", "--shelf", root, "--json")
    found = [f for f in r.json()["findings"] if f["code"] == "stale-index"]
    assert found, r.out
    # the memo proven wrong is forgotten: the fix doctor names repairs the file
    assert not memo_current(root)
    assert run_cli("rebuild", "--shelf", root).code == 0
    with open(path, encoding="utf-8") as f:
        assert f.read() == good
    assert "stale-index" not in doctor_codes(run_cli("doctor", "--shelf", root, "--json"))


def test_a_shelve_remembers_the_render_it_wrote(three):
    root = str(three)
    r = run_cli("shelve", "--shelf", root, "--slug", "2026-01-04-delta-cache", "--kind", "topic",
                "--digest", DIGEST, "--section", "Decisions=- option A")
    assert r.code == 0, r
    assert memo_current(root)
    assert run_cli("rebuild", "--shelf", root, "--check").code == 0
    assert memo_current(root)


def parse_times(root):
    """{path: seen_ns} of the store's rows: when each was parsed (a parse writes it anew)."""
    import sqlite3
    db = sqlite3.connect(os.path.join(root, ".memshelf", "shelf.sqlite"))
    try:
        return dict(db.execute("SELECT path, seen_ns FROM episodes"))
    finally:
        db.close()


@pytest.mark.slow
def test_on_an_empty_cache_each_file_is_parsed_once_for_every_reader(three):
    """The store's parse fills every cache at once: after a cold search, index, stats, recall
    and a second search parse nothing; doctor parses once more for its verdicts (they are
    checked beside the parse), and fills the search rows as it goes."""
    import shutil
    root = str(three)
    shutil.rmtree(os.path.join(root, ".memshelf"))
    time.sleep(2.1)   # every file's last change ages past the racy window
    assert run_cli("search", "--shelf", root, "option").code == 0
    first = parse_times(root)
    assert len(first) == len(SLUGS)
    for args in (("index",), ("stats",), ("recall", "--id", SLUGS[0]), ("search", "plan"),
                 ("rebuild",)):
        assert run_cli(*args, "--shelf", root).code == 0, args
    assert parse_times(root) == first
    run_cli("doctor", "--shelf", root)
    checked = parse_times(root)
    assert all(checked[p] > first[p] for p in first)
    for args in (("doctor",), ("search", "option"), ("index",), ("stats",)):
        run_cli(*args, "--shelf", root)
    assert parse_times(root) == checked


def test_a_row_written_after_a_full_match_voids_the_remembered_key(three):
    """An unchanged shelf's refresh reads no row: it keeps the store key at which every row last
    matched its file. A row another process writes later (an older reader storing what it
    parsed, a row forgotten) must void that key, or search would skip the episode's re-parse."""
    import sqlite3
    root = str(three)
    time.sleep(2.2)   # no file is racy now: the key can be remembered
    assert SLUGS[2] in run_cli("search", "--shelf", root, "gamma", "--json").out
    db = sqlite3.connect(os.path.join(root, ".memshelf", "shelf.sqlite"))
    try:
        with db:   # what another process's forget does: the episode's row and its search rows
            path = f"docs/topics/{SLUGS[2]}.md"
            db.execute("DELETE FROM search_fts WHERE rowid IN (SELECT s.sid FROM search_sections"
                       " s JOIN search_episodes e ON e.ep = s.ep WHERE e.path = ?)", (path,))
            db.execute("DELETE FROM search_sections WHERE ep IN (SELECT ep FROM search_episodes"
                       " WHERE path = ?)", (path,))
            db.execute("DELETE FROM search_episodes WHERE path = ?", (path,))
            db.execute("DELETE FROM episodes WHERE path = ?", (path,))
    finally:
        db.close()
    hits = run_cli("search", "--shelf", root, "gamma", "--json").json()["hits"]
    assert [h["id"] for h in hits][:1] == [SLUGS[2]]
    assert len(parse_times(root)) == len(SLUGS)   # the row is back


def test_an_edit_after_the_key_is_remembered_is_found(three):
    root = str(three)
    time.sleep(2.2)
    assert run_cli("search", "--shelf", root, "option").code == 0
    assert run_cli("search", "--shelf", root, "zebracorn", "--json").json()["hits"] == []
    edit_in_place(os.path.join(root, "docs", "topics", SLUGS[0] + ".md"), "for speed", "zebracorn")
    hits = run_cli("search", "--shelf", root, "zebracorn", "--json").json()["hits"]
    assert [h["id"] for h in hits] == [SLUGS[0]]


def test_refresh_keeps_no_key_when_another_process_wrote_a_row_while_it_compared(three):
    """The row another process stores while refresh compares may be older than its file (it
    parsed before the file changed): the key is then not remembered, and the next refresh
    compares every row again."""
    import sqlite3
    import memshelf
    root = str(three)
    time.sleep(2.2)
    path = os.path.join(root, ".memshelf", "shelf.sqlite")

    def fresh():
        db = sqlite3.connect(path)
        try:
            return db.execute("SELECT value FROM meta WHERE key = 'fresh'").fetchall()
        finally:
            db.close()

    store = memshelf._Store(root)
    compare = store._merge

    def compare_while_another_writes(*args, **kwargs):
        out = compare(*args, **kwargs)
        other = sqlite3.connect(path)
        with other:   # as a store of what it parsed: the row written again, read later
            other.execute("UPDATE episodes SET seen_ns = seen_ns + 1 WHERE path = ?",
                          (f"docs/topics/{SLUGS[0]}.md",))
        other.close()
        return out

    try:
        store._merge = compare_while_another_writes
        store.refresh()
        assert fresh() == []
        store._merge = compare
        store.refresh()   # nobody else writes now: the key is kept
        assert len(fresh()) == 1
    finally:
        store.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_the_listing_closes_each_folder_it_opens_and_stamps_every_file(three):
    import memshelf
    before = sorted(os.listdir("/proc/self/fd"))
    scanned = memshelf._scan_episode_files(str(three))
    assert sorted(os.listdir("/proc/self/fd")) == before
    paths = [rel for rel, _, _ in scanned]
    assert paths == sorted(paths) and len(paths) == len(SLUGS)
    for rel, archived, stamp in scanned:
        st = os.lstat(three / rel)
        assert not archived and stamp == (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def test_the_store_key_takes_any_inode_number_and_tells_two_apart(three):
    # some network file systems hand out inode numbers past 2**63
    import memshelf
    seen, scanned, subdirs = memshelf._render_inputs(str(three))

    def key(ino):
        folders = [(rel, archived, names, [sizes, mtimes, [ino + n for n in range(len(inos))],
                                           ctimes])
                   for rel, archived, names, (sizes, mtimes, inos, ctimes) in scanned.folders]
        return memshelf._render_key_of(str(three), "compact", memshelf._Listing(folders),
                                       subdirs, seen)[0]

    assert key(2 ** 64) == key(2 ** 64) != key(2 ** 64 + 1)


def test_stamp_columns_keep_a_value_past_64_bits(three):
    """A listing keeps its stamps in typed arrays; an inode number past 64 bits keeps its column
    a list, which keys by value and takes a file the write put in."""
    from types import SimpleNamespace
    import memshelf

    def stat(ino):
        return SimpleNamespace(st_size=10, st_mtime_ns=2, st_ino=ino, st_ctime_ns=3)

    small = memshelf._stamp_columns([stat(7), stat(8)])
    assert all(type(c) is memshelf.array.array for c in small)
    big = memshelf._stamp_columns([stat(2 ** 64 + 7), stat(8)])
    assert big[2] == [2 ** 64 + 7, 8] and type(big[0]) is memshelf.array.array
    other = memshelf._stamp_columns([stat(2 ** 64 + 8), stat(8)])
    assert memshelf._folder_part(["a.md", "b.md"], big) != \
        memshelf._folder_part(["a.md", "b.md"], other)
    memshelf._column_insert(small, 1, (1, 2, 2 ** 70, 3))
    assert small[2] == [7, 2 ** 70, 8] and list(small[0]) == [10, 1, 10]
    assert list(zip(*small))[1] == (1, 2, 2 ** 70, 3)


def test_a_listing_stated_again_keys_as_a_new_listing(three):
    # shelve keys its render by the listing before the write with its own files stated again:
    # the key must be the one the next read's listing makes, or every read after it misses
    import memshelf
    root = str(three)
    before = memshelf._scan_episode_files(root)
    old = next(rel for rel, _, _ in before if rel.startswith("docs/"))
    name = old.rsplit("/", 1)[1]
    assert not any(f[0].startswith("archive/") for f in before.folders)
    os.makedirs(os.path.join(root, "archive", "docs", "topics"))   # one the listing lacks
    new = f"archive/docs/topics/{name}"   # moved to a folder of its own, as archiving does
    os.rename(os.path.join(root, old), os.path.join(root, new))
    added = "docs/topics/2026-12-05-a-new-one.md"
    with open(os.path.join(root, added), "w", encoding="utf-8") as f:
        f.write("# new\n")
    again = before.again(root, [old, new, added, "docs/topics/never-written.md"])
    fresh = memshelf._scan_episode_files(root)
    assert list(again) == list(fresh)
    assert [f[:3] for f in again.folders] == [f[:3] for f in fresh.folders]
    seen = memshelf.time.time_ns()
    assert memshelf._render_key_of(root, "compact", again, [], seen) == \
        memshelf._render_key_of(root, "compact", fresh, [], seen)
    assert again.stamp(new) == fresh.stamp(new) and again.stamp(old) is None


def _spliced_as_lists(records, mine, line, add):
    """What _splice_text must do, on a list of records (bisect_left by key, then insert/delete)."""
    import bisect
    keys = [r.split(":")[0] for r in records]
    at = bisect.bisect_left(keys, mine)
    there = keys[at] if at < len(keys) else ()
    if add:
        return None if there == mine else records[:at] + [line] + records[at:]
    if there != mine or records[at] != line or len(records) == 1:
        return None
    return records[:at] + records[at + 1:]


@pytest.mark.parametrize("as_bytes", [False, True])
@pytest.mark.parametrize("sep", ["\n", ',\n  "'])
def test_splice_text_puts_and_takes_a_record_as_a_sorted_list_would(sep, as_bytes):
    # shelve's splice bisects over offsets (no split); a list of records is the reference
    import random
    import memshelf
    rng = random.Random(7)
    for _ in range(3000):
        keys = sorted(rng.sample(range(100, 160), rng.randrange(0, 8)))
        records = [f"{k}:{'x' * rng.randrange(0, 30)}" for k in keys]
        head, tail = "HEAD" + sep, sep + "TAIL"
        text = head + sep.join(records) + tail
        lo, hi = len(head), len(head) + len(sep.join(records))
        mine = str(rng.choice(keys + [rng.randrange(100, 160)]) if keys
                   else rng.randrange(100, 160))
        add = rng.random() < 0.5
        line = f"{mine}:{'y' * rng.randrange(0, 5)}" if add or mine not in [str(k) for k in keys] \
            else rng.choice([records[keys.index(int(mine))], f"{mine}:other"])
        if as_bytes:   # shelve splices the files' bytes; records and keys here are ASCII
            got = memshelf._splice_text(text.encode(), lo, hi, sep.encode(),
                                        lambda r: r.split(b":")[0].decode(), mine, line.encode(),
                                        add)
            got = None if got is None else got.decode()
        else:
            got = memshelf._splice_text(text, lo, hi, sep, lambda r: r.split(":")[0], mine, line,
                                        add)
        want = _spliced_as_lists(records, mine, line, add)
        if want is not None:   # an empty block gains its line and the separator after it
            want = head + (sep.join(want) if records else line + sep) + tail
        assert got == want, (records, mine, line, add)


def test_index_block_is_the_lines_under_the_one_heading():
    import memshelf
    for text, want in (("# I\n\n## Topics\n\n- a\n- b\n\n## Sessions\n\n- c\n", ["- a", "- b"]),
                       ("## Topics\n\n- a\n", ["- a"]),
                       ("## Topics\n\n\n## Sessions\n", []),
                       ("## Topics\n\n- a\n## Topics\n\n- b\n", None),
                       ("# I\n\n## Sessions\n\n- c\n", None),
                       ("## Topics\n\n- a", None),
                       ("## Topics\n", None)):
        block = memshelf._index_block(text.encode(), b"## Topics")   # ASCII: offsets agree
        assert (None if block is None else text[block[0]:block[1]].split("\n")
                if block[1] > block[0] else []) == want, text
