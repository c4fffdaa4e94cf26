"""Shared fixtures: the real CLI as a subprocess, real git shelves in temporary folders."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMSHELF = os.path.join(ROOT, "memshelf.py")
SERVER = os.path.join(ROOT, "server.py")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Tests never inherit a default shelf or a debug switch from the developer's environment.
for _name in ("MEMSHELF_SHELF", "MEMSHELF_SHELF_PATH", "MEMSHELF_ROOT", "MEMSHELF_DEBUG",
              "MEMSHELF_CHECKOUT", "MEMSHELF_PROGRESS", "MEMSHELF_CONTEXT_WINDOW"):
    os.environ.pop(_name, None)
# Let the interpreter cache memshelf's bytecode: the CLI runs as `python3 -m memshelf`, which
# reads __pycache__, so each of the hundreds of CLI calls skips compiling the 10k-line file.
# (Script mode, `python3 memshelf.py`, is exercised by its own tests.)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# The same for pytest itself: with bytecode writing off it rewrites the asserts of every test
# module again on each run (a third of collection); on, it keeps them in tests/__pycache__.
sys.dont_write_bytecode = False
os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"]
                                   if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("GIT_AUTHOR_NAME", "memshelf tests")
os.environ.setdefault("GIT_AUTHOR_EMAIL", "tests@example.invalid")
os.environ.setdefault("GIT_COMMITTER_NAME", "memshelf tests")
os.environ.setdefault("GIT_COMMITTER_EMAIL", "tests@example.invalid")


class CLIResult:
    def __init__(self, proc):
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr

    def json(self):
        return json.loads(self.out)

    def __repr__(self):
        return f"<exit {self.code}\nstdout: {self.out[-2000:]}\nstderr: {self.err[-2000:]}>"


def run_cli(*args, input=None, env=None, cwd=None, timeout=60):
    """Run `python3 memshelf.py ARGS` and return exit code, stdout and stderr."""
    full_env = dict(os.environ)
    if env:
        for k, v in env.items():
            if v is None:
                full_env.pop(k, None)
            else:
                full_env[k] = v
    proc = subprocess.run([sys.executable, "-m", "memshelf", *map(str, args)], input=input,
                          capture_output=True, text=True, env=full_env, cwd=cwd,
                          timeout=timeout)
    return CLIResult(proc)


@pytest.fixture
def cli():
    return run_cli


_TEMPLATES = {}


def copy_of_template(tmp_path_factory, dest, key, build):
    """A copy at `dest` of the shelf `build(root)` makes, built once per session under `key`.

    For read-write setups that many tests repeat: each test gets its own copy, as if it had
    built it (file mtimes are the copy's; the store's stamps miss once and are read again)."""
    import shutil
    if key not in _TEMPLATES:
        root = tmp_path_factory.mktemp("template-" + key) / "shelf"
        build(root)
        _TEMPLATES[key] = root
    shutil.copytree(_TEMPLATES[key], dest, symlinks=True, copy_function=shutil.copy)
    return dest


def _init(root, *extra):
    r = run_cli("init", "--shelf", root, *extra)
    assert r.code == 0, r


@pytest.fixture
def shelf(tmp_path, tmp_path_factory):
    """A fresh git-local shelf made by the real CLI (one `init`, copied for each test)."""
    return copy_of_template(tmp_path_factory, tmp_path / "shelf", "git", _init)


@pytest.fixture
def plain_shelf(tmp_path, tmp_path_factory):
    return copy_of_template(tmp_path_factory, tmp_path / "plain", "plain",
                            lambda root: _init(root, "--storage", "plain"))


def snapshot(root):
    """Every file under root (except .git internals and the cache) with its bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.split(os.sep)[0] in (".git", ".memshelf"):
            dirnames[:] = []
            continue
        for n in filenames:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


def git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True).stdout


def shelve_args(root, slug="2026-07-22-auth-refactor", kind="topic", digest=None, extra=()):
    digest = digest or ("Dana chose JWT middleware over sessions; rejected per-route "
                        "decorators. Open: key rotation.")
    args = ["shelve", "--shelf", root, "--slug", slug, "--kind", kind, "--digest", digest]
    if kind == "topic":
        args += ["--section", "Decisions=- JWT verified once per request in middleware."]
    elif kind == "session":
        args += ["--section", "Timeline=1. Merged.", "--section", "Open threads=- Changelog."]
    else:
        args += ["--section", "Findings=allkeys-lru wins at 94 % hit rate."]
    return args + list(extra)


def chart_rows(ledger):
    """The rows 0.4.0 charts from a ledger text: five cells or more, two integer counts (as
    episode records holding what the chart reads of them)."""
    import memshelf
    rows = []
    for line in ledger.splitlines()[1:]:
        cells = line.split("\t")
        try:
            rows.append(memshelf.Episode("", "", "", False, 0, date=cells[0],
                                         approx_tokens=int(cells[3]),
                                         digest_tokens=int(cells[4])))
        except (IndexError, ValueError):
            continue
    return rows


def edit_in_place(path, old, new, keep_mtime=False):
    """Rewrite a file through the same inode (open, rewrite, truncate), as many editors do;
    the directory's mtime does not move. keep_mtime: the file's mtime is put back too."""
    assert len(old) == len(new)
    st = os.stat(path)
    parent = os.stat(os.path.dirname(path))
    with open(path, "r+", encoding="utf-8") as f:
        text = f.read()
        assert old in text
        f.seek(0)
        f.write(text.replace(old, new))
        f.truncate()
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.utime(os.path.dirname(path), ns=(parent.st_atime_ns, parent.st_mtime_ns))
    after = os.stat(path)
    assert after.st_size == st.st_size and after.st_ino == st.st_ino


def age_files(root, seconds=30):
    """Put every shelf file's mtime `seconds` in the past. A file written within the file
    system's timestamp granularity of a read could change again without its stamp moving, so
    what is read from it is remembered only with its content (docs/architecture.md); tests
    that check what is remembered age the files first, as any shelf ages between sessions.
    The ctimes stay now (nothing can set them): for two seconds the files still count as racy."""
    import time
    past = time.time() - seconds
    for dirpath, dirnames, names in os.walk(str(root)):
        dirnames[:] = [d for d in dirnames if d not in (".git", ".memshelf")]
        for name in names:
            os.utime(os.path.join(dirpath, name), (past, past))


def memo_current(root):
    """Whether the derived files on disk are the render remembered under the current store key."""
    import memshelf
    key, _ = memshelf._render_key(root, memshelf._index_format(root))
    return memshelf._render_memo_hit(root, key) is not None
