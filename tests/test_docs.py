"""docs/benchmarks.md stays a page of current tables (issue 56): at most 250 lines, every section with the
command that reproduces it, and its pointers into docs/benchmarks-log.md (where history and reasons go) live.
Reads text only: no jax."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
BENCHMARKS = DOCS / "benchmarks.md"
LOG = DOCS / "benchmarks-log.md"
MAX_LINES = 250
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _sections(text: str) -> dict[str, str]:
    """Each "## " section's title and body (up to the next "## " heading), code blocks included."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def _shows_command(body: str) -> bool:
    if FENCE.search(body):
        return True
    spans = re.findall(r"`([^`]+)`", body)  # inline code spans, paired left to right
    return any(re.search(r"\b(python|bash) \S", span) for span in spans)


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", text), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_benchmarks_md_is_at_most_250_lines():
    lines = BENCHMARKS.read_text().splitlines()
    assert len(lines) <= MAX_LINES, (
        f"docs/benchmarks.md has {len(lines)} lines (at most {MAX_LINES}): move reasons, superseded tables and "
        "history to docs/benchmarks-log.md, newest first, and leave a one-line pointer"
    )


def test_every_benchmarks_section_shows_its_command():
    sections = _sections(BENCHMARKS.read_text())
    assert sections, "docs/benchmarks.md has no '## ' sections"
    without = [title for title, body in sections.items() if not _shows_command(body)]
    assert not without, f"sections of docs/benchmarks.md with no command in backticks or a code block: {without}"


def test_benchmarks_pointers_into_the_log_resolve():
    anchors = _anchors(LOG.read_text())
    links = re.findall(r"\(benchmarks-log\.md#([^)\s]+)\)", BENCHMARKS.read_text())
    assert links, "docs/benchmarks.md points nowhere into docs/benchmarks-log.md"
    assert not [a for a in links if a not in anchors], [a for a in links if a not in anchors]
