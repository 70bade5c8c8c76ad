"""What the tests of tests_vllm/ share: the processes of a vLLM server, and a run's settings."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the API server's module, and the titles vLLM gives its engine core and workers (VLLM::EngineCore, VLLM::Worker)
VLLM_PATTERN = "vllm.entrypoints|VLLM::"


def vllm_processes() -> list[str]:
    """``pgrep -af`` lines of every vLLM process on the machine (the API server, its engine core and workers)."""
    out = subprocess.run(["pgrep", "-af", VLLM_PATTERN], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.strip() and "pgrep" not in ln]


def group_alive(pgid: int) -> bool:
    """Whether any process of the server's process group (the server, its engine core and workers) is left."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        return ") Z " not in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False


def assert_server_gone(pid: int, port: int) -> None:
    """The server of ``pid`` (its process group) and anything of vLLM serving ``port`` are gone; prints what was checked."""
    mine = [ln for ln in vllm_processes() if f"--port {port}" in ln]
    others = [ln for ln in vllm_processes() if ln not in mine]
    print(f"[test-vllm] after the run: server pid {pid} alive: {pid_alive(pid)}; its process group alive: {group_alive(pid)}; "
          f"vLLM processes on port {port}: {len(mine)}; `pgrep -f '{VLLM_PATTERN}'`: {len(others) + len(mine)} line(s)"
          + (f" (others' servers: {others})" if others else ""), flush=True)
    assert not pid_alive(pid) and not group_alive(pid) and not mine


def run_overrides(tmp_path: Path, name: str, steps: int = 2) -> list[str]:
    """A managed-server run of a shipped config, short and inside ``tmp_path``."""
    return [f"name={name}", f"run.dir={tmp_path}", f"train.steps={steps}", "rollout.engine=vllm", "run.tensorboard=false",
            "run.progress=false"]
