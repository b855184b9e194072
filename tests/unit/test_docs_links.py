"""Every relative link in README.md and docs/**/*.md points to a file that exists, and every `#anchor` to a heading
of that file (the docs moved into guides/, reference/ and results/, and a moved page must not leave a
dead link behind). Links inside code (fenced blocks, inline spans) are not links and are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks, with inline code spans removed."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but `-` and `_` dropped, spaces turned into `-`."""
    ids = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            ids.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return ids


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` whose file (or heading) is missing, as 'target (why)'."""
    broken = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_docs_are_grouped_and_linked() -> None:
    """The four groups exist and the map (docs/index.md) links every page of docs/."""
    for group in ("guides", "reference", "results"):
        assert list((REPO / "docs" / group).glob("*.md")), group
    index = REPO / "docs" / "index.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in LINK.findall(_prose(index.read_text()))}
    unlinked = [str(p.relative_to(REPO)) for p in PAGES[1:] if p != index and p.resolve() not in linked]
    assert unlinked == []


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "guides").mkdir()
    (tmp_path / "guides" / "train.md").write_text("# Train\n\n## Crash safety and resume\n")
    page = tmp_path / "index.md"
    page.write_text(
        "[ok](guides/train.md) [ok](guides/train.md#crash-safety-and-resume) [web](https://example.com)\n"
        "[gone](training.md) ![gone](img.png) [bad](guides/train.md#export)\n"
        "`[code](nowhere.md)`\n```\n[code](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "training.md (no such file)",
        "img.png (no such file)",
        "guides/train.md#export (no such heading)",
    ]
