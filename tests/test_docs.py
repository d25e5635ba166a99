"""The documentation holds: docs/flags.md is what the parser says, and every relative link in
README.md and docs/*.md reaches a file (and a heading, where it names one)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

from prefixserve.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_flags_reference_matches_the_parser() -> None:
    spec = importlib.util.spec_from_file_location("flags_doc", ROOT / "tools" / "flags_doc.py")
    assert spec is not None and spec.loader is not None
    flags_doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags_doc)
    expected = flags_doc.render(build_parser())
    assert flags_doc.FLAGS_MD.read_text() == expected, (
        f"docs/flags.md is out of date with the CLI's parser: run `{flags_doc.COMMAND}` and commit it"
    )


def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in links_in(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_anchors_are_githubs() -> None:
    assert anchors(
        "# Disk failures (`cache/disk_io.py`)\n## On a GPU (`make test-cuda`)\n## n > 1\n## n > 1\n"
    ) == {"disk-failures-cachedisk_iopy", "on-a-gpu-make-test-cuda", "n--1", "n--1-1"}


def links_in(markdown: str) -> list[str]:
    """Link targets outside fenced code blocks."""
    targets: list[str] = []
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            targets += LINK.findall(line)
    return targets


def anchors(markdown: str) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation but `-` and `_` dropped,
    spaces as `-`, a repeated id suffixed `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    ids: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids
