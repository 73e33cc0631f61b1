"""The README and the pages under docs/ link only to what exists, and the README stays short.

For README.md and every docs/**/*.md: each relative Markdown link (inline ``[text](path)``,
``[text](path#anchor)``, images ``![alt](path)``, and reference definitions ``[ref]: path``)
resolves to a file or folder in the repository, and each ``#anchor`` into a Markdown file (or
into the page itself) names one of that file's headings, slugged as GitHub slugs them:
lower-case, punctuation dropped, each space a hyphen, repeats numbered ``-1``, ``-2``...
Links to http(s) and mailto addresses are not followed. Links inside code (fenced blocks,
inline spans) are text, not links, and are not checked.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 250
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets (an image in a link).
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)


def outside_fences(text: str) -> Iterator[tuple[int, str]]:
    """Each line outside fenced code blocks, with its number."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1) == fence:
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        yield number, line


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """Each line outside fenced code blocks, with its number, inline code spans blanked."""
    for number, line in outside_fences(text):
        yield number, INLINE_CODE.sub(lambda span: " " * len(span.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stands for it
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and '_' in any script
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor GitHub gives the Markdown file's headings (repeats numbered as it numbers them)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in outside_fences(path.read_text(encoding="utf-8")):
        heading = HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def links(path: Path) -> Iterator[tuple[int, str]]:
    """Each link target in the page that is not an outside address, with its line number."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        targets = [match.group(1) for match in INLINE_LINK.finditer(line)]
        definition = REFERENCE_DEFINITION.match(line)
        if definition is not None:
            targets.append(definition.group(1))
        for target in targets:
            target = target.strip("<>").strip()
            if target and not EXTERNAL.match(target):
                yield number, target


def broken(page: Path, target: str, *, root: Path = REPO) -> str | None:
    """Why ``target``, linked from ``page`` in the repository at ``root``, does not resolve; None
    when it does."""
    location, _, anchor = target.partition("#")
    location = unquote(location)
    if not location:
        resolved = page
    elif location.startswith("/"):
        resolved = root / location.lstrip("/")
    else:
        resolved = (page.parent / location).resolve()
    if not resolved.is_relative_to(root):
        return f"{target}: outside the repository"
    where = resolved.relative_to(root)
    if not resolved.exists():
        return f"{target}: {where} does not exist"
    if anchor and resolved.is_file() and resolved.suffix.lower() == ".md" and unquote(anchor) not in anchors(resolved):
        return f"{target}: no heading of {where} has the anchor #{anchor}"
    return None


def test_the_pages_are_found() -> None:
    assert README.is_file()
    assert len(PAGES) > 1, "no Markdown pages under docs/"


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(REPO)) for page in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    problems = [
        f"{page.relative_to(REPO)}:{number}: {why}"
        for number, target in links(page)
        if (why := broken(page, target)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_readme_is_at_most_250_lines() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("On a real cluster", "on-a-real-cluster"),
        ("A bad day, on purpose: `make chaos`", "a-bad-day-on-purpose-make-chaos"),
        ("The detector's privileges", "the-detectors-privileges"),
        ("Slurm through slurmrestd (the `rest` backend)", "slurm-through-slurmrestd-the-rest-backend"),
        ("Temporal Cloud, TLS and API keys", "temporal-cloud-tls-and-api-keys"),
        ("See [the lab](lab.md) first", "see-the-lab-first"),
        ("snake_case stays", "snake_case-stays"),
    ],
)
def test_headings_are_slugged_as_github_slugs_them(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_the_checker_sees_what_it_must_and_skips_what_it_must(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n"
        "[a](one.md) ![b](img/two.png) [c](three.md#part) [d](#title) [e](https://example.com) "
        "[f](mailto:x@example.com) `[g](in-code.md)`\n"
        "```\n[h](in-fence.md)\n```\n"
        "[ref]: four.md\n",
        encoding="utf-8",
    )
    assert [target for _, target in links(page)] == ["one.md", "img/two.png", "three.md#part", "#title", "four.md"]
    (tmp_path / "three.md").write_text("## The part\n", encoding="utf-8")
    assert broken(page, "#title", root=tmp_path) is None
    assert broken(page, "#nowhere", root=tmp_path) is not None
    assert broken(page, "one.md", root=tmp_path) is not None
    assert broken(page, "three.md#the-part", root=tmp_path) is None
    assert broken(page, "three.md#part", root=tmp_path) is not None
    assert broken(page, "../outside.md", root=tmp_path) is not None
