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


# MKL's matrix products round differently for the same values at different offsets from a 64-byte boundary
# (its reproducibility conditions ask for 64-byte aligned inputs): measured on SmolLM2-135M, the freshly
# converted weights (offsets 0/16/32/48) and the same weights memory-mapped from safetensors (offset 40) gave
# log-probs up to 1.5e-5 apart and, from one seed, different tokens.
ALIGNMENT = 64


def align_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Copy every parameter and buffer of ``model`` that does not start on a 64-byte boundary into one that does.

    Values, ``requires_grad`` and tied weights (one Parameter under two names) are kept; torch's allocator
    aligns fresh CPU tensors to 64 bytes, so a copy suffices. Returns ``model``."""
    for p in model.parameters():
        if p.device.type == "cpu" and p.data_ptr() % ALIGNMENT:
            p.data = p.data.clone(memory_format=torch.contiguous_format)
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.device.type == "cpu" and b.data_ptr() % ALIGNMENT:
                module._buffers[name] = b.clone(memory_format=torch.contiguous_format)
    return model
