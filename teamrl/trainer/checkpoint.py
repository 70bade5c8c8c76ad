"""Checkpoints: each policy's own weights and optimizer, RNG states, step and data position.

A checkpoint is written to a temporary folder and renamed into place, so a run killed
mid-save never leaves a half-written checkpoint that ``--resume`` would pick up.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch

from teamrl.core.seeding import rng_state, set_rng_state
from teamrl.policies.router import PolicyRouter

_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(folder: Path, step: int, router: PolicyRouter, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``folder/step_N`` and keep only the ``keep`` newest checkpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{step:06d}"
    tmp = folder / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, pol in router.policies.items():
        torch.save(pol.named_state(), tmp / f"policy_{name}.pt")
        torch.save(pol.optimizer.state_dict(), tmp / f"optimizer_{name}.pt")
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / "trainer_state.pt").is_file()]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path, router: PolicyRouter) -> dict[str, Any]:
    """Restore policies, optimizers and RNG states from ``path``; return the trainer state."""
    for name, pol in router.policies.items():
        f = path / f"policy_{name}.pt"
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint {path} has no weights for policy {name!r} ({f.name}); was the policy mode changed?")
        pol.load_named_state(torch.load(f, weights_only=True, map_location="cpu"))  # a GPU run resumes on a CPU too
        pol.optimizer.load_state_dict(torch.load(path / f"optimizer_{name}.pt", weights_only=True, map_location="cpu"))
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    set_rng_state(state["rng"])
    return state
