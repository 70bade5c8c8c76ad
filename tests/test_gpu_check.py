"""bench/gpu_check.sh: the GPU check's code path on the CPU with a tiny model, and its fail-fast without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _run(*args, timeout=240):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_gpu_check_runs_magrpo_iterations_on_cpu_with_tiny_model():
    r = _run("--device", "cpu", "--tiny", "--iterations", "2", "--tokens", "8", "--batch-size", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sum("tiny-random iteration" in line for line in lines) == 2
    (summary,) = [line for line in lines if line.startswith("tiny-random:")]
    assert "on cpu (float32)" in summary and "s/iteration" in summary and "tokens/s" in summary
    assert "MAGRPO" in r.stdout and "8 new tokens (ignore_eos)" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_gpu_check_fails_fast_without_a_gpu():
    r = _run(timeout=120)
    assert r.returncode == 2
    assert "no CUDA GPU" in r.stderr and "--device cpu --tiny" in r.stderr
