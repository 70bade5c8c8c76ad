"""Checkpoints: each policy's own weights and optimizer, RNG states, step and data position.

A checkpoint is written to a temporary folder and renamed into place, so a run killed
mid-save never leaves a half-written checkpoint that ``--resume`` would pick up. A weight or
optimizer state holding a NaN/inf is refused before anything is written: no checkpoint holds one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch

from teamrl.core.seeding import rng_state, set_rng_state
from teamrl.policies.router import PolicyRouter

_STEP_DIR = re.compile(r"^step_(\d+)$")


class PolicyStates(Protocol):
    """What a checkpoint reads and restores of the policies, wherever they live (a worker placement)."""

    def policy_names(self) -> list[str]: ...

    def policy_state(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...

    def load_policy_state(self, name: str, weights: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None: ...


class RouterStates:
    """:class:`PolicyStates` of the policies of one in-process router."""

    def __init__(self, router: PolicyRouter) -> None:
        self.router = router

    def policy_names(self) -> list[str]:
        return list(self.router.policies)

    def policy_state(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        pol = self.router.policies[name]
        return pol.named_state(), pol.optimizer.state_dict()

    def load_policy_state(self, name: str, weights: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
        pol = self.router.policies[name]
        pol.load_named_state(weights)
        pol.optimizer.load_state_dict(optimizer)


def _states(policies: PolicyRouter | PolicyStates) -> PolicyStates:
    return RouterStates(policies) if isinstance(policies, PolicyRouter) else policies


def _first_nonfinite(tree: Any, path: str = "") -> str | None:
    """The path of the first tensor in a nested dict/list that holds a NaN or inf, else None."""
    if isinstance(tree, torch.Tensor):
        return path if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for k, v in items:
        found = _first_nonfinite(v, f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None


def save_checkpoint(folder: Path, step: int, policies: PolicyRouter | PolicyStates, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``folder/step_N`` (each policy of a router or a worker placement) and keep only the ``keep`` newest checkpoints.

    Raises ValueError, writing nothing, when a policy's weights or optimizer state hold a NaN/inf.
    """
    states = _states(policies)
    saved = {name: states.policy_state(name) for name in states.policy_names()}
    for name, (weights, optim) in saved.items():
        for what, tree in (("weight", weights), ("optimizer state", optim)):
            bad = _first_nonfinite(tree)
            if bad is not None:
                raise ValueError(f"checkpoint step {step}: policy {name!r} {what} {bad} holds a NaN/inf; refusing to save it")
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{step:06d}"
    tmp = folder / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, (weights, optim) in saved.items():
        torch.save(weights, tmp / f"policy_{name}.pt")
        torch.save(optim, tmp / f"optimizer_{name}.pt")
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


def load_checkpoint(path: Path, policies: PolicyRouter | PolicyStates) -> dict[str, Any]:
    """Restore policies (of a router or a worker placement), optimizers and RNG states from ``path``; return the trainer state."""
    states = _states(policies)
    for name in states.policy_names():
        f = path / f"policy_{name}.pt"
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint {path} has no weights for policy {name!r} ({f.name}); was the policy mode changed?")
        # a GPU run resumes on a CPU too
        states.load_policy_state(name, torch.load(f, weights_only=True, map_location="cpu"),
                                 torch.load(path / f"optimizer_{name}.pt", weights_only=True, map_location="cpu"))
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    set_rng_state(state["rng"])
    return state
