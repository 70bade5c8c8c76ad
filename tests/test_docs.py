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
    for folder in ("configs", "examples"):  # as a reader in the repository root has them
        (tmp_path / folder).symlink_to(ROOT / folder)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{page}: {name}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert list(tmp_path.glob("runs/*/metrics.jsonl")), f"{page}: {name} trained no step"


PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
# a repository file named in a string literal: examples/x.yaml, configs/x.yaml (what a reader would open or pass)
REPO_PATH = re.compile(r"(?<![\w./-])((?:examples|configs)/[\w./-]*\w)")


def python_blocks() -> list[tuple[str, int, str]]:
    """(page, line the block starts on, code) of every ```python block in README.md and docs/*.md."""
    out = []
    for p in PAGES:
        text = p.read_text()
        out += [(p.name, text.count("\n", 0, m.start()) + 1, m.group(1)) for m in PYTHON_BLOCK.finditer(text)]
    return out


def named_repo_files(code: str) -> list[str]:
    """The examples/... and configs/... paths that the string literals of ``code`` name."""
    import ast

    strings = [n.value for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return [path for s in strings for path in REPO_PATH.findall(s)]


def test_every_python_block_in_the_docs_runs_or_parses_and_names_only_files_that_exist():
    """A runnable block (``# Run:``) is also run by test_a_runnable_doc_example_runs; every block is checked here."""
    bad = []
    for page, line, code in python_blocks():
        try:
            missing = [path for path in named_repo_files(code) if not (ROOT / path).exists()]
        except SyntaxError as e:
            bad.append(f"{page}:{line}: does not parse ({e.msg}, line {e.lineno} of the block)")
            continue
        if missing:
            bad.append(f"{page}:{line}: names files that do not exist: {missing}")
    assert not bad, "\n".join(bad)


def test_the_python_block_checker_sees_missing_files_and_syntax_errors():
    assert named_repo_files('load_config("examples/demo.yaml", ["configs/x.yaml"])\nf"runs/examples/y"') == [
        "examples/demo.yaml", "configs/x.yaml"]
    with pytest.raises(SyntaxError):
        named_repo_files("cfg = load_config(\n")
