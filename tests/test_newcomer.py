"""Issue 22, a newcomer's first hour: the CLI speaks CLI words, finds its shelf, every verb's help
renders, and every answer is worth reading. The CLI runs as a subprocess throughout."""
import json
import os
import subprocess
import sys

import pytest

from conftest import MEMSHELF, ROOT, run_cli, shelve_args, snapshot


def _verbs():
    import memshelf
    return [v.name for v in memshelf._verb_table()]


# --- help and CLI words -----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("verb", _verbs())
def test_every_verb_help_renders(verb):
    r = run_cli(verb, "--help")
    assert r.code == 0 and "Traceback" not in r.err and "internal error" not in r.err, r
    assert r.out.startswith(f"usage: memshelf {verb}")


def test_merge_driver_help_shows_git_placeholders():
    r = run_cli("merge-driver", "--help")
    assert r.code == 0, r
    assert "%O %A %B" in r.out


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_shelf_path_that_is_a_file_suggests_what_works(shelf, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = run_cli("index", "--shelf", afile)
    assert r.code == 1 and "is a file" in r.err, r
    assert f"init --shelf {afile}\n" not in r.err and "afile-shelf" in r.err
    assert afile.read_text() == "x" and not (tmp_path / "afile-shelf").exists()
    r = run_cli("index", "--shelf", shelf / "shelf.yml")
    assert r.code == 1 and f"--shelf {os.path.realpath(shelf)}" in r.err, r


# --- output worth reading ---------------------------------------------------------------------

EPISODE = """---
id: 2026-07-22-db-move
kind: topic
approx_tokens: 24000
---
## Digest
Dana moved the primary database to the new cluster after a long and careful review that looked
at every replica, every backup window, every connection pool setting and every consumer of the
old host name. Open: retire the old host.

## Decisions
- The new primary is postgres://admin:hunter2secret@db.internal:5432/app for now.

## Artifacts
- Feature gates: `db_move_v2`, `replica_read`.
"""


@pytest.mark.slow
def test_shelve_names_id_address_and_redaction_and_fits_its_own_description(shelf, tmp_path):
    ep = tmp_path / "ep1.md"
    ep.write_text(EPISODE)
    r = run_cli("shelve", "--shelf", shelf, "--file", ep)
    assert r.code == 0, r
    first = r.out.splitlines()[0]
    assert "2026-07-22-db-move" in first and "docs/topics/2026-07-22-db-move.md" in first
    assert "redacted 1 (connection-string×1)" in first and "hunter2" not in r.out + r.err
    assert "warning" not in r.out + r.err          # the derived description is fitted silently
    long = "word " * 40
    r = run_cli("shelve", "--shelf", shelf, "--file", ep, "--slug", "2026-07-23-db-move",
                "--description", long)
    assert r.code == 0 and "warning" not in r.out, r
    assert "warning: description was" in r.err
    r = run_cli("shelve", "--shelf", shelf, "--file", ep, "--slug", "2026-07-24-db-move",
                "--description", long, "--quiet")
    assert r.code == 0 and r.err == "" and "shelved 2026-07-24-db-move" in r.out, r
    # --quiet never silences an error
    r = run_cli("shelve", "--shelf", shelf, "--file", ep, "--quiet")
    assert r.code == 1 and "already shelved" in r.err and "pass --amend" in r.err, r
    r = run_cli("call", "memshelf_shelve", json.dumps({
        "shelf_path": str(shelf), "slug": "2026-07-22-db-move", "kind": "topic",
        "digest": "Dana moved it; open: retire.", "sections": {"Decisions": "- moved"}}), "--json")
    assert r.code == 1 and "pass amend=true" in r.json()["error"]["fix"], r


@pytest.mark.slow
def test_shelve_dry_run_prints_the_episode(shelf, tmp_path):
    ep = tmp_path / "ep1.md"
    ep.write_text(EPISODE)
    before = snapshot(shelf)
    r = run_cli("shelve", "--shelf", shelf, "--file", ep, "--dry-run")
    assert r.code == 0, r
    assert r.out.startswith("# 2026-07-22-db-move\n") and "## Decisions" in r.out
    assert "«redacted:connection-string»" in r.out and "hunter2" not in r.out
    assert "dry run" in r.err and "nothing written" in r.err
    assert snapshot(shelf) == before


def test_call_exits_like_the_verb(tmp_path):
    bad = json.dumps({"digest": "We did it."})
    assert run_cli("lint-digest", "--digest", "We did it.").code == 1
    r = run_cli("call", "memshelf_lint_digest", bad)
    assert r.code == 1 and "referent-we" in r.out, r
    assert run_cli("call", "memshelf_lint_digest",
                   json.dumps({"digest": "Dana chose JWT; open: rotation."})).code == 0


@pytest.mark.slow
def test_stats_per_episode_prints_the_table(shelf, tmp_path):
    ep = tmp_path / "ep1.md"
    ep.write_text(EPISODE)
    assert run_cli("shelve", "--shelf", shelf, "--file", ep).code == 0
    assert run_cli(*shelve_args(shelf)).code == 0
    assert run_cli("recall", "--shelf", shelf, "--id", "2026-07-22-db-move",
                   "--section", "decisions").code == 0
    plain = run_cli("stats", "--shelf", shelf).out
    r = run_cli("stats", "--shelf", shelf, "--per-episode")
    assert r.code == 0 and r.out != plain, r
    rows = {line.split()[0]: line.split() for line in r.out.splitlines()
            if line.startswith("2026-")}
    assert set(rows) == {"2026-07-22-db-move", "2026-07-22-auth-refactor"}
    assert rows["2026-07-22-db-move"][1] == "24,000" and rows["2026-07-22-db-move"][3] == "1"
    assert r.out.rstrip().endswith(plain.rstrip())      # the banner still closes it


@pytest.mark.slow
def test_recall_outline_shows_cost_and_first_line(shelf, tmp_path):
    ep = tmp_path / "ep1.md"
    ep.write_text(EPISODE)
    assert run_cli("shelve", "--shelf", shelf, "--file", ep).code == 0
    r = run_cli("recall", "--shelf", shelf, "--id", "2026-07-22-db-move", "--outline")
    assert r.code == 0, r
    line = next(l for l in r.out.splitlines() if l.startswith("- Artifacts"))
    assert "tok): - Feature gates: `db_move_v2`" in line
    assert "- Decisions (~" in r.out
    fields = run_cli("recall", "--shelf", shelf, "--id", "2026-07-22-db-move", "--outline",
                     "--json").json()["sections"]
    assert all(s["first_line"] and s["tokens"] > 0 for s in fields)


@pytest.mark.slow
def test_rollup_index_line_is_its_digest(shelf):
    for n in (1, 2):
        assert run_cli(*shelve_args(shelf, slug=f"2026-01-0{n}-topic-{n}")).code == 0
    digest = "January rollup: Dana kept JWT middleware. Open: key rotation."
    r = run_cli("rollup", "--shelf", shelf, "--slug", "2026-01-31-january", "--until",
                "2026-01-31", "--digest", digest)
    assert r.code == 0, r
    index = (shelf / "INDEX.md").read_text()
    line = next(l for l in index.splitlines() if "2026-01-31-january" in l)
    assert "January rollup: Dana kept JWT middleware." in line and "Rollup of" not in line


@pytest.mark.slow
def test_demo_and_stats_say_the_same_standing_cost(tmp_path):
    where = tmp_path / "tour"
    r = subprocess.run([sys.executable, MEMSHELF, "demo", "--keep", "--shelf", str(where)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    said = int(r.stdout.split("(standing cost ~", 1)[1].split(" ", 1)[0])
    st = run_cli("stats", "--shelf", where, "--json").json()
    assert said == st["standing_cost"]
    assert f"standing {said} tok" in run_cli("stats", "--shelf", where).out


@pytest.mark.slow
def test_import_extract_writes_a_private_folder_and_out_takes_a_path(tmp_path):
    src = tmp_path / "notes.md"
    src.write_text("# Notes\n\n## User\n\nHow should Dana rotate keys?\n\n## Assistant\n\n"
                   "Monthly, with an overlap window.\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_cli("import", "extract", "--path", src, env={"TMPDIR": str(tmp)})
    assert r.code == 0, r
    (made,) = tmp.iterdir()
    assert made.name.startswith("memshelf-import-") and made.stat().st_mode & 0o077 == 0
    (written,) = made.iterdir()
    assert str(written) in r.out
    # --out on the CLI is a path, taken as given (documented in --help and docs/import.md)
    work = tmp_path / "work"
    work.mkdir()
    r = run_cli("import", "extract", "--path", src, "--out", "../evil.md", cwd=work)
    assert r.code == 0 and (tmp_path / "evil.md").is_file(), r
    assert str(tmp_path / "evil.md") in r.out
    assert "a path is taken as given" in " ".join(run_cli("import", "--help").out.split())
    (tmp_path / ".git").mkdir()
    r = run_cli("import", "extract", "--path", src, "--out", "../.git/x.md", cwd=work)
    assert r.code == 2 and not (tmp_path / ".git" / "x.md").exists(), r
    # over MCP (and `memshelf call`) only a bare name
    r = run_cli("call", "memshelf_import", json.dumps(
        {"method": "extract", "path": str(src), "out": "../evil2.md"}), cwd=work)
    assert r.code == 2 and not (tmp_path / "evil2.md").exists(), r


# --- a pip-less launcher ----------------------------------------------------------------------

@pytest.mark.slow
def test_install_launcher_compiles_once_into_home_and_says_where(tmp_path):
    import shutil
    home, copy = tmp_path / "home", tmp_path / "src"
    home.mkdir()
    copy.mkdir()
    shutil.copy(MEMSHELF, copy / "memshelf.py")
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_DATA_HOME", "PYTHONPATH")}
    env.update(HOME=str(home), PATH=os.defpath)

    def run(*args, **extra):
        return subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=60,
                              env={**env, **extra})
    r = run(sys.executable, copy / "memshelf.py", "install-launcher")
    assert r.returncode == 0, r.stderr
    launcher = home / ".local" / "bin" / "memshelf"
    cache = home / ".local" / "share" / "memshelf" / "pycache"
    assert str(launcher) in r.stdout and str(cache) in r.stdout and "NOT on PATH" in r.stdout
    assert os.access(launcher, os.X_OK)
    (pyc,) = cache.rglob("memshelf.*.pyc")
    assert not (copy / "__pycache__").exists()          # the bytecode lives in the user's folder
    r = run(launcher, "--version")
    assert r.returncode == 0 and r.stdout.startswith("memshelf "), r.stderr
    r = run(launcher, "lint-digest", "--digest", "We did it.")
    assert r.returncode == 1 and "referent-we" in r.stdout
    # SIGINT at any instant of the launcher's start-up ends it without a traceback from a line
    # of the launcher or memshelf. CPython's own start-up is out of reach: a signal that lands
    # while it compiles the launcher, or before its first line, shows as "line 0"
    import re
    import signal
    import time
    for step in range(40):
        p = subprocess.Popen([str(launcher), "--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        time.sleep(step * 0.002)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        ours = [(path, line) for path, line in re.findall(r'File "([^"]+)", line (\d+)', err)
                if path == str(launcher) and line != "0" or path.endswith("memshelf.py")]
        assert not ours, (step, err)
        # CPython's own start-up may die of it too (a frozen module's traceback, a "Fatal
        # Python error"), before any line of a file runs: its exit code is its own
        assert p.returncode in (0, 130, -signal.SIGINT) or "KeyboardInterrupt" in err or \
            "Fatal Python error" in err, (step, p.returncode, err)
    compiled = pyc.read_bytes()
    with open(copy / "memshelf.py", "a") as f:
        f.write("\n# changed\n")
    assert run(launcher, "--version").returncode == 0
    assert pyc.read_bytes() != compiled                  # recompiled once the file changed
    r = run(sys.executable, copy / "memshelf.py", "install-launcher",
            PATH=f"{launcher.parent}{os.pathsep}{os.defpath}")
    assert r.returncode == 0 and "is on PATH" in r.stdout, r.stderr
    # something else called memshelf in the way is never replaced
    other = tmp_path / "bin"
    other.mkdir()
    (other / "memshelf").write_text("#!/bin/sh\necho pip\n")
    r = run(sys.executable, copy / "memshelf.py", "install-launcher", "--bin-dir", other)
    assert r.returncode == 1 and "not a memshelf launcher" in r.stderr
    assert (other / "memshelf").read_text() == "#!/bin/sh\necho pip\n"
    # a moved source file: the launcher says what to do
    os.rename(copy / "memshelf.py", copy / "moved.py")
    r = run(launcher, "--version")
    assert r.returncode == 1 and "install-launcher" in r.stderr


# --- docs -------------------------------------------------------------------------------------

def test_docs_import_examples_are_read_as_documented(tmp_path):
    import re
    with open(os.path.join(ROOT, "docs", "import.md"), encoding="utf-8") as f:
        doc = f.read()
    blocks = re.findall(r"```(jsonl|json|markdown)\n(.*?)```", doc, re.S)
    expected = [("session.jsonl", "claude-code-jsonl"), ("claude.json", "claude-json"),
                ("chatgpt.json", "chatgpt-json"), ("notes.md", "markdown")]
    assert len(blocks) == len(expected)
    for (name, fmt), (_lang, body) in zip(expected, blocks):
        path = tmp_path / name
        path.write_text(body, encoding="utf-8")
        r = run_cli("import", "discover", "--path", path, "--json")
        assert r.code == 0, (name, r)
        d = r.json()
        assert d["format"] == fmt and d["conversations"][0]["messages"] == 2, (name, d)


def test_docs_speak_one_truth_and_cite_their_own_files():
    def read(*parts):
        with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
            return f.read()
    for parts in (("README.md",), ("docs", "chat-projects.md"), ("docs", "architecture.md"),
                  ("bench", "README.md"), ("docs", "import.md")):
        text = read(*parts)
        assert "pip install memshelf" not in text, parts
        assert "shared/spec" not in text and "spec/" not in text, parts
    readme = read("README.md")
    assert "pip install ." in readme and "install-launcher" in readme
    assert "docs/import.md" in readme


@pytest.mark.slow
def test_doctors_amend_fix_runs_inside_the_shelf(shelf):
    assert run_cli(*shelve_args(shelf)).code == 0
    rel = "docs/topics/2026-07-22-auth-refactor.md"
    text = (shelf / rel).read_text()
    (shelf / rel).write_text(text.replace("Dana chose", "We chose"))
    r = run_cli("doctor", "--shelf", shelf)
    assert "digest-referent-we" in r.out and "memshelf shelve --amend --file" in r.out, r
    (shelf / rel).write_text(text.replace("Dana chose", "Priya chose"))
    r = run_cli("shelve", "--amend", "--file", rel, cwd=shelf)        # doctor's fix, as written
    assert r.code == 0 and "shelf from the working directory" in r.err, r
    assert "digest-referent-we" not in run_cli("doctor", cwd=shelf / "docs").out
