"""The docs stay true to the repository: docs/config.md matches the schema, and every relative
link in README.md and docs/*.md names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.config_reference import DOC, render

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(page: Path) -> list[str]:
    """The link targets of a Markdown page that point into the repository (no URL, no bare #anchor)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_config_reference_is_generated_from_the_current_schema():
    assert DOC.read_text() == render(), "docs/config.md is stale; regenerate with: python tools/config_reference.py"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_an_existing_file(page):
    missing = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_link_finder_sees_relative_links_and_skips_urls_and_anchors(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](docs/x.md#sec) [b](https://e.org) [c](#top) [d](../y.py \"title\")\n```\n[e](no.md)\n```\n")
    assert relative_links(page) == ["docs/x.md#sec", "../y.py"]
