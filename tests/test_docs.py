"""The docs stay true to the repository: docs/config.md matches the schema, and every relative
link in README.md and docs/*.md names a file that exists, and every runnable example runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
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


# A doc example that opens with "# Run: python <file>" is a whole script; each one runs here, as a reader would.
RUNNABLE = re.compile(r"```python\n(# Run: python (\S+).*?)```", re.S)


def runnable_examples() -> list[tuple[str, str, str]]:
    """(page, file name, script) of every runnable example in README.md and docs/*.md."""
    return [(p.name, m.group(2), m.group(1)) for p in PAGES for m in RUNNABLE.finditer(p.read_text())]


def test_the_runnable_examples_are_found():
    found = {name for _, name, _ in runnable_examples()}
    assert {"sandbox_example.py", "sub_episode_example.py", "warm_start_example.py"} <= found, found


@pytest.mark.parametrize("page, name, script", runnable_examples(), ids=lambda v: v if v.endswith(".py") else "")
def test_a_runnable_doc_example_runs(page, name, script, tmp_path):
    if "run_program" in script and shutil.which("bwrap") is None:
        pytest.skip("the sandbox needs bubblewrap (make setup installs it)")
    (tmp_path / name).write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{page}: {name}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert list(tmp_path.glob("runs/*/metrics.jsonl")), f"{page}: {name} trained no step"
