"""The documentation stays true to the repository (issue 32): no reference to a file outside it,
every function docs/architecture.md names exists, every verb and every banner section is mapped."""
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = ["memshelf.py", "server.py"]
DOCS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# `<name>.md §`: a section of a Markdown file, which must be one this repository holds
SECTION_REF = re.compile(r"([\w./-]*\.md) §")
# `§ 3.3` with no file: a numbered section of a specification this repository does not hold
# (docs number their own sections only in docs/chat-projects.md, and YAML's spec is public)
NUMBERED_REF = re.compile(r"(?<!\.md )(?<!YAML )§ \d")


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def repo_markdown():
    return {os.path.relpath(p, ROOT) for p in
            glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True)}


def resolves(name, held):
    """A reference names a file in the repository: by its path, or by its name in docs/."""
    name = name.lstrip("./")
    return name in held or f"docs/{name}" in held


def test_no_reference_outside_the_repository():
    held = repo_markdown()
    problems = []
    for rel in CODE + DOCS:
        for n, line in enumerate(read(rel).split("\n"), 1):
            if "shared/spec" in line or "../shared" in line:
                problems.append(f"{rel}:{n}: {line.strip()}")
            for name in SECTION_REF.findall(line):
                if not resolves(name, held):
                    problems.append(f"{rel}:{n}: {name} is not in the repository")
            if rel in CODE and NUMBERED_REF.search(line):
                problems.append(f"{rel}:{n}: a numbered section of no file: {line.strip()}")
    assert not problems, "\n".join(problems)


def defined_names():
    """(functions and classes, every other name bound at module level or on self)."""
    functions, names = set(), set()
    for rel in CODE:
        text = read(rel)
        functions |= set(re.findall(r"^\s*(?:def|class)\s+(\w+)", text, re.M))
        names |= set(re.findall(r"^(\w+)\s*=", text, re.M))
        names |= set(re.findall(r"self\.(\w+)\s*=", text))
    return functions, functions | names


def test_every_function_architecture_names_exists():
    text = read("docs/architecture.md")
    called = set(re.findall(r"`(\w+(?:\.\w+)*)\(", text))       # `name(` and `Class.name(`
    named = set(re.findall(r"`(_\w+(?:\.\w+)*)", text))          # `_name`, `_Class.name`
    functions, defined = defined_names()
    missing = sorted({n for n in called if any(p not in functions for p in n.split("."))} |
                     {n for n in named if any(p not in defined for p in n.split("."))})
    assert not missing, f"docs/architecture.md names what the code does not define: {missing}"


def banners():
    lines = read("memshelf.py").split("\n")
    return [lines[i + 1][2:].strip() for i, line in enumerate(lines[:-2])
            if line.startswith("# ====") and lines[i + 2].startswith("# ====")]


def test_section_maps_match_the_banners():
    titles = banners()
    assert "Store: the one reader of episode files" in titles, titles
    # docs/architecture.md: one row per banner, by its full title
    arch = read("docs/architecture.md")
    table = arch[arch.index("## memshelf.py, section by section"):
                 arch.index("## Each verb and its functions")]
    rows = [line.split("|")[1].strip() for line in table.split("\n")
            if line.startswith("| ") and not line.startswith("| banner")]
    assert rows == titles
    # the module docstring: every banner's name (before the colon), in the same order
    doc = read("memshelf.py").split('"""')[1]
    the_map = doc[doc.index("Sections of this file"):]
    labels = [line[2:30].strip().lower() for line in the_map.split("\n")[1:]
              if line.startswith("  ") and line[2] != " "]
    expected = []
    for title in titles:
        name = title.split(":")[0].strip().lower()
        if not expected or expected[-1] != name:
            expected.append(name)
    assert labels == expected


def test_every_verb_and_tool_is_in_the_verb_table():
    help_text = subprocess.run([sys.executable, os.path.join(ROOT, "memshelf.py"), "--help"],
                               capture_output=True, text=True, check=True).stdout
    body = help_text[help_text.index("positional arguments"):help_text.index("options:")]
    verbs = re.findall(r"^    (\S+)", body, re.M)
    assert "shelve" in verbs and "repair" in verbs, verbs
    text = read("docs/architecture.md")
    table = text[text.index("## Each verb and its functions"):text.index("## Output files")]
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip(" `")
            for line in table.split("\n") if line.startswith("| `")}
    assert sorted(rows) == sorted(verbs)
    tools = set(re.findall(r'"name": "(memshelf_\w+)"', read("server.py") + "".join(
        subprocess.run([sys.executable, os.path.join(ROOT, "memshelf.py"), "tools"],
                       capture_output=True, text=True, check=True).stdout)))
    assert len(tools) == 14 and {t for t in rows.values() if t} == tools
