"""rebuild on an unchanged shelf reuses the last render; anything a render reads breaks that.

The memo lives in .memshelf/state.json: a key over the code, the INDEX format, the settings
files, the episode folders and every episode's (size, mtime_ns), plus the (size, mtime_ns) of
each derived file as written. These tests change one input at a time and check that rebuild
and `rebuild --check` see the change exactly as a full render would.
"""
import json
import os
import shutil

import pytest

from conftest import age_files, copy_of_template, memo_current, run_cli

EPISODES = [
    ("2026-03-01-cache-layer", "Mira chose a write-through cache for the billing reads. "
     "Open: eviction metrics."),
    ("2026-03-02-login-flow", "Ravi moved the login flow to one redirect handler. "
     "Open: nothing left."),
    ("2026-03-03-audit-trail", "Chen kept the audit trail append-only in one table. "
     "Open: retention length."),
]


def _shelve_episodes(root):
    assert run_cli("init", "--shelf", root, "--storage", "plain").code == 0
    for slug, digest in EPISODES:
        r = run_cli("shelve", "--shelf", root, "--slug", slug, "--kind", "topic",
                    "--digest", digest, "--section", "Decisions=- Chosen as the digest says.")
        assert r.code == 0, r


@pytest.fixture
def filled(tmp_path, tmp_path_factory):
    # built once and copied; aging the files voids the memo's key in the copy as it does in
    # the original
    root = copy_of_template(tmp_path_factory, tmp_path / "plain", "memo-filled",
                            _shelve_episodes)
    age_files(root)
    return root


def rebuild(cli, root, *extra):
    r = cli("rebuild", "--shelf", root, "--json", *extra)
    assert r.code in (0, 1), r
    return r.json()


def memo(root):
    with open(os.path.join(root, ".memshelf", "state.json"), encoding="utf-8") as f:
        return json.load(f).get("render_memo")


@pytest.mark.slow
def test_unchanged_shelf_is_answered_from_the_memo(filled, cli):
    first = rebuild(cli, filled)
    m = memo(filled)
    assert m and m["episodes"] == 3 and "INDEX.md" in m["files"]
    before = {rel: (filled / rel).read_bytes() for rel in m["files"] if m["files"][rel]}
    second = rebuild(cli, filled)
    assert second["written"] == [] and second["episodes"] == 3
    assert sorted(second["unchanged"]) == sorted(first["written"] + first["unchanged"])
    assert {rel: (filled / rel).read_bytes() for rel in before} == before
    assert rebuild(cli, filled, "--check")["ok"] is True


@pytest.mark.slow
def test_a_render_on_a_dropped_cache_is_remembered_like_any_other(filled, cli):
    # nothing remembered, nothing cached: the files are listed without stats and the key is
    # made from the stamps of the reads; it must be the key a full scan gives
    import memshelf
    (filled / "docs" / "topics" / "2026-03-09-split").mkdir()   # a split folder counts too
    (filled / "docs" / "topics" / "2026-03-09-split.md").write_text(
        "---\nid: 2026-03-09-split\nkind: topic\n---\n\n## Digest\nSplit. Open: none.\n")
    age_files(filled)
    first = rebuild(cli, filled)
    for workers in ("1", "2"):
        shutil.rmtree(filled / ".memshelf")
        r = cli("rebuild", "--shelf", filled, "--json", env={"MEMSHELF_WORKERS": workers})
        assert r.code == 0 and r.json()["episodes"] == 4, r
        assert r.json()["written"] == [] and r.json()["unchanged"] == \
            sorted(first["written"] + first["unchanged"])
        key, _ = memshelf._render_key(str(filled), memshelf._index_format(str(filled)))
        assert memo(filled)["key"] == key[0]
        assert memo_current(str(filled))
    # an episode that goes between the listing and its read is an unreadable file, not a crash
    assert memshelf._read_episode(str(filled), "docs/topics/gone.md").fm_error.startswith("io")


@pytest.mark.slow
def test_an_episode_edited_in_place_is_seen(filled, cli):
    rebuild(cli, filled)
    path = filled / "docs" / "topics" / "2026-03-02-login-flow.md"
    text = path.read_text()
    old = 'description: "Ravi moved the login flow to one redirect handler."'
    assert old in text
    path.write_text(text.replace(old, 'description: "Login now goes through one handler."'))
    check = rebuild(cli, filled, "--check")
    assert check["ok"] is False and "INDEX.md" in check["drifted"]
    res = rebuild(cli, filled)
    assert "INDEX.md" in res["written"]
    assert "Login now goes through one handler." in (filled / "INDEX.md").read_text()
    assert rebuild(cli, filled)["written"] == []


@pytest.mark.slow
def test_a_tampered_or_deleted_derived_file_is_repaired(filled, cli):
    rebuild(cli, filled)
    good_index = (filled / "INDEX.md").read_text()
    good_ledger = (filled / "ledger.tsv").read_text()
    (filled / "INDEX.md").write_text(good_index.replace("Mira", "Nobody"))
    os.unlink(filled / "ledger.tsv")
    check = rebuild(cli, filled, "--check")
    assert check["ok"] is False and {"INDEX.md", "ledger.tsv"} <= set(check["drifted"])
    res = rebuild(cli, filled)
    assert {"INDEX.md", "ledger.tsv"} <= set(res["written"])
    assert (filled / "INDEX.md").read_text() == good_index
    assert (filled / "ledger.tsv").read_text() == good_ledger


@pytest.mark.slow
def test_added_and_removed_episodes_are_seen(filled, cli, tmp_path):
    rebuild(cli, filled)
    src = filled / "docs" / "topics" / "2026-03-03-audit-trail.md"
    moved = tmp_path / "aside.md"
    shutil.move(str(src), str(moved))
    res = rebuild(cli, filled)
    assert res["episodes"] == 2 and "INDEX.md" in res["written"]
    assert "2026-03-03-audit-trail" not in (filled / "INDEX.md").read_text()
    shutil.move(str(moved), str(src))
    res = rebuild(cli, filled)
    assert res["episodes"] == 3 and "2026-03-03-audit-trail" in (filled / "INDEX.md").read_text()


@pytest.mark.slow
def test_settings_and_format_changes_are_seen(filled, cli):
    rebuild(cli, filled)
    cfg_path = filled / ".docshelf.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["name"] = "Renamed shelf"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    res = rebuild(cli, filled)
    assert "INDEX.md" in res["written"]
    assert "Renamed shelf" in (filled / "INDEX.md").read_text()
    res = rebuild(cli, filled, "--index-format", "docshelf")
    assert "INDEX.md" in res["written"]
    assert rebuild(cli, filled, "--check")["ok"] is True


@pytest.mark.slow
def test_a_broken_or_missing_state_file_only_costs_a_full_render(filled, cli):
    rebuild(cli, filled)
    good = (filled / "INDEX.md").read_text()
    state = filled / ".memshelf" / "state.json"
    state.write_text("{not json")
    res = rebuild(cli, filled)
    assert res["ok"] is True and res["written"] == [] and res["episodes"] == 3
    assert memo(filled)["episodes"] == 3
    shutil.rmtree(filled / ".memshelf")
    res = rebuild(cli, filled)
    assert res["ok"] is True and res["written"] == []
    assert (filled / "INDEX.md").read_text() == good


@pytest.mark.slow
def test_a_memo_for_other_inputs_is_never_used(filled, cli):
    rebuild(cli, filled)
    state_path = filled / ".memshelf" / "state.json"
    state = json.loads(state_path.read_text())
    # a memo whose file stamps claim the current files but whose key is someone else's
    state["render_memo"]["key"] = "0" * 40
    state_path.write_text(json.dumps(state))
    (filled / "INDEX.md").write_text("# stale\n")
    res = rebuild(cli, filled)
    assert "INDEX.md" in res["written"] and "Mira" in (filled / "INDEX.md").read_text()


@pytest.mark.slow
def test_a_memo_naming_files_outside_the_derived_set_is_never_used(filled, cli, tmp_path):
    rebuild(cli, filled)
    outside = tmp_path / "outside.txt"
    outside.write_text("not a shelf file\n")
    state_path = filled / ".memshelf" / "state.json"
    state = json.loads(state_path.read_text())
    st = os.stat(outside)
    state["render_memo"]["files"]["../outside.txt"] = [st.st_size, st.st_mtime_ns]
    state_path.write_text(json.dumps(state))
    res = rebuild(cli, filled)
    assert res["ok"] is True and res["written"] == []
    assert outside.read_text() == "not a shelf file\n"
    assert "../outside.txt" not in memo(filled)["files"]


# --- renders read cache columns, not whole records ------------------------------------------

def _renders_agree(root):
    """A render from the cache's render columns equals a render from whole records."""
    import memshelf
    root = str(root)
    first = memshelf._render_derived(root)  # fills the cache's columns (fresh partial reads)
    cat = memshelf._Store(root)
    try:
        whole = cat.records()               # column-only rows hold no record: read again
        light = cat.render_records()        # every row from the cache this time
    finally:
        cat.close()
    uncached = memshelf._Store(root, use_cache=False)
    bare = uncached.render_records()        # no cache at all: fresh partial reads
    assert len(whole) == len(light) == len(bare)
    # a render record is a part of the whole record, and the episode's own INDEX line and
    # .meta.json entry, formatted when the file was read
    pieces = {"index_entry", "meta_entry", "meta_warning"}
    # the keys a render record fills: the rest are None (the date field goes under "fields")
    keys = set(memshelf._RENDER_KEYS) - {"date_field"} | {"fields"}
    assert all({k for k, v in r.as_dict().items() if v is not None} <= keys
               for r in light + bare)
    assert all(r.index_entry is not None for r in light + bare)
    assert all(w.index_entry is None and w.meta_entry is None for w in whole)
    assert keys - pieces <= set(whole[0].as_dict())
    for w, r, b in zip(whole, light, bare):
        assert w.path == r.path == b.path
        assert r.index_entry == b.index_entry == memshelf._index_entry(w), w.path
        assert (r.meta_entry, r.meta_warning) == (b.meta_entry, b.meta_warning) \
            == memshelf._meta_entry(w), w.path
    fmt0 = memshelf._index_format(root)
    assert first["files"] == memshelf._render_derived(root, records=whole, fmt=fmt0)["files"]
    for fmt in ("compact", "docshelf"):
        a = memshelf._render_derived(root, records=whole, fmt=fmt)
        b = memshelf._render_derived(root, records=light, fmt=fmt)
        c = memshelf._render_derived(root, records=bare, fmt=fmt)
        assert a["files"] == b["files"] == c["files"], fmt
        assert a["warnings"] == b["warnings"] == c["warnings"], fmt
        assert memshelf._render_derived(root, fmt=fmt)["files"] == a["files"]
    return whole


@pytest.mark.slow
def test_renders_from_cache_columns_equal_renders_from_records(filled, cli):
    r = cli("shelve", "--shelf", filled, "--slug", "2026-03-04-cache-layer-v2", "--kind", "topic",
            "--digest", "Mira replaced the write-through cache with a read-through one. "
            "Open: nothing left.", "--section", "Decisions=- Read-through.",
            "--display-title", "Cache **layer** v2", "--supersedes", "2026-03-01-cache-layer",
            "--notes", "follow-up", "--approx-tokens", "1200", "--tag", "team:billing",
            "--description", "A description well over the cap of one hundred and twenty "
            "characters, so that the INDEX line is cut and a warning is given for it.")
    assert r.code == 0, r
    # a hand-written episode: no date field, no description, a CJK digest, a CRLF file
    (filled / "docs" / "research" / "2026-03-05-索引.md").write_bytes(
        "---\r\nid: 2026-03-05-索引\r\nkind: research\r\n---\r\n\r\n## Digest\r\n"
        "陈选择了只追加的审计表。待定：保留期限。\r\n".encode("utf-8"))
    (filled / "docs" / "sessions" / "2026-03-06-broken.md").write_text(
        "---\nid: [unclosed\n---\nbody\n")
    whole = _renders_agree(filled)
    assert any(r.supersedes for r in whole) and any(r.fm_error for r in whole)


def test_renders_from_cache_columns_on_a_040_shelf(tmp_path):
    here = os.path.join(os.path.dirname(__file__), "fixtures", "ref040", "shelf-docshelf")
    root = tmp_path / "shelf"
    shutil.copytree(here, root)
    assert len(_renders_agree(root)) > 0


@pytest.mark.slow
@pytest.mark.parametrize("column, value", [
    ("supersedes", "{not json"), ("supersedes", '{"a": 1}'), ("supersedes", 7),
    ("category", "nope"), ("index_entry", 5), ("index_entry", None), ("meta_entry", 7),
    ("meta_warning", b"\x00")])
def test_a_cache_row_with_values_a_render_cannot_use_is_read_again(filled, cli, column, value):
    """The cache is a local file anyone may edit: a row whose columns are not what a render
    needs is re-read from its episode, and the render is the one the episodes give."""
    import sqlite3
    before = rebuild(cli, filled)
    index = (filled / "INDEX.md").read_bytes()
    (filled / "INDEX.md").write_text("stale\n")
    db = sqlite3.connect(filled / ".memshelf" / "shelf.sqlite")
    with db:
        changed = db.execute(f"UPDATE episodes SET {column} = ? WHERE path LIKE ?",
                             (value, "%audit-trail.md")).rowcount
    db.close()
    assert changed == 1
    after = rebuild(cli, filled)
    assert after["ok"] and after["episodes"] == before["episodes"] == len(EPISODES)
    assert (filled / "INDEX.md").read_bytes() == index


@pytest.mark.slow
def test_racy_files_settle_once_a_read_has_verified_them(plain_shelf, cli):
    """A render made while its files were racy (a fresh copy, files just written) remembers
    their content; the first read after they age forgets them, so no later read hashes them
    (issue 32: a copied shelf stayed slow on every read)."""
    for slug, digest in EPISODES:
        r = cli("shelve", "--shelf", plain_shelf, "--slug", slug, "--kind", "topic",
                "--digest", digest, "--section", "Decisions=- Chosen as the digest says.")
        assert r.code == 0, r
    rebuild(cli, plain_shelf)                       # within the racy window of every file
    racy = memo(plain_shelf)["racy"]
    assert any(rel.startswith("docs/") for rel in racy), racy
    import time
    time.sleep(2.2)                                 # they settle: stamps unchanged, aged
    assert cli("index", "--shelf", plain_shelf).code == 0
    assert memo(plain_shelf)["racy"] == {}
    second = rebuild(cli, plain_shelf)              # still answered from the memo
    assert second["written"] == [] and memo(plain_shelf)["racy"] == {}


def test_a_derived_file_trusted_by_its_stamp_is_hashed_again_once_touched(plain_shelf, cli):
    """A read that hashed INDEX.md after it settled keeps its stamp, and later reads trust the
    stamp instead of hashing the file again; an edit that keeps the size, the inode and even
    the mtime still moves the ctime, so the file is hashed again and found changed."""
    import time
    for slug, digest in EPISODES:
        r = cli("shelve", "--shelf", plain_shelf, "--slug", slug, "--kind", "topic",
                "--digest", digest, "--section", "Decisions=- Chosen as the digest says.")
        assert r.code == 0, r
    rebuild(cli, plain_shelf)
    time.sleep(2.2)                                 # every file settles
    assert cli("index", "--shelf", plain_shelf).code == 0
    stamp = memo(plain_shelf)["stamps"]["INDEX.md"]
    index = plain_shelf / "INDEX.md"
    st = os.stat(index)
    assert stamp[:3] == [st.st_size, st.st_mtime_ns, st.st_ino]
    first = cli("index", "--shelf", plain_shelf, "--json").json()
    assert first["on_disk"] == "current" and first["source"] == "file"
    text = index.read_text(encoding="utf-8")
    with open(index, "r+", encoding="utf-8") as f:   # in place: same inode, same size
        f.write(text.replace("Mira", "Miro"))
    os.utime(index, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = cli("index", "--shelf", plain_shelf, "--json").json()
    assert after["on_disk"] == "stale" and "Mira" in after["index"] and "Miro" not in after["index"]
    # a stamp in state.json that is not four integers is not trusted
    rebuild(cli, plain_shelf)
    state = json.loads((plain_shelf / ".memshelf" / "state.json").read_text())
    state["render_memo"]["stamps"] = {"INDEX.md": ["x", 1, 2, 3]}
    (plain_shelf / ".memshelf" / "state.json").write_text(json.dumps(state))
    again = cli("index", "--shelf", plain_shelf, "--json").json()
    assert again["on_disk"] == "current" and "Mira" in again["index"]


def test_a_derived_file_of_megabytes_is_remembered_like_a_small_one(filled, cli):
    """A derived file from 4 MiB is named by another digest (_data_digest: SHA-1 where OpenSSL's
    speed pays); its memo holds all the same, and an edit of it is still seen."""
    config = filled / ".docshelf.json"
    settings = json.loads(config.read_text(encoding="utf-8"))
    settings["preamble"] = "Recall the section you need. " * 150_000   # INDEX.md over 4 MiB
    config.write_text(json.dumps(settings), encoding="utf-8")
    first = rebuild(cli, filled)
    assert "INDEX.md" in first["written"]
    assert (filled / "INDEX.md").stat().st_size >= 4 << 20
    assert rebuild(cli, filled)["written"] == []      # answered from the memo
    assert cli("index", "--shelf", filled, "--json").json()["on_disk"] == "current"
    with open(filled / "INDEX.md", "a", encoding="utf-8") as f:
        f.write("- a line by hand\n")
    assert cli("index", "--shelf", filled, "--json").json()["on_disk"] == "stale"
    assert "INDEX.md" in rebuild(cli, filled)["written"]


@pytest.mark.parametrize("entries", ["many", ["INDEX.md", 3], {"INDEX.md": "3"}, {"INDEX.md": -1},
                                     {"INDEX.md": True}, None])
def test_an_entry_count_state_json_does_not_hold_is_counted_again(filled, cli, entries):
    """The render memo's entry counts come from a local file anyone may edit: a value that is
    not a count is not used, by `index` or by shelve's splice, and nothing fails."""
    rebuild(cli, filled)
    path = filled / ".memshelf" / "state.json"
    state = json.loads(path.read_text(encoding="utf-8"))
    state["render_memo"]["entries"] = entries
    path.write_text(json.dumps(state), encoding="utf-8")
    answer = cli("index", "--shelf", filled, "--json").json()
    assert answer["entries_total"] == 3 and answer["on_disk"] == "current"
    r = cli("shelve", "--shelf", filled, "--slug", "2026-03-04-entry-count", "--kind", "topic",
            "--digest", "Mira counted the entries again. Open: none.",
            "--section", "Decisions=- Count again.")
    assert r.code == 0, r
    assert cli("index", "--shelf", filled, "--json").json()["entries_total"] == 4
