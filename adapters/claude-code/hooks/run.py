#!/usr/bin/env python3
"""Run one memshelf verb for the Claude Code plugin: `run.py hook EVENT` or `run.py serve`.

memshelf is found in this order: MEMSHELF_PY (a path to memshelf.py); memshelf.py in the plugin
root (the built plugin); memshelf.py two folders above the plugin root (a repository checkout);
`memshelf` on PATH. A memshelf.py file runs inside this interpreter (no second start-up, and its
bytecode is cached); the command on PATH runs as a child with stdin passed through.

A hook must never break a session: for `hook` every failure, including not finding memshelf,
ends with exit 0 and no output. For `serve` a missing memshelf is an error (exit 1).
Standard library only; Python 3.9+.
"""
import os
import sys


def plugin_roots():
    """The plugin folder: CLAUDE_PLUGIN_ROOT when the host set it, and this file's grandparent."""
    roots = []
    env = os.environ.get("CLAUDE_PLUGIN_ROOT", "")
    if env.strip() and "${" not in env:
        roots.append(os.path.expanduser(env.strip()))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if here not in roots:
        roots.append(here)
    return roots


def find_memshelf():
    """("file", path to memshelf.py) or ("command", path of `memshelf`) or (None, None)."""
    candidates = []
    explicit = os.environ.get("MEMSHELF_PY", "").strip()
    if explicit and "${" not in explicit:
        candidates.append(os.path.expanduser(explicit))
    for root in plugin_roots():
        candidates.append(os.path.join(root, "memshelf.py"))
        candidates.append(os.path.join(root, os.pardir, os.pardir, "memshelf.py"))
    for path in candidates:
        if os.path.isfile(path):
            return "file", os.path.realpath(path)
    import shutil
    command = shutil.which("memshelf")
    if command:
        return "command", command
    return None, None


def run_file(path, args):
    """Load memshelf.py as the module `memshelf` (server.py imports it by that name) and run."""
    import importlib.util
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)    # serve finds server.py next to memshelf.py
    spec = importlib.util.spec_from_file_location("memshelf", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["memshelf"] = module
    spec.loader.exec_module(module)
    return module.main(list(args))


def run_command(command, args):
    import subprocess
    return subprocess.call([command] + list(args))


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    is_hook = bool(args) and args[0] == "hook"
    if not args:
        sys.stderr.write("usage: run.py hook EVENT | run.py serve\n")
        return 2
    try:
        if sys.version_info < (3, 9):
            if is_hook:
                return 0
            sys.stderr.write("memshelf needs Python 3.9 or newer; this is "
                             f"{sys.version.split()[0]} ({sys.executable})\n")
            return 1
        kind, path = find_memshelf()
        if kind is None:
            if is_hook:
                return 0
            sys.stderr.write(
                "memshelf: memshelf.py was not found (looked at MEMSHELF_PY, the plugin folder, "
                "the checkout above it, and `memshelf` on PATH)\n"
                "  fix: set MEMSHELF_PY to the path of memshelf.py, or `pip install memshelf`, "
                "or build the self-contained plugin: python3 build_mcpb.py --plugin DIR\n")
            return 1
        code = run_file(path, args) if kind == "file" else run_command(path, args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:
        if is_hook:
            return 0
        sys.stderr.write(f"memshelf: could not start: {type(exc).__name__}: {exc}\n")
        return 1
    return 0 if is_hook else (code or 0)


if __name__ == "__main__":
    sys.exit(main())
