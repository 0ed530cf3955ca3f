"""BENCHMARKS.md opens with a table of today's numbers; this holds the table to its sections.

Every row of the table links to the section that measured it (a markdown anchor, `(#anchor)`)
and names the command that reproduces it (in backticks). The anchors follow GitHub's rule for
heading ids: the heading's text as rendered, lowercased, every character that is not a letter,
a digit, a space, '-' or '_' dropped, spaces turned into '-'; a heading whose id is already
taken gets '-1', '-2', ... appended. Reads the file only.
"""

import re
import unicodedata
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
TABLE_HEADING = "Today's numbers"

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_LINK = re.compile(r"\]\(#([^)\s]*)\)")
_CODE = re.compile(r"`[^`]+`")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def headings(markdown):
    """(level, text) of every ATX heading outside fenced code blocks, in order."""
    found, fence = [], None
    for line in markdown.splitlines():
        m = _FENCE.match(line)
        if m:
            mark = m.group(1)
            if fence is None:
                fence = mark
            elif mark[0] == fence[0] and len(mark) >= len(fence):
                fence = None
            continue
        if fence is not None:
            continue
        h = _ATX.match(line)
        if h:
            found.append((len(h.group(1)), h.group(2) or ""))
    return found


def rendered(text):
    """A heading's text as GitHub renders it: code spans, links and emphasis reduced to text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("`", "")
    text = re.sub(r"(\*{1,3}|(?<!\w)_{1,3}|_{1,3}(?!\w))", "", text)
    return text.strip()


def slug(text):
    """GitHub's heading id for one heading, before duplicates are numbered."""
    out = []
    for ch in rendered(text).lower():
        if ch == " ":
            out.append("-")
        elif ch in "-_" or unicodedata.category(ch)[0] in "LNM":
            out.append(ch)
    return "".join(out)


def anchors(markdown):
    """Every heading id in the document, duplicates numbered as GitHub's slugger numbers them."""
    occurrences, ids = {}, []
    for _, text in headings(markdown):
        base = anchor = slug(text)
        while anchor in occurrences:
            occurrences[base] += 1
            anchor = f"{base}-{occurrences[base]}"
        occurrences[anchor] = 0
        ids.append(anchor)
    return ids


def cells(line):
    inner = line.strip()
    if inner.startswith("|"):
        inner = inner[1:]
    if inner.endswith("|") and not inner.endswith("\\|"):
        inner = inner[:-1]
    return [c.strip() for c in _CELL_SPLIT.split(inner)]


def top_table(markdown):
    """(header cells, body rows as cell lists, body rows as lines) of the first table under the
    table heading, or None when there is no such heading or table."""
    lines = markdown.splitlines()
    start = None
    for i, line in enumerate(lines):
        h = _ATX.match(line)
        if h and rendered(h.group(2) or "") == TABLE_HEADING:
            start = i + 1
            break
    if start is None:
        return None
    table = []
    for line in lines[start:]:
        if _ATX.match(line):
            break
        if line.lstrip().startswith("|"):
            table.append(line)
        elif table:
            break
    if len(table) < 2:
        return None
    header = [c.lower() for c in cells(table[0])]
    body = table[2:]
    return header, [cells(r) for r in body], body


def problems(markdown):
    """What is wrong with the document's top table; empty when every row links to an existing
    heading and names a command."""
    found = top_table(markdown)
    if found is None:
        return [f"no table under a '{TABLE_HEADING}' heading"]
    header, rows, lines = found
    out = []
    if "command" not in header:
        return ["the table has no 'command' column"]
    col = header.index("command")
    known = set(anchors(markdown))
    if not rows:
        out.append("the table has no rows")
    for n, (row, line) in enumerate(zip(rows, lines, strict=True), 1):
        if len(row) != len(header):
            out.append(f"row {n}: {len(row)} cells, header has {len(header)}")
            continue
        links = _LINK.findall(line)
        if not links:
            out.append(f"row {n}: no link to a section")
        for a in links:
            if a not in known:
                out.append(f"row {n}: #{a} is no heading's anchor")
        if not _CODE.search(row[col]):
            out.append(f"row {n}: no command in backticks")
    return out


def test_slug_follows_githubs_rule():
    assert slug("Today's numbers") == "todays-numbers"
    want = "the-http-servers-own-overhead-issue-14"
    assert slug("The HTTP server's own overhead (issue 14)") == want
    assert (
        slug("bfcl-eval `long_context` (seeded sample: 16 of 200 sessions, `--sample 16 --seed 0`)")
        == "bfcl-eval-long_context-seeded-sample-16-of-200-sessions---sample-16---seed-0"
    )
    assert slug("Beyond AMORTIZE and FORGET: DECAY, MOVE, SCRATCH (issue 16)") == (
        "beyond-amortize-and-forget-decay-move-scratch-issue-16"
    )
    assert slug("Splice — 2× faster, **really**") == "splice--2-faster-really"
    assert slug("See [the design](docs/design.md)") == "see-the-design"


def test_duplicate_headings_are_numbered():
    doc = "# A\n\n## Notes\n\n```\n# Notes\n```\n\n## Notes\n\n### Notes\n\n## Notes-1\n"
    # the fenced '# Notes' is code, not a heading; a literal 'Notes-1' after two 'Notes'
    # takes the next free id, as GitHub's slugger does
    assert anchors(doc) == ["a", "notes", "notes-1", "notes-2", "notes-1-1"]


def test_every_row_links_to_a_heading_and_names_a_command():
    text = DOC.read_text(encoding="utf-8")
    assert problems(text) == []


def test_the_file_opens_with_the_table():
    text = DOC.read_text(encoding="utf-8")
    levels = headings(text)
    assert levels[0][0] == 1
    assert rendered(levels[1][1]) == TABLE_HEADING, "the table is the first section"
    header, rows, _ = top_table(text)
    assert header == ["what", "number", "machine", "date", "section", "command"]
    assert 10 <= len(rows) <= 30, "one screen of headline numbers"
    assert "history" in anchors(text)


MADE_UP = """# Benchmarks

## Today's numbers

| what | number | machine | date | section | command |
|---|---|---|---|---|---|
| edit | 5x | CPU | 2026-01-01 | [Edits](#edits-issue-1) | `python -m bench.edit` |
| decode | 2x | CPU | 2026-01-02 | [Decode](#decode) | `python -m bench.decode` |

## History

### Edits (issue 1)

### Decode
"""


def test_check_passes_on_a_sound_made_up_table():
    assert problems(MADE_UP) == []


def test_check_fails_on_a_broken_anchor():
    broken = MADE_UP.replace("(#decode)", "(#decoding)")
    assert problems(broken) == ["row 2: #decoding is no heading's anchor"]
    # a heading renamed under its link breaks it the same way
    renamed = MADE_UP.replace("### Edits (issue 1)", "### Edits (issue 2)")
    assert problems(renamed) == ["row 1: #edits-issue-1 is no heading's anchor"]


def test_check_fails_on_a_row_without_a_command_or_link():
    no_command = MADE_UP.replace("`python -m bench.decode`", "python -m bench.decode")
    assert problems(no_command) == ["row 2: no command in backticks"]
    no_link = MADE_UP.replace("[Edits](#edits-issue-1)", "Edits")
    assert problems(no_link) == ["row 1: no link to a section"]
    assert problems(MADE_UP.replace("## Today's numbers", "## Numbers")) == [
        "no table under a 'Today's numbers' heading"
    ]
