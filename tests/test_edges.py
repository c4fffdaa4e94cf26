"""Faults at the edges (issue 31): a successful write never leaves git ready to delete it, repair
never commits damage, --out never overwrites what memshelf did not create. Every case drives real
git and the real CLI, server and bundle as processes; nothing is mocked."""
import json
import os
import stat
import subprocess
import sys
import time

import pytest

from conftest import MEMSHELF, ROOT, SERVER, copy_of_template, git, run_cli

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcp_client import McpClient, clean_env  # noqa: E402

DIGEST = "Ana chose A over B for speed. Open: none."


def shelve(root, slug, extra=(), **kw):
    return run_cli("shelve", "--shelf", root, "--slug", slug, "--kind", "topic", "--digest",
                   DIGEST, "--section", "Decisions=A", *extra, **kw)


def status(root):
    return git(root, "status", "--porcelain", "--untracked-files=all")


def doctor(root, *extra):
    r = run_cli("doctor", "--shelf", root, "--json", *extra)
    assert r.code in (0, 1), r
    return r, {f["code"]: f for f in r.json()["findings"]}, r.json()["findings"]


def _three_topics(root):
    assert run_cli("init", "--shelf", root).code == 0
    for i, word in enumerate(("alpha", "bravo", "charlie")):
        assert shelve(root, f"2026-11-0{i + 1}-{word}-topic").code == 0


@pytest.fixture
def shelf3(tmp_path, tmp_path_factory):
    """A git shelf with three committed episodes (built once, copied for each test)."""
    return copy_of_template(tmp_path_factory, tmp_path / "shelf", "edges-three", _three_topics)


# 1. the commit point: HEAD, the real index and the tree agree, or the verb says so -------------

@pytest.mark.slow
def test_index_update_failure_after_commit_is_retried(shelf):
    hook = shelf / ".git" / "hooks" / "post-commit"
    hook.write_text("#!/bin/sh\n: > .git/index.lock\n"
                    "( sleep 1.5; rm -f .git/index.lock ) >/dev/null 2>&1 </dev/null &\n")
    hook.chmod(0o755)
    r = shelve(shelf, "2026-12-01-lock-race")
    assert r.code == 0, r
    assert not (shelf / ".git" / "index.lock").exists()
    assert status(shelf) == "", status(shelf)


@pytest.mark.slow
def test_index_that_stays_locked_fails_the_verb_and_repair_fixes_it(shelf):
    hook = shelf / ".git" / "hooks" / "post-commit"
    hook.write_text("#!/bin/sh\n: > .git/index.lock\n"
                    "( sleep 20; rm -f .git/index.lock ) >/dev/null 2>&1 </dev/null &\n")
    hook.chmod(0o755)
    r = shelve(shelf, "2026-12-01-lock-held")
    assert r.code == 1, r
    assert "memshelf repair" in r.err and "landed" in r.err, r
    # after the commit point nothing is undone: the tree keeps what HEAD holds
    episode = shelf / "docs" / "topics" / "2026-12-01-lock-held.md"
    assert episode.read_bytes() == git(shelf, "show", f"HEAD:{episode.relative_to(shelf)}",
                                       ).encode()
    hook.unlink()
    os.unlink(shelf / ".git" / "index.lock")
    assert run_cli("repair", "--shelf", shelf).code == 0
    assert status(shelf) == ""
    assert "docs/topics/2026-12-01-lock-held.md" in git(shelf, "ls-files")


# 2. git failures are findings; repair rebuilds a broken index first ---------------------------

@pytest.mark.slow
def test_broken_index_is_a_finding_and_repair_restores_from_head(shelf3):
    index = shelf3 / ".git" / "index"
    data = index.read_bytes()
    index.write_bytes(data[:len(data) // 2])
    gone = shelf3 / "docs" / "topics" / "2026-11-02-bravo-topic.md"
    gone.unlink()
    r, codes, _ = doctor(shelf3)
    assert r.code == 1, r
    assert "git-failed" in codes, codes
    assert any(f["path"] == "docs/topics/2026-11-02-bravo-topic.md"
               for f in r.json()["findings"]), r.out
    r = run_cli("repair", "--shelf", shelf3)
    assert r.code == 0, r
    assert gone.exists()
    assert "2026-11-02-bravo-topic" in git(shelf3, "show", "HEAD:INDEX.md")
    assert status(shelf3) == ""
    assert doctor(shelf3)[0].code == 0


# 3. --out: a new regular file, or one memshelf wrote before; nothing else -------------------

VIEWS = (["graph"], ["retro", "--since", "2026-01-01"], ["mirror"],
         ["fork", "--episode", "2026-11-01-alpha-topic"])


@pytest.mark.slow
@pytest.mark.parametrize("view", VIEWS, ids=lambda v: v[0])
def test_out_refuses_what_it_did_not_write(shelf3, tmp_path, view):
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.txt"
    os.symlink(outside, link)
    targets = [fifo, link, outside, shelf3 / "INDEX.md", shelf3 / "shelf.yml",
               shelf3 / "docs" / "topics" / "2026-11-01-alpha-topic.md",
               shelf3 / "docs" / "topics" / "new.html", shelf3 / ".git" / "x"]
    if os.geteuid() == 0:
        dev = tmp_path / "null"
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        targets.append(dev)
    before = {t: (os.lstat(t).st_mode, t.read_bytes() if t.is_file() and not t.is_symlink()
                  else None) for t in targets if os.path.lexists(t)}
    for target in targets:
        r = run_cli(view[0], "--shelf", shelf3, *view[1:], "--out", target, env=env)
        assert r.code == 2, (target, r)
        assert "--out" in r.err and "pass" in r.err, r
    after = {t: (os.lstat(t).st_mode, t.read_bytes() if t.is_file() and not t.is_symlink()
                 else None) for t in targets if os.path.lexists(t)}
    assert after == before
    assert not (shelf3 / "docs" / "topics" / "new.html").exists()
    fresh = tmp_path / "fresh.out"
    assert run_cli(view[0], "--shelf", shelf3, *view[1:], "--out", fresh, env=env).code == 0
    assert fresh.is_file()
    r = run_cli(view[0], "--shelf", shelf3, *view[1:], "--out", fresh, env=env)
    assert r.code == 0, r   # a file memshelf wrote before is replaced
    fresh.write_text("edited by hand\n")
    r = run_cli(view[0], "--shelf", shelf3, *view[1:], "--out", fresh, env=env)
    assert r.code == 2 and fresh.read_text() == "edited by hand\n", r


# 4. temporary git index files a SIGKILL left -------------------------------------------------

def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.slow
def test_stale_private_index_is_named_removed_and_never_blocks(shelf3):
    git_dir = shelf3 / ".git"
    pid = dead_pid()
    for name in (f"memshelf-index-{pid}", f"memshelf-index-{pid}.lock"):
        (git_dir / name).write_bytes(b"DIRC")
    _, codes, found = doctor(shelf3)
    assert "git-temp-stale" in codes, found
    assert str(pid) in codes["git-temp-stale"]["detail"]
    assert run_cli("repair", "--shelf", shelf3).code == 0
    assert not any(n.startswith("memshelf-index-") for n in os.listdir(git_dir))
    # a leftover under the writer's own pid: the writer clears it instead of failing
    code = ("import os, sys, memshelf\n"
            "g = os.path.join(sys.argv[1], '.git', f'memshelf-index-{os.getpid()}.lock')\n"
            "open(g, 'wb').close()\n"
            "sys.exit(memshelf.main(['shelve', '--shelf', sys.argv[1], '--slug', "
            "'2026-12-02-same-pid', '--kind', 'topic', '--digest', sys.argv[2], "
            "'--section', 'Decisions=A']))\n")
    p = subprocess.run([sys.executable, "-c", code, str(shelf3), DIGEST], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    assert status(shelf3) == ""


# 5. repair never commits an episode doctor calls an error ------------------------------------

@pytest.mark.slow
def test_repair_leaves_a_binary_episode_uncommitted(shelf3):
    path = shelf3 / "docs" / "topics" / "2026-11-01-alpha-topic.md"
    good = path.read_bytes()
    path.write_bytes(good.replace(b"## Decisions", b"## Deci\x00sions"))
    r = run_cli("repair", "--shelf", shelf3)
    assert "2026-11-01-alpha-topic.md" in r.out + r.err, r
    assert git(shelf3, "show", "HEAD:docs/topics/2026-11-01-alpha-topic.md").encode() == good


@pytest.mark.slow
def test_repair_leaves_an_oversize_episode_uncommitted(shelf3):
    path = shelf3 / "docs" / "topics" / "2026-11-01-alpha-topic.md"
    good = path.read_bytes()
    path.write_bytes(good + b"\n## Raw excerpts\n" + b"x" * (9 << 20) + b"\n")
    r = run_cli("repair", "--shelf", shelf3)
    assert "2026-11-01-alpha-topic.md" in r.out + r.err, r
    assert git(shelf3, "show", "HEAD:docs/topics/2026-11-01-alpha-topic.md").encode() == good


def test_shelve_refuses_nul_up_front(shelf):
    r = run_cli("shelve", "--shelf", shelf, "--slug", "2026-12-03-nul-byte", "--kind", "topic",
                "--digest", DIGEST, "--section-file", "Decisions=/dev/stdin",
                input="a\x00b\n")
    assert r.code in (1, 2) and "NUL" in r.err, r
    assert not (shelf / "docs" / "topics" / "2026-12-03-nul-byte.md").exists()


# 6. a category folder linked outside -------------------------------------------------------

@pytest.mark.slow
def test_linked_category_is_named_not_git_raw(shelf3, tmp_path):
    topics = shelf3 / "docs" / "topics"
    moved = tmp_path / "moved-topics"
    os.rename(topics, moved)
    os.symlink(moved, topics)
    _, codes, found = doctor(shelf3)
    missing = {f["path"] for f in found if f["code"] in ("committed-missing", "category-linked")}
    for word in ("alpha", "bravo", "charlie"):
        assert f"docs/topics/2026-11-0{'abc'.index(word[0]) + 1}-{word}-topic.md" in missing, found
    r = run_cli("repair", "--shelf", shelf3)
    assert "beyond a symbolic link" not in r.out + r.err, r
    assert "docs/topics" in r.out + r.err and "link" in r.out + r.err, r
    assert git(shelf3, "ls-tree", "--name-only", "HEAD", "docs/topics/").count(".md") == 3


# 7. text that is not Unicode --------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--digest", "--section", "--notes"])
def test_invalid_utf8_in_argv_is_a_usage_error(shelf, flag):
    args = [b"shelve", b"--shelf", str(shelf).encode(), b"--slug", b"2026-12-04-bad-bytes",
            b"--kind", b"topic", b"--digest", DIGEST.encode(), b"--section", b"Decisions=A"]
    bad = b"caf\xe9 au lait"
    if flag == "--section":
        args += [b"--section", b"Notes=" + bad]
    else:
        args += [flag.encode(), bad]
    p = subprocess.run([sys.executable, "-m", "memshelf", *args], capture_output=True,
                       env=dict(os.environ, LC_ALL="C.UTF-8"))
    assert p.returncode == 2, p
    err = p.stderr.decode("utf-8", "replace")
    assert flag in err and "internal" not in err, err
    assert not (shelf / "docs" / "topics" / "2026-12-04-bad-bytes.md").exists()


def mcp(cwd, *argv, **env):
    e = clean_env(**env)
    return McpClient([sys.executable, SERVER, *argv], env=e, cwd=str(cwd))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["digest", "section", "section name", "notes"])
def test_lone_surrogates_over_mcp_are_argument_errors(shelf, where):
    args = {"shelf_path": str(shelf), "slug": "2026-12-04-surrogate", "kind": "topic",
            "digest": DIGEST, "sections": {"Decisions": "A"}}
    if where == "digest":
        args["digest"] = "Ana chose \ud800 over B. Open: none."
    elif where == "section":
        args["sections"] = {"Decisions": "A \udfff"}
    elif where == "section name":
        args["sections"] = {"Decisions": "A", "No\ud800tes": "x"}
    else:
        args["notes"] = "n\udc80"
    with mcp(shelf) as c:
        c.initialize()
        rid = c.start_request("tools/call", {"name": "memshelf_shelve", "arguments": args})
        got = c.wait_response(rid)
        assert "error" not in got, got
        result = got["result"]
        assert result["isError"], result
        text = "\n".join(b["text"] for b in result["content"])
        assert "usage" in text and ("sections" if "section" in where else where) in text, text
    assert not (shelf / "docs" / "topics" / "2026-12-04-surrogate.md").exists()


# 8. doctor's words for a stale index ------------------------------------------------------

@pytest.mark.slow
def test_stale_index_is_not_called_missing_from_head(shelf3):
    git(shelf3, "read-tree", "HEAD~1")
    _, _, found = doctor(shelf3)
    text = json.dumps(found)
    assert "2026-11-03-charlie-topic" in text, found
    assert "every clone lack" not in text, found
    assert "HEAD holds" in text, found
    assert run_cli("repair", "--shelf", shelf3).code == 0
    assert status(shelf3) == ""


# 9. the committed INDEX lists exactly the committed episodes ---------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("leftover", ["untracked", "binary"])
def test_committed_index_lists_only_committed_episodes(shelf3, leftover):
    stray = shelf3 / "docs" / "topics" / "2026-11-09-stray-file.md"
    if leftover == "untracked":
        stray.write_text((shelf3 / "docs" / "topics" / "2026-11-01-alpha-topic.md").read_text()
                         .replace("2026-11-01-alpha-topic", "2026-11-09-stray-file"))
    else:
        stray.write_bytes(os.urandom(200000))
    r = shelve(shelf3, "2026-12-05-after-stray")
    assert r.code == 0, r
    head = git(shelf3, "ls-tree", "-r", "--name-only", "HEAD")
    assert "2026-11-09-stray-file" not in head
    assert "2026-11-09-stray-file" not in git(shelf3, "show", "HEAD:INDEX.md")
    assert "2026-11-09-stray-file" not in git(shelf3, "show", "HEAD:ledger.tsv")
    _, codes, found = doctor(shelf3)
    assert any(f["path"] == "docs/topics/2026-11-09-stray-file.md" for f in found), found
    r = run_cli("rebuild", "--commit", "--shelf", shelf3)   # the same rule for rebuild --commit
    assert r.code == 0 and "2026-11-09-stray-file" in r.out + r.err, r
    assert "2026-11-09-stray-file" not in git(shelf3, "show", "HEAD:INDEX.md")


def test_a_reset_makes_the_next_shelve_ask_git_for_strays_again(shelf3):
    # a shelve that committed every episode file remembers that commit with its render; the
    # next one asks git for untracked episodes only when the listing or HEAD moved since
    assert shelve(shelf3, "2026-12-05-first").code == 0
    memo = json.loads((shelf3 / ".memshelf" / "state.json").read_text())["render_memo"]
    assert memo["committed"] == git(shelf3, "rev-parse", "HEAD").strip()
    assert shelve(shelf3, "2026-12-06-second").code == 0
    git(shelf3, "reset", "-q", "--mixed", "HEAD~1")   # the second is untracked, its file stays
    r = shelve(shelf3, "2026-12-07-third")
    assert r.code == 0 and "2026-12-06-second" in r.out + r.err, r
    assert "2026-12-06-second" not in git(shelf3, "ls-tree", "-r", "--name-only", "HEAD")
    assert "2026-12-06-second" not in git(shelf3, "show", "HEAD:INDEX.md")
    # a stray was left out: no render claims the commit it went into
    memo = json.loads((shelf3 / ".memshelf" / "state.json").read_text())["render_memo"]
    assert memo.get("committed") != git(shelf3, "rev-parse", "HEAD").strip()
    r = shelve(shelf3, "2026-12-08-fourth")   # and the next shelve still leaves it out
    assert r.code == 0 and "2026-12-06-second" in r.out + r.err, r
    assert "2026-12-06-second" not in git(shelf3, "show", "HEAD:INDEX.md")


# 10. doctor and repair see the shelf lock --------------------------------------------------

@pytest.mark.slow
def test_doctor_reports_a_write_in_progress(shelf3):
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time, memshelf\n"
                               "with memshelf._ShelfLock(sys.argv[1]):\n"
                               "    print('held', flush=True); time.sleep(6)\n", str(shelf3)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        r = run_cli("doctor", "--shelf", shelf3)
        assert time.monotonic() - start < 5.5
        assert f"a write is in progress (pid {holder.pid})" in r.out + r.err, r
        assert "repair" not in r.out + r.err, r
        r = run_cli("repair", "--shelf", shelf3)   # waits for the lock, then finds nothing
        assert r.code == 0 and holder.poll() is not None, r
    finally:
        holder.kill()
        holder.wait()


# 11. MCP import reads regular files under a limit; server.py --shelf ------------------------

def test_mcp_import_refuses_special_and_unreadable_files(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:SECRETHASHVALUE:19000:0:99999:7:::\n")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(300 << 20)
    with mcp(tmp_path) as c:
        c.initialize()
        for path in (str(secret), "/dev/zero", str(big)):
            result = c.call_tool("memshelf_import", {"method": "discover", "path": path},
                                 validate_output=False)
            assert result["isError"], result
            text = json.dumps(result)
            assert "SECRETHASHVALUE" not in text and "root:" not in text, text
            if path != str(secret):
                assert ("MiB" if path == str(big) else "not a regular file") in text, text


@pytest.mark.slow
@pytest.mark.parametrize("launch", [[SERVER], ["-m", "memshelf", "serve"]],
                         ids=["server.py", "memshelf serve"])
def test_server_shelf_argument(shelf, launch):
    c = McpClient([sys.executable, *launch, "--shelf", str(shelf)], env=clean_env(),
                  cwd=str(shelf.parent))
    with c:
        c.initialize()
        result = c.call_tool("memshelf_shelve", {"slug": "2026-12-06-by-argument",
                                                 "kind": "topic", "digest": DIGEST,
                                                 "sections": {"Decisions": "A"}})
        assert not result.get("isError"), result
    assert (shelf / "docs" / "topics" / "2026-12-06-by-argument.md").exists()


# 12. an extension update unpacked over the old folder never runs the old code ---------------

@pytest.mark.slow
def test_bundle_update_over_the_old_folder_runs_the_new_code(tmp_path):
    import zipfile
    import build_mcpb
    out = tmp_path / "dist"
    env = {"PATH": os.path.dirname(sys.executable), "HOME": os.environ.get("HOME", "/")}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "build_mcpb.py"), "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    version = build_mcpb.read_version(MEMSHELF)
    bundle = out / f"memshelf-{version}.mcpb"
    ext = tmp_path / "extension"
    dated = time.mktime((1980, 1, 1, 0, 0, 0, 0, 0, -1))

    def unpack(replace=None):
        # as the host does: the zip's 1980-01-01 dates on every file, over the old folder
        with zipfile.ZipFile(bundle) as zf:
            for info in zf.infolist():
                data = zf.read(info)
                if replace and info.filename == "memshelf.py":
                    data = replace(data)
                path = ext / info.filename
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                os.utime(path, (dated, dated))

    def served_version():
        c = McpClient([sys.executable, str(ext / "server.py")], env=clean_env(),
                      cwd=str(tmp_path))
        try:
            return c.initialize()["serverInfo"]["version"]
        finally:
            c.close()

    unpack()
    assert served_version() == version
    assert any(n.startswith("memshelf.") for n in os.listdir(ext / "__pycache__"))
    newer = version[:-1] + ("9" if version[-1] != "9" else "8")   # the same size
    unpack(lambda data: data.replace(f'__version__ = "{version}"'.encode(),
                                     f'__version__ = "{newer}"'.encode(), 1))
    assert (ext / "memshelf.py").stat().st_size == os.path.getsize(MEMSHELF)
    assert served_version() == newer
