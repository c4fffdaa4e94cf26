"""How the `memshelf` command ends: pyproject's entry point, output written in full before the
process leaves without the interpreter's teardown, and the ways writing the output can fail."""
import os
import re
import subprocess
import sys

import pytest

from conftest import MEMSHELF, ROOT, run_cli, shelve_args


def _entry_point():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return re.search(r'(?m)^memshelf = "([\w.]+):(\w+)"', scripts).groups()


@pytest.fixture
def launcher(tmp_path):
    """A console script as pip writes one for pyproject's `memshelf` entry point."""
    module, func = _entry_point()
    path = tmp_path / "memshelf-launcher"
    path.write_text(f"import re\nimport sys\nsys.path.insert(0, {ROOT!r})\n"
                    f"from {module} import {func}\n"
                    "if __name__ == '__main__':\n"
                    "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                    f"    sys.exit({func}())\n")
    return [sys.executable, str(path)]


def _run(cmd, *args, **kw):
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True,
                          timeout=60, **kw)


def test_the_entry_point_is_the_command_that_ends_the_process(launcher):
    assert _entry_point() == ("memshelf", "cli")
    version = _run(launcher, "--version")
    assert version.returncode == 0 and version.stderr == ""
    assert re.fullmatch(r"memshelf \d+\.\d+\.\d+ \([0-9a-f]{12}\)\n", version.stdout)
    wrong = _run(launcher, "no-such-verb")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert "unknown verb 'no-such-verb'" in wrong.stderr and "fix:" in wrong.stderr


@pytest.mark.slow
def test_all_the_output_is_written_before_the_process_ends(launcher, shelf, tmp_path):
    decisions = "\n".join(f"- decision {n}: keep the write-ahead log for table {n}."
                          for n in range(600))
    assert run_cli(*shelve_args(shelf)[:-2], "--section", f"Decisions={decisions}").code == 0
    expected = run_cli("recall", "--id", "2026-07-22-auth-refactor", "--shelf", shelf).out
    assert len(expected) > 2 * 8192 and "decision 300:" in expected
    out = tmp_path / "recall.md"
    with open(out, "w") as f:   # a file: block-buffered, the last part written by the flush
        done = subprocess.run(launcher + ["recall", "--id", "2026-07-22-auth-refactor",
                                          "--shelf", str(shelf)],
                              stdout=f, stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == 0
    assert out.read_text() == expected


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--version"], ["index"], ["index", "--json"],
                                  ["doctor", "--json"]])
def test_a_reader_that_went_away_ends_quietly(launcher, shelf, args):
    assert run_cli(*shelve_args(shelf)).code == 0
    proc = subprocess.Popen(launcher + args + (["--shelf", str(shelf)] if args[0] != "--version"
                                               else []),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()   # before the command writes: its write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert err == ""   # no traceback, no "Exception ignored" from a flush at exit


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["--version"], ["index"], ["index", "--json"]])
def test_output_that_cannot_be_written_is_an_error(launcher, shelf, args):
    with open("/dev/full", "w") as full:
        done = subprocess.run(launcher + args + (["--shelf", str(shelf)]
                                                 if args[0] != "--version" else []),
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == "memshelf: error: could not write the output: " \
                          "No space left on device\n"


_AT_EXIT = """
import atexit, sys, threading, time
sys.path.insert(0, {root!r})
import memshelf
atexit.register(lambda: sys.stderr.write("interpreter teardown ran\\n"))
if sys.argv[1] == "thread":
    threading.Thread(target=time.sleep, args=(0.2,)).start()
if sys.argv[1] == "tracer":
    sys.settrace(lambda *a: None)
sys.argv = ["memshelf", "--version"]
memshelf.cli()
"""


@pytest.mark.parametrize("case, teardown", [("plain", False), ("thread", True),
                                            ("tracer", True)])
def test_the_teardown_is_skipped_only_when_nothing_waits_for_it(case, teardown):
    done = _run([sys.executable, "-c", _AT_EXIT.format(root=ROOT)], case)
    assert done.returncode == 0 and done.stdout.startswith("memshelf ")
    assert ("interpreter teardown ran" in done.stderr) == teardown


@pytest.mark.slow
def test_script_mode_ends_the_same_way(shelf):
    done = _run([sys.executable, MEMSHELF, "index", "--shelf", shelf])
    assert done.returncode == 0 and done.stdout.startswith("# ") and done.stderr == ""
    missing = _run([sys.executable, MEMSHELF, "index", "--shelf", shelf / "missing"])
    assert missing.returncode == 1 and "memshelf init --shelf" in missing.stderr
    assert _run([sys.executable, MEMSHELF, "index", "--no-such-flag"]).returncode == 2


def test_main_in_process_leaves_the_collector_as_it_found_it(tmp_path, capsys):
    # main() freezes what the import made for its call and thaws it after; a caller's own
    # freeze stays
    import gc
    import memshelf   # importable: conftest puts the repository on sys.path
    thresholds = gc.get_threshold()
    gc.unfreeze()
    missing = ["index", "--shelf", str(tmp_path / "none")]   # an error, answered as usual
    code = memshelf.main(missing)
    assert code != 0 and gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        assert memshelf.main(missing) == code
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()
    assert capsys.readouterr().err.count("fix:") == 2
