"""README.md is a short entry point, and every relative link in it and in docs/*.md leads somewhere:
an existing file and, with a #anchor, a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.M)}


def _links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text())
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))  # code blocks
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][\w+.-]*:", t)]  # https:, mailto:


def test_the_readme_is_under_250_lines() -> None:
    assert len(README.read_text().splitlines()) < 250


def test_every_relative_link_resolves_to_a_file_and_heading() -> None:
    broken = []
    for page in PAGES:
        for target in _links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_links_are_found() -> None:
    assert len(_links(README)) > 10 and "docs/README.md" in _links(README)


def test_the_readme_gives_make_test_as_the_test_command() -> None:
    assert re.search(r"^\s*make test\s*$", README.read_text(), re.M)
    assert "`make test` runs the whole suite" in README.read_text()
