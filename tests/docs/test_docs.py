"""The documents a user reads: every relative link resolves (file and #anchor), and none speaks of how the project
was made (work sessions, issue numbers) instead of what it is."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
# how the project was made: "the twelfth session", "this session", "issue 26", "issue #26", "(issues 23 and 24)"
HISTORY = re.compile(r"\b(?:\w+(?:st|nd|rd|th)|first|second|third|this|that|last|next|previous|earlier|later|a|one|"
                     r"each|every|work)[ -]sessions?\b|\bissues?\s*#?\d+", re.IGNORECASE)


def _prose(path: Path) -> list[str]:
    """The file's lines with fenced code blocks blanked (a link or heading inside code is not one)."""
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
            lines.append("")
        else:
            lines.append("" if inside else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(path):
        if m := HEADING.match(line):
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    found |= set(re.findall(r'<a (?:name|id)="([^"]+)"', path.read_text()))
    return found


def links(path: Path):
    for number, line in enumerate(_prose(path), 1):
        for m in LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
                yield number, target


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_anchor(path):
    broken = []
    for number, target in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{path.name}:{number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{path.name}:{number}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_document_speaks_of_work_sessions_or_issue_numbers(path):
    found = [f"{path.name}:{n}: {m.group(0)!r}" for n, line in enumerate(path.read_text().splitlines(), 1)
             for m in HISTORY.finditer(line)]
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_are_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n## The `--x` flag, again!\n[ok](#the---x-flag-again) [ok](#a-page) [bad](#nowhere)\n"
                    "[gone](missing.md) [url](https://example.com)\n```\n[in code](nothing.md)\n```\n"
                    "Measured in the twelfth session (issue 26); an HTTP session is fine.\n")
    assert anchors(page) == {"a-page", "the---x-flag-again"}
    assert [t for _, t in links(page)] == ["#the---x-flag-again", "#a-page", "#nowhere", "missing.md"]
    assert [m.group(0) for m in HISTORY.finditer(page.read_text())] == ["twelfth session", "issue 26"]
