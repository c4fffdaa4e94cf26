"""A shelf of real text: Git's feature release notes 2.0.0 ... 2.39.0, one research episode each.

`bench/relnotes_questions.tsv` asks questions a user or agent would type about Git features, each
with the episode and section that holds the answer (`id § Section`). `build(root)` reads the
release notes from disk (Debian's git package installs them under /usr/share/doc/git/RelNotes;
they are not copied into this repository) and shelves one episode per feature release into a new
plain shelf, as an agent would shelve "what changed in Git 2.N":

- slug `<release date>-git-2-N-release`, kind research, title "Git 2.N.0 release notes";
- a short mechanical digest (bullet counts only), so ranking has to use the sections;
- the note split by its own headings: "Backward compatibility" (compatibility notes, warts and
  notes to those who build from source, when present), "Decisions" (UI, Workflows & Features,
  plus "Ports" when present), "Internals" (Performance, Internal Implementation, Development
  Support etc.) and "Fixes" (Fixes since v2.N-1). Bullet text is kept as is; a section longer
  than MAX_SECTION_CHARS is cut at a bullet boundary.

If the release notes are not on this machine, build() raises RuntimeError and the bench skips
the set. `python3 bench/relnotes.py DIR` builds the shelf at DIR.
"""
import os
import re
import sys

RELNOTES_DIR = "/usr/share/doc/git/RelNotes"
MAX_SECTION_CHARS = 12000

# Approximate release dates of the feature releases (the notes carry none); increasing.
RELEASE_DATES = {
    0: "2014-05-28", 1: "2014-08-15", 2: "2014-11-26", 3: "2015-02-05", 4: "2015-04-30",
    5: "2015-07-27", 6: "2015-09-28", 7: "2016-01-04", 8: "2016-03-28", 9: "2016-06-13",
    10: "2016-09-02", 11: "2016-11-29", 12: "2017-02-24", 13: "2017-05-09", 14: "2017-08-03",
    15: "2017-10-30", 16: "2018-01-17", 17: "2018-04-02", 18: "2018-06-21", 19: "2018-09-10",
    20: "2018-12-09", 21: "2019-02-24", 22: "2019-06-07", 23: "2019-08-16", 24: "2019-11-04",
    25: "2020-01-13", 26: "2020-03-22", 27: "2020-06-01", 28: "2020-07-27", 29: "2020-10-19",
    30: "2020-12-27", 31: "2021-03-15", 32: "2021-06-06", 33: "2021-08-16", 34: "2021-11-15",
    35: "2022-01-24", 36: "2022-04-18", 37: "2022-06-27", 38: "2022-10-02", 39: "2022-12-12",
}

SECTION_ORDER = ("Backward compatibility", "Decisions", "Internals", "Fixes")

# Unindented heading lines of the notes -> shelf section (None: a container heading, no text).
_HEADINGS = (
    (re.compile(r"^Backward (compatibility|incompatible)", re.I), "Backward compatibility"),
    (re.compile(r"^Note to those who build from the source", re.I), "Backward compatibility"),
    (re.compile(r"^Updates since ", re.I), None),
    (re.compile(r"^Ports\s*$", re.I), "Decisions"),
    (re.compile(r"^UI, Workflows & Features", re.I), "Decisions"),
    (re.compile(r"^Performance, Internal Implementation", re.I), "Internals"),
    (re.compile(r"^Fixes since ", re.I), "Fixes"),
)
_UNDERLINE = re.compile(r"^\s*(-{3,}|={3,})\s*$")


def episode_id(n):
    return f"{RELEASE_DATES[n]}-git-2-{n}-release"


def _clean(lines):
    """Join lines, drop leading/trailing blank lines and collapse runs of blank lines."""
    text = "\n".join(line.rstrip() for line in lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text)


def _cut(text, limit=MAX_SECTION_CHARS):
    """Text cut to at most limit characters at a bullet boundary (a line starting ' * ')."""
    if len(text) <= limit:
        return text
    starts = [m.start() for m in re.finditer(r"(?m)^ \* ", text)]
    cut = max((s for s in starts if 0 < s <= limit), default=None)
    if cut is None:                       # no bullet boundary: cut at the last blank line
        cut = text.rfind("\n\n", 0, limit)
        cut = cut if cut > 0 else limit
    return text[:cut].rstrip()


def split_note(text):
    """The note's sections as {shelf section: text}, in SECTION_ORDER; empty ones left out."""
    buckets = {name: [] for name in SECTION_ORDER}
    current = None                        # text before the first heading (title, intro) is dropped
    for line in text.splitlines():
        if _UNDERLINE.match(line):
            continue
        if line and not line[0].isspace():
            for pattern, name in _HEADINGS:
                if pattern.match(line):
                    current = name
                    if name and buckets[name]:
                        buckets[name].append("")
                    break
            else:
                if current:
                    buckets[current].append(line)
            continue
        if current:
            buckets[current].append(line)
    sections = {}
    for name in SECTION_ORDER:
        body = _clean(buckets[name])
        if body:
            sections[name] = _cut(body)
    return sections


def _bullets(text):
    return len(re.findall(r"(?m)^ \* ", text or ""))


def episodes(relnotes_dir=None):
    """The 40 episode dicts (shelve keyword arguments) built from the notes on disk."""
    folder = relnotes_dir or RELNOTES_DIR
    if not os.path.isdir(folder):
        raise RuntimeError(f"Git release notes not found at {folder} (they come with Debian's "
                           "git package, /usr/share/doc/git/RelNotes); the relnotes bench set "
                           "needs them")
    result = []
    for n in sorted(RELEASE_DATES):
        path = os.path.join(folder, f"2.{n}.0.txt")
        if not os.path.isfile(path):
            raise RuntimeError(f"Git release note {path} not found; the relnotes bench set "
                               "needs 2.0.0.txt ... 2.39.0.txt")
        with open(path, encoding="utf-8", errors="replace") as f:
            sections = split_note(f.read())
        if "Decisions" not in sections:
            raise RuntimeError(f"{path}: no 'UI, Workflows & Features' part found")
        digest = (f"Git 2.{n}.0 release notes summarised: {_bullets(sections['Decisions'])} "
                  f"changes in UI and workflows, {_bullets(sections.get('Internals'))} internal "
                  f"changes, {_bullets(sections.get('Fixes'))} fixes carried over. Open: none.")
        result.append(dict(slug=episode_id(n), kind="research", date=RELEASE_DATES[n],
                           display_title=f"Git 2.{n}.0 release notes",
                           tags=["git", "release-notes"], digest=digest, sections=sections))
    return result


def build(root, code=None, relnotes_dir=None):
    """A new plain shelf at root holding one episode per Git feature release; returns root."""
    eps = episodes(relnotes_dir)          # fails before the shelf is created if notes are missing
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import design_docs
    return design_docs.build(root, code, eps)


if __name__ == "__main__":
    build(sys.argv[1], os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
