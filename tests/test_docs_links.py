"""Every link between the docs pages resolves (issue 82, behaviour 7): README.md and docs/*.md.

- ``[text](target)`` to a relative path: the file or folder exists;
- ``[text](page.md#anchor)`` (or ``#anchor`` in the same page): the anchor is the slug of a heading of that page, as
  GitHub makes it (lowercase; spaces become '-'; punctuation but '-' and '_' dropped; a repeated heading gets
  '-1', '-2', ...);
- a section named in quotes beside a link, ``[page.md](page.md), "Name"``, ``"Name" in [page.md](page.md)`` or
  ``[page.md, "Name"](page.md#anchor)``: "Name" is a heading of that page (or its part before a ':' or a '('), or,
  where the link has an anchor, a heading or the bold lead of a paragraph (``**Name.**``) in the anchored section;
- a page named in the text (``docs/page.md``, ``page.md`` in backticks) exists.

Fenced code blocks and inline code are not links (a command's ``[x](y)`` is not checked).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")
QUOTED_AFTER = re.compile(r'^,\s+"([^"]+)"(?!(?:\s+and\s+"[^"]+")?\s+in\s+\[)')  # [page.md](page.md), "Name"
QUOTED_BEFORE = re.compile(r'"([^"]+)"(?:\s+and\s+"([^"]+)")?\s+in\s+$')  # "A" (and "B") in [page.md](page.md)
QUOTED_INSIDE = re.compile(r'"([^"]+)"\s*$')  # [page.md, "Name"](page.md#anchor)
NAMED_PAGE = re.compile(r"(?<![\w/.-])((?:docs/)?[\w.-]+\.md)\b")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
BOLD_LEAD = re.compile(r"^\s*(?:[-*]\s+)?\*\*(.+?)[.:]?\*\*")


def prose(text: str, inline: bool = False) -> str:
    """``text`` without its fenced code blocks (blank lines in their place, so lines keep their numbers), and
    without its inline code unless ``inline``."""
    blank = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731
    text = re.sub(r"^```.*?^```", blank, text, flags=re.M | re.S)
    text = re.sub(r"(?<=\n\n)(?: {4}.*\n)+", blank, text)  # an indented code block
    return text if inline else re.sub(r"`[^`\n]*`", "``", text)


def plain(heading: str) -> str:
    """A heading's text as rendered: link text kept, code and emphasis marks dropped."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[`*]", "", heading).strip()


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", plain(heading).lower()).replace(" ", "-")


def sections(page: Path) -> dict[str, list[str]]:
    """Each heading's anchor in ``page``, and the names its section holds (its heading's, those of the headings and
    bold paragraph leads under it up to the next heading of its level or above)."""
    marks = []  # (line, level or None for a bold lead, name)
    for number, line in enumerate(prose(page.read_text(encoding="utf-8"), inline=True).splitlines()):
        heading, lead = HEADING.match(line), BOLD_LEAD.match(line)
        if heading:
            marks.append((number, len(heading.group(1)), heading.group(2)))
        elif lead:
            marks.append((number, None, lead.group(1)))
    found, seen = {}, {}
    for i, (_, level, text) in enumerate(marks):
        if level is None:
            continue
        base = slug(text)
        seen[base] = seen.get(base, -1) + 1
        inside = []
        for _, other, name in marks[i:]:
            if inside and other is not None and other <= level:
                break
            inside.append(plain(name))
        found[f"{base}-{seen[base]}" if seen[base] else base] = inside
    return found


def headings(page: Path) -> list[str]:
    return [m.group(2) for m in map(HEADING.match, prose(page.read_text(encoding="utf-8"), inline=True).splitlines())
            if m]


def links(page: Path) -> list[tuple[int, str, str, list[str]]]:
    """Each link of ``page``: its line, its text, its target, and the section names quoted beside it."""
    text = prose(page.read_text(encoding="utf-8"))
    found = []
    for match in LINK.finditer(text):
        after = QUOTED_AFTER.match(re.sub(r"\s+", " ", text[match.end():match.end() + 200]))
        inside = QUOTED_INSIDE.search(match.group(1))
        before = QUOTED_BEFORE.search(re.sub(r"\s+", " ", text[max(0, match.start() - 200):match.start()]))
        names = [name for quoted in (inside, after, before) if quoted for name in quoted.groups() if name]
        found.append((text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2),
                      [re.sub(r"\s+", " ", name) for name in names]))
    return found


def problems_of(page: Path, root: Path = REPO) -> list[str]:
    """What does not resolve in ``page`` of the repository at ``root``, one line each."""
    problems = []
    for line, _text, target, quoted in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = f"{page.relative_to(root)}:{line}: [{target}]"
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            problems.append(f"{where}: no file {path}")
            continue
        if linked.suffix != ".md" or not (anchor or quoted):
            continue
        known = sections(linked)
        if anchor and anchor not in known:
            problems.append(f"{where}: no heading #{anchor} in {linked.relative_to(root)}")
            continue
        # (a bold lead is named only with the anchor of its section: without one, a reader is left to search)
        names = known[anchor] if anchor else [plain(heading) for heading in headings(linked)]
        titles = {n.rstrip(".") for n in names} | {re.split(r": | \(", n)[0] for n in names}  # (or its first part)
        for name in quoted:
            if name.rstrip(".") not in titles:
                problems.append(f"{where}: no heading or bold paragraph lead {name!r} in {linked.relative_to(root)}#"
                                f"{anchor}" if anchor else f"{where}: no heading {name!r} in "
                                f"{linked.relative_to(root)} (a paragraph's bold lead: link its section's #anchor)")
    text = prose(page.read_text(encoding="utf-8"), inline=True)
    for match in NAMED_PAGE.finditer(text):
        named = match.group(1)
        if not any((base / named).exists() for base in (root, root / "docs", page.parent)):
            line = text.count("\n", 0, match.start()) + 1
            problems.append(f"{page.relative_to(root)}:{line}: names {named}, which is not in the repository")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_between_docs_pages_resolves(page):
    problems = problems_of(page)
    assert not problems, "\n".join(problems)


def test_the_checks_find_what_they_look_for(tmp_path):
    # The rules themselves: a heading with code and punctuation, a repeated one, a bold lead with and without its
    # section's anchor, names quoted after and before links, a missing file, a link inside a code block
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "b.md").write_text("# B\n\n## Packing (`--packing=True`)\n\n**The noise floor.** text\n\n## Packing "
                               "(`--packing=True`)\n\n## Other\n")
    (docs / "a.md").write_text(
        '[ok](b.md#packing---packingtrue) [ok](b.md#packing---packingtrue-1) [b, "The noise floor"](b.md#packing---'
        'packingtrue) [b](b.md), "The noise floor" [bad](b.md#the-noise-floor) [bad, "The noise floor"](b.md#other)'
        ' [bad](c.md) [bad](b.md), "Nowhere"\n```\n[not a link](nowhere.md)\n```\n"B" and "Other" in [b](b.md),'
        ' "Elsewhere" in [b](b.md)\n', encoding="utf-8")
    problems = problems_of(docs / "a.md", tmp_path)
    lead = "(a paragraph's bold lead: link its section's #anchor)"
    assert [p.split(": ", 1)[1] for p in problems] == [
        f"[b.md]: no heading 'The noise floor' in docs/b.md {lead}",
        "[b.md#the-noise-floor]: no heading #the-noise-floor in docs/b.md",
        "[b.md#other]: no heading or bold paragraph lead 'The noise floor' in docs/b.md#other",
        "[c.md]: no file c.md",
        f"[b.md]: no heading 'Nowhere' in docs/b.md {lead}",
        f"[b.md]: no heading 'Elsewhere' in docs/b.md {lead}",
        "names c.md, which is not in the repository",
    ]


LONGEST_CELL = 250  # characters: a longer explanation goes in a note under the table


def long_cells(text: str) -> list[int]:
    """Lengths of the table cells in ``text`` (outside code blocks) longer than LONGEST_CELL."""
    return [len(cell) for line in prose(text, inline=True).splitlines() if line.startswith("|")
            for cell in line.split("|") if len(cell) > LONGEST_CELL]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_tables_keep_short_cells(page):
    assert long_cells("| a | " + "x" * 300 + " |\n") == [302]  # the check finds a long one
    assert not long_cells(page.read_text(encoding="utf-8")), f"{page.name}: cells over {LONGEST_CELL} characters"
