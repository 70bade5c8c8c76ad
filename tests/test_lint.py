"""The tree is lint-clean: ``ruff check`` (its settings in pyproject.toml, [tool.ruff]) finds nothing, and mypy finds
no type error in ``teamrl.core``, ``teamrl.losses`` and ``teamrl.algorithms`` ([tool.mypy])."""

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


TYPED_PACKAGES = ("teamrl.core", "teamrl.losses", "teamrl.algorithms")


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install -c constraints.txt -e '.[test]' installs it)")
def test_mypy_finds_no_type_error_in_the_typed_packages(tmp_path):
    packages = [arg for p in TYPED_PACKAGES for arg in ("-p", p)]
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy_cache"), *packages],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"mypy found type errors in {', '.join(TYPED_PACKAGES)}:\n{run.stdout}{run.stderr}"
