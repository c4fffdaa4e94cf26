"""The YAML subset: locating the block, the grammar, the reject table, portability checks,
the manifest subset and the writers (docs/frontmatter.md, docs/format.md § The YAML subset)."""

import pickle

import pytest

import memshelf
from memshelf import FrontmatterError, parse_frontmatter, parse_manifest


def fm(block, before="", after="body\n"):
    """An episode text whose frontmatter block holds `block` (lines joined with LF)."""
    return before + "---\n" + block + ("\n" if block else "") + "---\n" + after


def fields_of(block):
    return parse_frontmatter(fm(block))[0]


def rejected(text, parse=parse_frontmatter):
    with pytest.raises(FrontmatterError) as info:
        parse(text)
    err = info.value
    assert isinstance(err, ValueError)
    assert str(err)
    return err


# ------------------------------------------------------------------------------------------
# Locating the block
# ------------------------------------------------------------------------------------------

def test_frontmatter_at_byte_zero():
    fields, body = parse_frontmatter("---\nid: a\n---\nbody text\n")
    assert fields == {"id": "a"}
    assert body == "body text\n"


def test_h1_first_placement():
    text = "# 2026-07-22-auth\n\n---\nid: 2026-07-22-auth\nkind: topic\n---\n\n## Digest\nx\n"
    detail = memshelf._parse_frontmatter_detail(text)
    assert detail["fields"] == {"id": "2026-07-22-auth", "kind": "topic"}
    assert detail["body"] == "\n## Digest\nx\n"
    assert detail["has_block"] is True
    assert detail["h1"] == "2026-07-22-auth"
    assert detail["block_line"] == 3
    assert detail["body_line"] == 7
    assert detail["portability"] == []


def test_blank_lines_before_h1_and_fence_are_skipped():
    text = "\n  \n# T\n\t\n\n---\nk: v\n---\n"
    detail = memshelf._parse_frontmatter_detail(text)
    assert detail["fields"] == {"k": "v"}
    assert detail["block_line"] == 6
    assert detail["body"] == ""
    assert detail["body_line"] == 9


def test_fence_may_carry_trailing_spaces_and_tabs():
    assert parse_frontmatter("--- \t\nk: v\n---  \nB")[0] == {"k": "v"}
    assert parse_frontmatter("--- \t\nk: v\n---  \nB")[1] == "B"


@pytest.mark.parametrize("text", [
    "----\nk: v\n----\n",                     # four dashes is not a fence
    "<!-- c -->\n---\nk: v\n---\n",           # an HTML comment first
    "# One\n# Two\n---\nk: v\n---\n",         # a second H1
    "# One\n\n# Two\n\n---\nk: v\n---\n",
    "Some prose.\n---\nk: v\n---\n",          # prose before the fence
    " ---\nk: v\n---\n",                      # an indented fence
    "--- x\nk: v\n---\n",                     # text after the fence
    "#Title\n---\nk: v\n---\n",               # not an H1 without the space
    "",
    "\n\n",
    "just text",
])
def test_no_frontmatter_returns_whole_text(text):
    fields, body = parse_frontmatter(text)
    assert fields == {}
    assert body == text
    detail = memshelf._parse_frontmatter_detail(text)
    assert detail["has_block"] is False
    assert detail["block_line"] is None
    assert detail["body_line"] == 1


def test_no_frontmatter_still_reports_the_h1():
    detail = memshelf._parse_frontmatter_detail("# Title\n\nProse.\n")
    assert detail["h1"] == "Title"
    assert detail["has_block"] is False
    assert detail["body"] == "# Title\n\nProse.\n"


def test_only_the_first_block_counts():
    text = "---\na: 1\n---\nbody\n---\nb: 2\n---\n"
    fields, body = parse_frontmatter(text)
    assert fields == {"a": "1"}
    assert body == "body\n---\nb: 2\n---\n"


def test_empty_block_and_empty_body():
    assert parse_frontmatter("---\n---\n") == ({}, "")
    assert parse_frontmatter("---\n---") == ({}, "")
    assert parse_frontmatter("---\n\n# just a comment\n---\nB") == ({}, "B")


@pytest.mark.parametrize("text", ["---\nk: v\n", "---\n", "---", "# T\n\n---\nk: v\nbody\n"])
def test_unterminated_block(text):
    err = rejected(text)
    assert err.error_class == "unterminated"
    assert err.line == text.split("\n").index(next(
        line for line in text.split("\n") if line.startswith("---"))) + 1


def test_bom_and_crlf_are_normalised():
    text = "\ufeff# T\r\n\r\n---\r\nid: a\r\ntags: [x, y]\r\n---\r\nline1\r\nline2\rline3"
    detail = memshelf._parse_frontmatter_detail(text)
    assert detail["fields"] == {"id": "a", "tags": ["x", "y"]}
    assert detail["body"] == "line1\nline2\nline3"
    assert detail["block_line"] == 3
    assert detail["body_line"] == 7
    # Without a block the normalised text comes back.
    assert parse_frontmatter("\ufeffa\r\nb\rc") == ({}, "a\nb\nc")


def test_bytes_are_decoded():
    fields, body = parse_frontmatter("\ufeff---\ntitle: \"Öl\"\n---\nBödy\n".encode("utf-8"))
    assert fields == {"title": "Öl"}
    assert body == "Bödy\n"


def test_invalid_utf8_is_an_encoding_error_with_line():
    err = rejected(b"---\r\nid: a\r\ntitle: caf\xe9\r\n---\r\n")
    assert err.error_class == "encoding"
    assert err.line == 3
    assert "UTF-8" in str(err)


def test_line_numbers_refer_to_the_original_text():
    text = "\ufeff\r\n# T\r\n\r\n---\r\nid: a\r\nid: b\r\n---\r\n"
    err = rejected(text)
    assert err.error_class == "duplicate_key"
    assert err.line == 6
    assert "line 6" in str(err)


# ------------------------------------------------------------------------------------------
# Grammar: what is accepted
# ------------------------------------------------------------------------------------------

def test_plain_values_and_tabs_after_the_colon():
    assert fields_of("a:\tvalue\nb: \t two words \t\nc:  x") == {
        "a": "value", "b": "two words", "c": "x"}


def test_comments():
    block = "# leading comment\n  # indented comment\n\t# tab comment\n" \
            "a: value # comment\nb: value\t# tab comment\nc: # only a comment\n" \
            "d: a#b\ne: \"x # y\"\nf: 'p # q' # real comment\ng: [a, b] # after list"
    assert fields_of(block) == {"a": "value", "b": "value", "c": None, "d": "a#b",
                                "e": "x # y", "f": "p # q", "g": ["a", "b"]}


def test_colon_without_space_does_not_split():
    assert fields_of("url: https://x:8443/a\ntime: 10:30\nratio: a:b:c") == {
        "url": "https://x:8443/a", "time": "10:30", "ratio": "a:b:c"}


def test_backslashes_are_literal_in_plain_and_single_quoted():
    assert fields_of("p: C:\\Users\\x\\n\ns: 'C:\\Users\\n'") == {
        "p": "C:\\Users\\x\\n", "s": "C:\\Users\\n"}


def test_quoted_scalars():
    block = "a: \"\"\nb: ''\nc: 'it''s'\nd: \"say \\\"hi\\\"\"\ne: \"  padded  \"\n" \
            "f: \"tab\there\"\ng: 'a \"b\" c'\nh: \"it's\""
    assert fields_of(block) == {"a": "", "b": "", "c": "it's", "d": 'say "hi"',
                                "e": "  padded  ", "f": "tab\there", "g": 'a "b" c',
                                "h": "it's"}


def test_null_entry():
    assert fields_of("a:\nb:   \nc:\t# comment") == {"a": None, "b": None, "c": None}


def test_block_list():
    block = "tags:\n  - alpha\n  - \"beta gamma\"\n  - 'delta'\n\n  # comment between\n" \
            "  - eps # trailing comment\nnext: x\nzero:\n- a\n- b\nlast:\n-\tx"
    assert fields_of(block) == {"tags": ["alpha", "beta gamma", "delta", "eps"],
                                "next": "x", "zero": ["a", "b"], "last": ["x"]}


def test_flow_lists():
    block = "a: [x, \"b c\", 'd']\nb: []\nc: [ ]\nd: [x, y,]\ne: [ x ,y , ]\n" \
            "f: [\"a, b\", 'c]d']\ng: [tab\t, x]\nh: [\"\"]\ni: [C:\\x, 10:30]"
    assert fields_of(block) == {
        "a": ["x", "b c", "d"], "b": [], "c": [], "d": ["x", "y"], "e": ["x", "y"],
        "f": ["a, b", "c]d"], "g": ["tab", "x"], "h": [""], "i": ["C:\\x", "10:30"]}


def test_keys_are_case_sensitive_and_keep_order():
    fields = fields_of("id: a\nID: b\nId: c\nk.e-y_1/x: d")
    assert fields == {"id": "a", "ID": "b", "Id": "c", "k.e-y_1/x": "d"}
    assert list(fields) == ["id", "ID", "Id", "k.e-y_1/x"]


@pytest.mark.parametrize("value", ["38000", "true", "1.10", "01234", "10:30", "NO",
                                   "2026-06-02", "nulls", "~x", "yes", "0x1F", "-1", ".inf"])
def test_no_implicit_typing(value):
    assert fields_of("k: " + value) == {"k": value}
    assert fields_of("k: [" + value + "]") == {"k": [value]}


@pytest.mark.parametrize("value", ["null", "Null", "NULL", "~"])
def test_yaml_null_is_none(value):
    # the fast canonical-line path and the grammar agree
    assert fields_of("layout: " + value) == {"layout": None}
    assert fields_of("a: 1\nlayout: " + value + "  # comment\nb: [x]") == \
        {"a": "1", "layout": None, "b": ["x"]}
    # quoted it is text; a list item stays a string (lists hold strings)
    assert fields_of('k: "%s"\nl: [%s]\nm:\n  - %s' % (value, value, value)) == \
        {"k": value, "l": [value], "m": [value]}
    assert fields_of("k: nULL") == {"k": "nULL"}


def test_plain_value_with_colon_space_keeps_the_rest_of_the_line():
    detail = memshelf._parse_frontmatter_detail(fm("title: Auth: the refactor"))
    assert detail["fields"] == {"title": "Auth: the refactor"}


def test_unicode_values_and_keys():
    fields = fields_of("título: Охота на X1 Carbon — Грузия 🚀\nk: \u2028inside")
    assert fields == {"título": "Охота на X1 Carbon — Грузия 🚀", "k": "\u2028inside"}


def test_dashes_and_dots_that_are_not_markers():
    assert fields_of("a: -1\nb: --x\nc: ...\nd: ---x\n.e: v") == {
        "a": "-1", "b": "--x", "c": "...", "d": "---x", ".e": "v"}


# ------------------------------------------------------------------------------------------
# Escapes in double-quoted scalars
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("escape,expected", [
    ("\\\\", "\\"), ('\\"', '"'), ("\\/", "/"), ("\\b", "\b"), ("\\f", "\f"),
    ("\\n", "\n"), ("\\r", "\r"), ("\\t", "\t"), ("\\0", "\x00"), ("\\a", "\x07"),
    ("\\e", "\x1b"), ("\\v", "\x0b"), ("\\N", "\x85"), ("\\_", "\xa0"), ("\\L", "\u2028"),
    ("\\P", "\u2029"), ("\\ ", " "), ("\\x41", "A"), ("\\xe9", "é"), ("\\u00E9", "é"),
    ("\\u2014", "—"), ("\\U0001F680", "🚀"), ("\\ud83d\\ude80", "🚀"), ("\\u001b", "\x1b"),
])
def test_escapes(escape, expected):
    assert fields_of('k: "a' + escape + 'z"') == {"k": "a" + expected + "z"}


@pytest.mark.parametrize("escape", ["\\q", "\\x4", "\\xZZ", "\\u12", "\\u12G4", "\\U0011FFFF",
                                    "\\U1234", "\\\t", "\\'", "\\x+1", "\\u 123"])
def test_unknown_or_bad_escapes(escape):
    err = rejected(fm('k: "a' + escape + 'z"'))
    assert err.error_class == "syntax"
    assert err.line == 2


# ------------------------------------------------------------------------------------------
# The reject table (docs/format.md § The YAML subset)
# ------------------------------------------------------------------------------------------

UNSUPPORTED = [
    "a: &anchor value",
    "a: *alias",
    "&anchor a: value",
    "*alias: value",
    "a: !tag value",
    "a: !!str value",
    "a: !!python/object/apply:os.system ['touch /tmp/pwned']",
    "!!str a: value",
    "%YAML 1.2",
    "%TAG ! tag:x,2000:",
    "a: b\n...",
    "a: b\n... ",
    "a: b\n--- more",
    "|\n  x",
    "a:\n  - |\n    x",
    "a: {b: c}",
    "a: {}",
    "{a: b}",
    "a:\n  - - x",
    "a:\n  - [x]",
    "a: [[x]]",
    "a: [x, [y]]",
    "a: [{b: c}]",
    "a: [&x y]",
    "a: [*x]",
    "a: [!t y]",
    "a:\n  - x\n    - y",
    "a:\n  b: c",
    "a:\n  b:",
    "a:\n  - x: y",
    "a:\n  - 'x'\n  b: c",
    "? complex\n: value",
    "? complex",
    '"quoted key": value',
    "'quoted key': value",
    "a:\n  - &x y",
    "a:\n  - !t y",
    "a:\n  - {b: c}",
]


@pytest.mark.parametrize("block", UNSUPPORTED)
def test_unsupported_yaml(block):
    err = rejected(fm("first: 1\n" + block))
    assert err.error_class == "unsupported_yaml", str(err)
    assert err.line is not None and err.line >= 3


SYNTAX = [
    ('a: "open', 2),
    ("a: 'open", 2),
    ('a: "x" y', 2),
    ("a: 'x' y", 2),
    ('a: "x"#c', 2),
    ('a: "x",', 2),
    ("a: [x, y] z", 2),
    ("a: 1\njust a line", 3),
    ("key:value", 2),
    ("url:https://x", 2),
    ("my key: value", 2),
    ("key : value", 2),
    (": value", 2),
    ('a: "bad \\q escape"', 2),
    ('a: "spans\n  lines"', 2),
    ("a: 'spans\n  lines'", 2),
    ("a: [x,\n  y]", 2),
    ("a: [x", 2),
    ("a: [x, y", 2),
    ("a: [x,,y]", 2),
    ("a: [,]", 2),
    ("a: [x #c]", 2),
    ("a:\n\t- x", 3),
    ("\tb: x", 2),
    ("a: x\n\tb: y", 3),
    ("a: v\n- x", 3),
    ("a: v\n  - x", 3),
    ("a:\n  - x\n- y", 4),
    ("a: %x", 2),
    ("a: @x", 2),
    ("a: `x`", 2),
    ("a: ,x", 2),
    ("a: ]x", 2),
    ("a: }x", 2),
    ("a: [%x]", 2),
    ("a: [@x]", 2),
    ("a: - x", 2),
    ("a: -", 2),
    ("a:\n  -", 3),
    ("a:\n  - # nothing", 3),
    ("a: x\n  continued", 3),
    ("a:\n  text", 3),
    ("-x: y", 2),
    ("]a: y", 2),
    ("@a: y", 2),
    ("`a: y", 2),
    (",a: y", 2),
    ("a: x\n  b: y", 3),
    ("?x: y", 2),
    ("a: b\n'bare'", 3),
    ("a: b\nbare", 3),
    ("a: b\n[x]", 3),
]


@pytest.mark.parametrize("block,line", SYNTAX)
def test_syntax_errors(block, line):
    err = rejected(fm(block))
    assert err.error_class == "syntax", str(err)
    assert err.line == line
    assert ("line %d" % line) in str(err)


@pytest.mark.parametrize("block,line", [
    ("a: 1\na: 2", 3),
    ("a: 1\nb: 2\na:\n  - x", 4),
    ("tags:\n  - x\ntags: [y]", 4),
    ("id: a\nid: a", 3),
])
def test_duplicate_key(block, line):
    err = rejected(fm(block))
    assert err.error_class == "duplicate_key"
    assert err.line == line
    assert "first on line 2" in str(err)


@pytest.mark.parametrize("char", ["\x00", "\x01", "\x08", "\x0b", "\x0c", "\x1b", "\x1f",
                                  "\x7f", "\x80", "\x85", "\x9f"])
def test_control_characters(char):
    err = rejected(fm("a: 1\nb: x" + char + "y"))
    assert err.error_class == "control_character"
    assert err.line == 3
    assert "U+%04X" % ord(char) in str(err)


def test_control_character_in_a_comment_or_quotes_is_rejected_too():
    assert rejected(fm("# c\x00mment")).error_class == "control_character"
    assert rejected(fm('a: "x\x07"')).error_class == "control_character"


def test_control_characters_outside_the_block_are_not_the_parsers_business():
    assert parse_frontmatter("---\na: b\n---\nbody \x00 \x1b\n") == ({"a": "b"}, "body \x00 \x1b\n")


@pytest.mark.parametrize("block", ["- a\n- b", "  - a", "bare scalar", '"quoted"', "'quoted'",
                                   "[a, b]", "# comment\n\n- a", "42"])
def test_not_a_mapping(block):
    err = rejected(fm(block))
    assert err.error_class == "not_a_mapping", str(err)


def test_too_large_by_bytes():
    value = "é" * (600 * 1024)  # 1.2 MiB in UTF-8, 600 K characters
    err = rejected("# T\n\n---\nk: " + value + "\n---\n")
    assert err.error_class == "too_large"
    assert err.line == 3


def test_too_large_by_lines():
    block = "\n".join("# c" for _ in range(100001))
    assert rejected(fm(block)).error_class == "too_large"
    # Exactly 100,000 lines is still fine.
    block = "\n".join("# c" for _ in range(99999)) + "\nk: v"
    assert fields_of(block) == {"k": "v"}


def test_large_body_is_not_capped():
    body = "x" * (2 * 1024 * 1024)
    assert parse_frontmatter("---\nk: v\n---\n" + body) == ({"k": "v"}, body)


def test_error_message_says_what_where_and_how():
    err = rejected(fm("a: 1\nkey:value"))
    message = str(err)
    assert "line 3" in message and "space after the colon" in message
    assert "Fix:" in message
    assert err.detail and err.fix


def test_error_survives_pickling():
    err = rejected(fm("a: 1\na: 2"))
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.error_class, copy.line, str(copy)) == (err.error_class, err.line, str(err))


# ------------------------------------------------------------------------------------------
# Portability problems (docs/format.md § The YAML subset)
# ------------------------------------------------------------------------------------------

def portability(block):
    return memshelf._parse_frontmatter_detail(fm(block))["portability"]


def test_plain_value_containing_colon_space_is_not_portable():
    problems = portability("id: a\ntitle: Auth: the refactor\nok: \"Auth: quoted\"")
    assert len(problems) == 1
    assert problems[0]["line"] == 3
    assert problems[0]["key"] == "title"
    assert '"Auth: the refactor"' in problems[0]["problem"]


@pytest.mark.parametrize("value", ["a:", "a: ", "? x", "[a: b]", "[a:]", "[a{b]", "[x?y]"])
def test_other_mapping_shaped_plain_values_are_not_portable(value):
    assert len(portability("k: " + value)) == 1


@pytest.mark.parametrize("block,line", [
    ("a:\tb", 2), ("a: \tb", 2), ("a: b\t", 2), ("a: b\t# c", 2), ("a: x\ty", 2),
    ("a:\t", 2), ("a:\t# c", 2), ("a: [x,\ty]", 2), ("a: [x]\t", 2), ('a: "x"\t', 2),
    ("a: 1\n\t\nb: 2", 3), ("a: 1\n\t# c", 3), ("a: 1\n  \t  ", 3), ("a:\n  -\tx", 3),
    ("a: 'x'\t# c", 2),
])
def test_tabs_outside_quotes_are_not_portable(block, line):
    problems = portability(block)
    assert [p["line"] for p in problems] == [line]
    assert "tab" in problems[0]["problem"]


@pytest.mark.parametrize("block", ['a: "x\ty"', "a: ['x\ty', \"\t\"]", "a: x # c\td",
                                   "# c\td", "a: 'p\tq' # \t"])
def test_tabs_inside_quotes_and_comments_are_portable(block):
    assert portability(block) == []


def test_mapping_shaped_value_with_a_tab_has_both_problems():
    problems = portability("k: a:\tb")
    assert len(problems) == 2


@pytest.mark.parametrize("value", ["007", "1e3", "yes", "Yes", "NO", "on", "off", "y", "n",
                                   "2026-01-01", "0x1F", "0o17", "1_000",
                                   "+3", "-0", "1.50", ".5", "1.", "10:30", "1:30:00.5",
                                   ".inf", "-.Inf", ".nan", "true", "FALSE", "<<", "=",
                                   "2026-01-01 10:30:00", "2026-01-01T10:30:00Z"])
def test_id_typed_by_yaml_is_not_portable(value):
    problems = portability("id: " + value + "\nkind: topic")
    assert [(p["line"], p["key"]) for p in problems] == [(2, "id")]
    assert "quote it" in problems[0]["problem"]


@pytest.mark.parametrize("value", ["2026-07-22-auth-refactor", "abc", "a1", "yes-no", "nulls",
                                   "0x", "1e", "2026-01-01x", "v1.0", "1-2", "0b", "09_1",
                                   "\"007\"", "'yes'", "охота",
                                   # typed, but str() of the loaded value gives the same text
                                   "42", "-7", "0", "1.5", "1.0", "True", "False"])
def test_string_ids_are_portable(value):
    assert portability("id: " + value) == []


def test_only_id_is_checked_for_typing():
    assert portability("approx_tokens: 38000\ndate: 2026-06-02\nflag: yes") == []


def test_portable_episode_has_no_problems():
    block = ("id: 2026-07-22-auth\nkind: topic\nspan: 2026-07-22\ndate: 2026-07-22\n"
             "display_title: \"Auth: JWT\"\ntags: [auth, jwt]\napprox_tokens: 1200\n"
             "approx_tokens_source: estimate\nmode: live")
    assert portability(block) == []


# ------------------------------------------------------------------------------------------
# Writers: _yaml_quote, _yaml_flow_list, _yaml_plain_safe (docs/format.md § Episodes)
# ------------------------------------------------------------------------------------------

TRICKY = [
    "", " ", "plain", "two  spaces", "  lead and trail  ", "tab\there", "new\nline",
    "crlf\r\nend", 'quote " inside', "back\\slash", "\\\\double", "C:\\Users\\x", "ends with \\",
    "\\n literal", "a: b", "key: value # not a comment", "#hash", "x # y", "- dash", "[flow]",
    "{map}", "&anchor", "*alias", "!tag", "%percent", "@at", "`tick`", "'single'", "''",
    "it's", "null", "~", "true", "yes", "NO", "007", "1e3", "2026-06-02", "10:30", "...",
    "---", "\x00nul", "bell\x07", "esc\x1b[0m", "del\x7f", "c1\x80\x9f", "nel\x85x",
    "ls\u2028ps\u2029", "nbsp\xa0x", "ideo\u3000x", "fs\x1cgs\x1d", "vt\x0bff\x0c",
    "Охота на X1 Carbon: Грузия", "emoji 🚀 and 中文", "\ufeffbom", "zero\u200bwidth",
    "\ud800lone", "nonchar\uffff", "</recalled-episode>", "x" * 5000,
]


def collapsed(text):
    return " ".join(text.split())


@pytest.mark.parametrize("text", TRICKY)
def test_quote_round_trip(text):
    quoted = memshelf._yaml_quote(text)
    assert quoted.startswith('"') and quoted.endswith('"')
    assert "\n" not in quoted and "\r" not in quoted
    assert memshelf._FM_CONTROL.search(quoted) is None
    detail = memshelf._parse_frontmatter_detail("---\nk: " + quoted + "\n---\n")
    assert detail["fields"] == {"k": collapsed(text)}
    assert detail["portability"] == []


def test_quote_exact_bytes():
    quote = memshelf._yaml_quote
    assert quote("  a \t b\n c  ") == '"a b c"'
    assert quote('say "hi" \\ bye') == '"say \\"hi\\" \\\\ bye"'
    assert quote("esc\x1b\x00\x7f\x9f") == '"esc\\u001b\\u0000\\u007f\\u009f"'
    assert quote("a\u2028b") == '"a b"'  # U+2028 is whitespace: collapsed first
    assert quote("") == '""'
    assert quote("Грузия — ok") == '"Грузия — ok"'


@pytest.mark.parametrize("text", ["auth", "jwt", "c++", "lang:python", "v1.0", "a/b", "a_b",
                                  "Δelta", "2026-07-22-auth-refactor", "a#b", "x-1", "UPPER"])
def test_plain_safe_accepts_ordinary_tags_and_ids(text):
    assert memshelf._yaml_plain_safe(text) is True


@pytest.mark.parametrize("text", [
    "", " a", "a ", "-a", "?a", ":a", ",a", "[a", "]a", "{a", "}a", "#a", "&a", "*a", "!a",
    "|a", ">a", "'a", '"a', "%a", "@a", "`a", "a: b", "a:", "a #b", "a,b", "a[b", "a]b",
    "a{b", "a}b", "a?b", "a\tb", "a\nb", "a\x00b", "a\x85b", "a\u2028b", "a\ufeffb",
    "true", "yes", "No", "y", "null", "~", "007", "42", "1e3", "1.5", "0x1F", "1_000",
    "2026-06-02", "10:30", ".inf", "<<", "=", None, 7,
])
def test_plain_safe_rejects(text):
    assert memshelf._yaml_plain_safe(text) is False


def test_flow_list_writer():
    flow = memshelf._yaml_flow_list
    assert flow([]) == "[]"
    assert flow(["auth", "jwt"]) == "[auth, jwt]"
    assert flow(["a b", "yes", "x,y", "ok"]) == '[a b, "yes", "x,y", ok]'
    items = ["auth", "2026", "a: b", "x # y", "[z]", "'q'", "lang:py", "true", "é"]
    assert fields_of("tags: " + flow(items)) == {"tags": items}
    assert portability("tags: " + flow(items)) == []


# ------------------------------------------------------------------------------------------
# Manifest subset
# ------------------------------------------------------------------------------------------

SHELF_YML = """\
# shelf.yml — shelf-spec v0 manifest (written by memshelf)
spec_version: "0.1"
mode: single
name: "Memory shelf"
profile: memory
docs_root: docs
categories:
  - topics
  - research
  - sessions
index:
  path: INDEX.md
  generated_by: external
ledger:
  path: ledger.tsv
policy:
  path: POLICY.md
  patterns: POLICY.patterns
"""


def test_shelf_yml_template():
    assert parse_manifest(SHELF_YML) == {
        "spec_version": "0.1",
        "mode": "single",
        "name": "Memory shelf",
        "profile": "memory",
        "docs_root": "docs",
        "categories": ["topics", "research", "sessions"],
        "index": {"path": "INDEX.md", "generated_by": "external"},
        "ledger": {"path": "ledger.tsv"},
        "policy": {"path": "POLICY.md", "patterns": "POLICY.patterns"},
    }


def test_manifest_with_written_name_round_trips():
    name = 'My "odd" shelf: \\ — x'
    text = SHELF_YML.replace('"Memory shelf"', memshelf._yaml_quote(name))
    assert parse_manifest(text)["name"] == name


def test_manifest_bytes_bom_crlf():
    data = ("\ufeff" + SHELF_YML).replace("\n", "\r\n").encode("utf-8")
    assert parse_manifest(data)["index"] == {"path": "INDEX.md", "generated_by": "external"}


def test_manifest_nested_values():
    text = "a:\n  x: [p, \"q r\"]\n  y:\n  z: 'v' # c\n\n  # comment\n  w: 1\nb: 2\n"
    assert parse_manifest(text) == {"a": {"x": ["p", "q r"], "y": None, "z": "v", "w": "1"},
                                    "b": "2"}


def test_manifest_empty():
    assert parse_manifest("") == {}
    assert parse_manifest("# only a comment\n") == {}


@pytest.mark.parametrize("text,error_class,line", [
    ("a:\n  b:\n    c: d\n", "unsupported_yaml", 3),
    ("a:\n    b: c\n", "unsupported_yaml", 2),
    ("a:\n  b:\n    - c\n", "unsupported_yaml", 3),
    ("a:\n  b:\n  - c\n", "unsupported_yaml", 3),
    ("a:\n  b: {c: d}\n", "unsupported_yaml", 2),
    ("a:\n  b: |\n", "unsupported_yaml", 2),
    ("---\na: b\n", "unsupported_yaml", 1),
    ("a: b\n...\n", "unsupported_yaml", 2),
    ("a:\n b: c\n", "syntax", 2),
    ("a:\n  - x\n  b: c\n", "syntax", 3),
    ("a:\n  b: c\n  - x\n", "unsupported_yaml", 3),
    ("a:\n  b: c\n  b: d\n", "duplicate_key", 3),
    ("a: 1\na:\n  b: c\n", "duplicate_key", 2),
    ("a:\n\tb: c\n", "syntax", 2),
    ("- a\n", "not_a_mapping", 1),
    ("a: \x01\n", "control_character", 1),
    (b"a: \xff\n", "encoding", 1),
])
def test_manifest_rejects(text, error_class, line):
    err = rejected(text, parse_manifest)
    assert (err.error_class, err.line) == (error_class, line), str(err)


def test_nested_keys_may_repeat_across_parents():
    assert parse_manifest("a:\n  path: x\nb:\n  path: y\n") == {
        "a": {"path": "x"}, "b": {"path": "y"}}


# ------------------------------------------------------------------------------------------
# Scale: linear time, no recursion (no timing asserted)
# ------------------------------------------------------------------------------------------

def test_long_values():
    n = 200000
    assert fields_of("k: " + "a" * n)["k"] == "a" * n
    assert fields_of('k: "' + "a\\\"" * (n // 3) + '"')["k"] == 'a"' * (n // 3)
    assert fields_of("k: '" + "b''" * (n // 3) + "'")["k"] == "b'" * (n // 3)
    assert fields_of("k: [" + ", ".join(["t"] * (n // 3)) + "]")["k"] == ["t"] * (n // 3)
    assert fields_of("k: " + "1:" * (n // 2) + "x") == {"k": "1:" * (n // 2) + "x"}
    assert fields_of("k: " + " " * n + "x" + " " * n) == {"k": "x"}
    assert fields_of("id: " + "1" * n + "x")["id"] == "1" * n + "x"
    assert len(portability("id: " + "1_" * (n // 2) + "1")) == 1
    assert len(portability("k: " + "a: " * (n // 3))) == 1


def test_pathological_inputs_fail_fast():
    n = 200000
    assert rejected(fm('k: "' + "\\" * n)).error_class == "syntax"
    assert rejected(fm("k: [" + "a," * (n // 2))).error_class == "syntax"
    assert rejected(fm("k: " + "[" * n)).error_class == "unsupported_yaml"
    assert rejected(fm("k: " + "{" * n)).error_class == "unsupported_yaml"
    assert rejected(fm("k:\n" + "  - " * (n // 4) + "x")).error_class == "unsupported_yaml"
    assert rejected("---\n" + "k: v\n" * 50000).error_class == "unterminated"
    assert rejected("---\n" + "\n" * 300000).error_class == "unterminated"


def test_many_keys():
    block = "\n".join("key%d: value %d" % (i, i) for i in range(20000))
    fields = fields_of(block)
    assert len(fields) == 20000
    assert fields["key19999"] == "value 19999"
    listed = "big:\n" + "\n".join("  - item%d" % i for i in range(20000))
    assert len(fields_of(listed)["big"]) == 20000


# ------------------------------------------------------------------------------------------
# Optional cross-check against a real YAML loader
# ------------------------------------------------------------------------------------------

def test_writers_agree_with_pyyaml():
    yaml = pytest.importorskip("yaml")
    printable = [t for t in TRICKY if "\ud800" not in t]
    for text in printable:
        quoted = memshelf._yaml_quote(text)
        assert yaml.safe_load("k: " + quoted + "\n") == {"k": collapsed(text)}, text
    items = ["auth", "2026", "a: b", "x # y", "[z]", "'q'", "lang:py", "true", "é", "1e3",
             "007", "a?b", "a{b", "-x", "?x", ":x", "C:\\x", "yes", "~", "10:30", "1_000"]
    loaded = yaml.safe_load("tags: " + memshelf._yaml_flow_list(items) + "\n")
    assert loaded == {"tags": items}
    for item in items:
        if memshelf._yaml_plain_safe(item):
            assert yaml.safe_load("k: " + item + "\n") == {"k": item}, item


def test_portability_findings_match_pyyaml():
    yaml = pytest.importorskip("yaml")
    for block in ["id: 007", "id: yes", "id: 2026-01-01", "id: 0x1F", "id: 1_000",
                  "title: a: b", "k: [a: b]", "k: x:"]:
        assert portability(block), block
        try:
            loaded = yaml.safe_load(block)
        except yaml.YAMLError:
            continue
        value = next(iter(loaded.values()))
        assert not (isinstance(value, str) and value == fields_of(block)[block.split(":")[0]])
    for block in ["id: 2026-07-22-auth", "title: \"a: b\"", "k: [a, 'b: c']", "k: a#b",
                  "k: https://x:8443/a"]:
        assert portability(block) == [], block
        loaded = yaml.safe_load(block)
        assert loaded == fields_of(block), block


@pytest.mark.parametrize("value", ["bell \x07 inside", "next line \x85 inside", "nul \x00"])
def test_control_characters_are_refused_by_the_block_check(value):
    block = f'title: "{value}"\n'
    rejected(fm(block[:-1]))


# ------------------------------------------------------------------------------------------
# Block scalars (| and >, chomping - and +) and null, as a YAML loader reads them
# ------------------------------------------------------------------------------------------

BLOCK_SCALARS = [
    ("d: |\n  line one\n  line two\n\n  after blank\nk: v", "line one\nline two\n\nafter blank\n"),
    ("d: |-\n  x\n  y\n\n\nk: v", "x\ny"),
    ("d: |+\n  x\n  y\n\n\nk: v", "x\ny\n\n\n"),
    ("d: >\n  folded\n  line\n\n  next\n    more\n  last\nk: v",
     "folded line\nnext\n  more\nlast\n"),
    ("d: >-\n  The ops team\n  moved the queue.\nk: v", "The ops team moved the queue."),
    ("d: >+\n  a\n  b\n\nk: v", "a b\n\n"),
    ("d: | # a comment\n  # data, not a comment\n    indented\n  back\nk: v",
     "# data, not a comment\n  indented\nback\n"),
    ("d: |2\n    two more\n  base\nk: v", "  two more\nbase\n"),
    ("d: >-1\n  one more\n x\nk: v", " one more\nx"),
    ("d: |\nk: v", ""),
    ("d: |\n  tab\there: kept\nk: v", "tab\there: kept\n"),
]


@pytest.mark.parametrize("block,value", BLOCK_SCALARS)
def test_block_scalars(block, value):
    assert fields_of(block) == {"d": value, "k": "v"}
    assert memshelf._parse_frontmatter_detail(fm(block))["portability"] == []


def test_block_scalars_agree_with_pyyaml():
    yaml = pytest.importorskip("yaml")
    import random
    rng = random.Random(22)
    pieces = ["  a", "  b c", "", "    d", "   e", "  \tf", "  g #h", " ", "  k: v"]
    blocks = [b for b, _ in BLOCK_SCALARS]
    for _ in range(1500):
        lines = [rng.choice(pieces) for _ in range(rng.randint(0, 6))]
        blocks.append("d: " + rng.choice(["|", ">", "|-", ">-", "|+", ">+", "|2", ">-2"]) +
                      "".join("\n" + line for line in lines) + "\nk: v")
    for block in blocks:
        try:
            want = yaml.safe_load(block)
        except yaml.YAMLError:
            continue
        assert fields_of(block) == want, block


@pytest.mark.parametrize("block,error_class", [
    ("d: |x\n  y", "syntax"), ("d: |-+\n  y", "syntax"), ("d: >0\n  y", "syntax"),
    ("d: |1 2\n  y", "syntax"), ("d: |\n  x\n\ty", "syntax"),
    ("d: &a |\n  y", "unsupported_yaml"), ("d: !t |\n  y", "unsupported_yaml"),
    ("d: |\n  x\n...", "unsupported_yaml"),
])
def test_block_scalar_errors(block, error_class):
    err = rejected(fm("a: 1\n" + block))
    assert err.error_class == error_class, str(err)
    assert err.fix


def test_block_scalar_episode_through_the_cli(plain_shelf, cli):
    """index, recall, search and doctor read an episode whose description is a block and
    whose optional fields are null."""
    text = ("# 2026-05-01-queue-move\n\n---\nid: 2026-05-01-queue-move\nkind: topic\n"
            "span: 2026-05-01\ndate: 2026-05-01\ndisplay_title: null\nlayout: ~\n"
            "description: |\n  The ops team moved the queue to NATS.\n  Second line.\n"
            "notes: |\n  line a\n  line b\ntags: [queue]\napprox_tokens: 120\n"
            "approx_tokens_source: estimate\nmode: live\n---\n\n## Digest\n"
            "The ops team moved the work queue to NATS JetStream. Open: retention.\n\n"
            "## Decisions\nUse NATS JetStream with file storage.\n")
    path = plain_shelf / "docs" / "topics" / "2026-05-01-queue-move.md"
    path.write_text(text, encoding="utf-8")
    assert cli("rebuild", "--shelf", plain_shelf).code == 0
    index = cli("index", "--shelf", plain_shelf)
    assert index.code == 0
    assert "- 2026-05-01-queue-move — The ops team moved the queue to NATS. Second line.\n" \
        in index.out
    recall = cli("recall", "--shelf", plain_shelf, "--id", "2026-05-01-queue-move",
                 "--section", "Decisions", "--json")
    assert recall.code == 0 and "file storage" in recall.json()["content"]
    assert recall.json()["title"] == "2026-05-01-queue-move"        # display_title: null
    found = cli("search", "--shelf", plain_shelf, "jetstream", "--json")
    assert found.code == 0 and found.json()["hits"][0]["id"] == "2026-05-01-queue-move"
    doctor = cli("doctor", "--shelf", plain_shelf, "--json")
    assert doctor.code == 0, doctor
    codes = {f["code"] for f in doctor.json()["findings"]}
    assert not {c for c in codes if c.startswith("frontmatter")}, codes
    ledger = (plain_shelf / "ledger.tsv").read_text(encoding="utf-8")
    assert "\tline a line b\n" in ledger        # one ledger row: the breaks collapsed


def test_null_id_is_a_missing_id(plain_shelf, cli):
    path = plain_shelf / "docs" / "topics" / "2026-05-02-null-id.md"
    path.write_text("---\nid: null\nkind: topic\nspan: 2026-05-02\ntags: []\n"
                    "approx_tokens: 1\n---\n\n## Digest\nThe ops team wrote it.\n\n"
                    "## Decisions\nNone.\n", encoding="utf-8")
    assert parse_frontmatter(path.read_text(encoding="utf-8"))[0]["id"] is None
    doctor = cli("doctor", "--shelf", plain_shelf, "--json")
    found = [f for f in doctor.json()["findings"] if f.get("path", "").endswith("null-id.md")]
    assert any(f["code"] == "frontmatter-missing-field" and "id" in f["detail"]
               for f in found), found


def test_implicit_types_are_gated_by_their_characters_alone():
    """_yaml_implicit_type tries a type's pattern only on a scalar that begins and is spelled
    with that type's characters; the gate never changes the answer the patterns alone give."""
    import random
    import re
    patterns = [(name, re.compile(p.pattern)) for name, _, _, p in memshelf._YAML_IMPLICIT_TYPES]

    def by_patterns(text):
        return "null" if not text else next(
            (name for name, p in patterns if p.match(text)), None)

    rng = random.Random(20261204)
    alphabet = "0123456789-+._:eExXbBoOnNyYtTfFaAsSlLuUrRiIzZ~<= \t\u0663q"
    spelled = ["2024-12-09", "2024-1-9 10:00:00", "2001-12-14t21:59:43.10-05:00", "null", "Null",
               "yes", "No", "on", "OFF", "0x1F", "0o17", "0b101", "-12", "1_000", "1:30", "3.14",
               "-.5", ".inf", "-.Inf", ".NaN", "1e5", "<<", "=", "~", "Tokens", "20-4-12-09",
               "\u0662\u0660\u0662\u0664-\u0661\u0662-\u0660\u0669", "2024-12-09x",
               "2024-12-09-image-resizer", "12:30:45"]
    spelled += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
                for _ in range(50000)]
    assert [memshelf._yaml_implicit_type(t) for t in spelled] == [by_patterns(t) for t in spelled]


def test_iso_dates_are_the_ones_datetime_takes():
    """_iso_date_ok checks the calendar by hand (no datetime import at every start); it takes
    exactly the YYYY-MM-DD strings datetime.date.fromisoformat takes."""
    import datetime

    def by_datetime(value):
        try:
            return memshelf._ISO_DATE.match(value) is not None and \
                bool(datetime.date.fromisoformat(value))
        except ValueError:
            return False

    values = [f"{y:04d}-{mo:02d}-{d:02d}" for y in (0, 1, 4, 100, 1900, 2000, 2023, 2024, 2100,
                                                      9999)
              for mo in range(0, 14) for d in range(0, 33)]
    values += ["\u0662\u0660\u0662\u0664-\u0661\u0662-\u0660\u0669", "2024-1-01", "2024-01-01 "]
    assert [memshelf._iso_date_ok(v) for v in values] == [by_datetime(v) for v in values]
