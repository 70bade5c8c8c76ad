"""Seeding and RNG state capture, so that runs are reproducible and resumable."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (e.g. run seed and step), independent of call order."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) % 2**64
    return h % 2**63


def rng_state() -> dict[str, Any]:
    """Every global RNG state, for checkpoints: as tensors and plain lists and numbers only, so that a checkpoint
    loads with ``torch.load(..., weights_only=True)`` (unpickling nothing that could run code)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (or the tuples and arrays checkpoints held before it)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["kind"], np.asarray(numpy_state["keys"], dtype=np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
