"""``make mutate`` stays usable: every hand-written mutant's snippet occurs exactly once in its file."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutant_applies():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "mutate.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mutants apply" in done.stdout
