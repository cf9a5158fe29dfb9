"""The documentation stays true to the code: links resolve, and the options tables are the declared ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker_ext import options
from queueapp import conf

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        missing_anchor = bool(anchor) and linked.suffix == ".md" and anchor not in anchors(linked)
        if not linked.exists() or missing_anchor:
            broken.append(target)
    assert broken == []


def test_every_page_in_docs_starts_by_saying_who_it_is_for():
    for page in PAGES[1:]:
        paragraphs = page.read_text().split("\n\n")
        assert paragraphs[0].startswith("# "), page.name
        assert paragraphs[1].startswith("For "), page.name


def test_the_transport_options_tables_are_the_ones_the_code_declares():
    text = (ROOT / "docs" / "transport.md").read_text()
    assert options.markdown_table() in text
    assert options.kombu_markdown_table() in text


def test_the_settings_table_is_the_one_queueapp_declares():
    assert conf.markdown_table() in (ROOT / "docs" / "guarantees.md").read_text()
    assert len(conf.SETTINGS) == len(conf.DEFAULTS) == 31
