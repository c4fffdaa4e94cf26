"""Issue 22, a newcomer's first hour: the CLI speaks CLI words, finds its shelf, every verb's help
renders, and every answer is worth reading. The CLI runs as a subprocess throughout."""
import json
import os
import subprocess
import sys

import pytest

from conftest import MEMSHELF, git, run_cli, shelve_args, snapshot


def _verbs():
    import memshelf
    return [v.name for v in memshelf._verb_table()]


# --- help and CLI words -----------------------------------------------------------------------

@pytest.mark.parametrize("verb", _verbs())
def test_every_verb_help_renders(verb):
    r = run_cli(verb, "--help")
    assert r.code == 0 and "Traceback" not in r.err and "internal error" not in r.err, r
    assert r.out.startswith(f"usage: memshelf {verb}")


def test_merge_driver_help_shows_git_placeholders():
    r = run_cli("merge-driver", "--help")
    assert r.code == 0, r
    assert "%O %A %B" in r.out


def test_help_says_defaults_and_what_off_switches_do():
    text = " ".join(run_cli("advise", "--help").out.split())
    assert "--exclude-self Default: count the INDEX as an occupant; this flag turns that off." \
        in text
    assert "done by default" not in text
    assert "{label" not in text and "LABEL=TOKENS" in text and "not JSON" in text
    assert "Context window size. Default: 200000." in text
    for verb, flag in (("import", "--no-redact"), ("recall", "--no-log"),
                       ("shelve", "--no-commit"), ("rollup", "--no-commit")):
        text = " ".join(run_cli(verb, "--help").out.split())
        assert f"{flag} Default: " in text and "done by default" not in text, (verb, text)


def test_help_speaks_cli_words_and_mcp_keeps_its_names():
    rebuild = " ".join(run_cli("rebuild", "--help").out.split())
    assert "--check only reports drift" in rebuild and "check=true" not in rebuild
    purge = " ".join(run_cli("purge", "--help").out.split())
    assert "(--apply: delete)" in purge and "apply=true" not in purge
    tools = json.loads(run_cli("tools", "--verb", "rebuild", "--verb", "purge").out)
    descriptions = " ".join(t["description"] for t in tools)
    assert "check=true" in descriptions and "apply=true" in descriptions
    assert all("shelf_path" in t["inputSchema"]["properties"] for t in tools)


def test_errors_say_cli_flags_at_the_terminal_and_argument_names_over_mcp(shelf):
    assert run_cli(*shelve_args(shelf)).code == 0
    r = run_cli("recall", "--shelf", shelf, "--id", "2026-07-22-auth-refactor",
                "--section", "nope")
    assert r.code == 1 and "--outline to see their costs" in r.err and "outline=true" not in r.err
    r = run_cli("call", "memshelf_recall", json.dumps(
        {"shelf_path": str(shelf), "episode_id": "2026-07-22-auth-refactor", "section": "nope"}),
        "--json")
    assert r.code == 1 and "outline=true" in r.json()["error"]["fix"], r
    r = run_cli("call", "memshelf_index", "{}", "--json", cwd=shelf)
    fix = r.json()["error"]["fix"]
    assert "shelf_path" in fix and "--shelf" not in fix, r


def test_index_truncation_names_the_cli_offset_flag(shelf):
    for n in range(3):
        assert run_cli(*shelve_args(shelf, slug=f"2026-07-2{n}-topic-number-{n}")).code == 0
    r = run_cli("index", "--shelf", shelf, "--max-chars", "300")
    assert "--offset 1" in r.out or "--offset 2" in r.out, r
    assert "offset=" not in r.out
    r = run_cli("call", "memshelf_index", json.dumps({"shelf_path": str(shelf),
                                                      "max_chars": 300}), "--json")
    assert "offset=" in r.json()["index"]


# --- finding the shelf ------------------------------------------------------------------------

def test_no_shelf_fix_speaks_cli(tmp_path):
    r = run_cli("index", cwd=tmp_path)
    assert r.code == 2, r
    assert "--shelf PATH" in r.err and "MEMSHELF_SHELF" in r.err and "shelf_path" not in r.err
    assert "extension settings" not in r.err


def test_shelf_found_from_a_folder_inside_it(shelf):
    inner = shelf / "docs" / "topics"
    args = shelve_args(shelf)
    del args[1:3]                                   # no --shelf
    r = run_cli(*args, cwd=inner)
    assert r.code == 0, r
    assert f"shelf from the working directory: {os.path.realpath(shelf)}" in r.err
    r = run_cli("index", "--quiet", cwd=inner)
    assert r.code == 0 and "2026-07-22-auth-refactor" in r.out and r.err == "", r
    # the variable still wins over the working directory
    other = shelf.parent / "other"
    assert run_cli("init", "--shelf", other).code == 0
    r = run_cli("index", cwd=inner, env={"MEMSHELF_SHELF": str(other)})
    assert "shelf from $MEMSHELF_SHELF" in r.err and "auth-refactor" not in r.out, r


def test_mistyped_verb_suggests_the_closest(tmp_path):
    r = run_cli("serach", "foo", cwd=tmp_path)
    assert r.code == 2, r
    assert "unknown verb 'serach'" in r.err and "did you mean: memshelf search" in r.err
    assert "memshelf serach --help" not in r.err
    r = run_cli("zzzqqq", cwd=tmp_path)
    assert r.code == 2 and "did you mean" not in r.err and "memshelf --help" in r.err


def test_shelf_path_that_is_a_file_suggests_what_works(shelf, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = run_cli("index", "--shelf", afile)
    assert r.code == 1 and "is a file" in r.err, r
    assert f"init --shelf {afile}\n" not in r.err and "afile-shelf" in r.err
    assert afile.read_text() == "x" and not (tmp_path / "afile-shelf").exists()
    r = run_cli("index", "--shelf", shelf / "shelf.yml")
    assert r.code == 1 and f"--shelf {os.path.realpath(shelf)}" in r.err, r
