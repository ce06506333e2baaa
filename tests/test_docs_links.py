"""Every relative link in README.md and docs/*.md points at a file that exists (and, with a
`#fragment`, at a heading of that file), and every benchmark table or script the docs name in
backticks (`benchmarks/...`, or `results/...` under benchmarks/) exists: results files come
and go as tables are replaced, and a dead reference would otherwise go unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\s]+)`")
BENCHMARK_PATH = re.compile(r"(benchmarks|results)/\S+\.(md|txt|json|py|sh)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _prose(path: Path) -> str:
    """The file without its fenced code blocks (commands there are not references)."""
    return FENCE.sub("", path.read_text())


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = LINK.sub(lambda m: m.group(0)[1 : m.group(0).index("]")], heading)
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _expand_braces(pattern: str) -> list[str]:
    """`a_{x,y}.py` -> [`a_x.py`, `a_y.py`] (one level, as the docs write them)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [head + part + tail for part in match.group(1).split(",")]


def _dead_links(doc: Path) -> list[str]:
    dead = []
    for target in LINK.findall(re.sub(r"`[^`]*`", "", _prose(doc))):  # not in code spans
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists() or (
            fragment and linked.suffix == ".md" and fragment not in _anchors(linked)
        ):
            dead.append(target)
    return dead


def _dead_benchmark_paths(doc: Path) -> list[str]:
    dead = []
    for span in CODE_SPAN.findall(_prose(doc)):
        if not BENCHMARK_PATH.fullmatch(span):
            continue
        base = ROOT if span.startswith("benchmarks/") else ROOT / "benchmarks"
        for pattern in _expand_braces(span):
            if not list(base.glob(pattern)):
                dead.append(pattern)
    return dead


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_relative_links_point_at_existing_files_and_headings(doc: Path) -> None:
    assert _dead_links(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_benchmark_files_named_in_backticks_exist(doc: Path) -> None:
    assert _dead_benchmark_paths(doc) == []


def test_the_checks_catch_a_dead_link_a_missing_heading_and_a_missing_table(
    tmp_path: Path,
) -> None:
    (tmp_path / "other.md").write_text("# A heading, with `code`\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](other.md#a-heading-with-code) [gone](missing.md#x) [bad](other.md#nowhere)\n"
        "`results/no_such_table-2026-01-01.md` `benchmarks/cpu_decode.py` `kernel[grid](...)`\n"
        "```\n[in a fence](ignored.md)\n```\n"
    )
    assert _dead_links(doc) == ["missing.md#x", "other.md#nowhere"]
    assert _dead_benchmark_paths(doc) == ["results/no_such_table-2026-01-01.md"]
