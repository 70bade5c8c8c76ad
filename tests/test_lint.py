"""The tree is lint-clean: ``ruff check`` (its settings in pyproject.toml, [tool.ruff]) finds nothing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (pip install -c constraints.txt -e '.[test]' installs it)")
def test_ruff_check_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"ruff check found problems (fix them, or see [tool.ruff] in pyproject.toml):\n" \
                                f"{run.stdout}{run.stderr}"
