"""Same seed, same run: the floats a model computes must not depend on where its weights happen to lie in memory.

MKL's matrix products give different roundings for the same values at different 64-byte alignments. A model
loaded from safetensors (memory-mapped: every tensor at the header's offset, 40 bytes past a 64-byte boundary
for the cached SmolLM2) and the same model freshly converted from GGUF (tensors at 0/16/32/48 past one) sampled
different tokens from the same seed: the first ``make demo`` after setup (which converts) differed from every
later one at step 1 (``reward_mean`` 2.651 vs 2.706). :func:`teamrl.policies.models.load_model` therefore
returns every parameter 64-byte aligned.
"""

from __future__ import annotations

import torch

from teamrl.core.seeding import ALIGNMENT, align_parameters
from teamrl.policies.models import load_model


def _misaligned_copy(model: torch.nn.Module, shift_floats: int) -> None:
    """Move every parameter into a fresh buffer ``shift_floats`` floats past a 64-byte boundary (as a mmap would)."""
    for p in model.parameters():
        buf = torch.empty(p.numel() + 16, dtype=p.dtype)
        view = buf[shift_floats:shift_floats + p.numel()].view_as(p.data)
        view.copy_(p.data)
        p.data = view


def test_align_parameters_puts_every_parameter_on_a_64_byte_boundary_and_keeps_values_and_ties():
    model, _ = load_model("tiny-random", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _misaligned_copy(model, 2)
    assert any(p.data_ptr() % ALIGNMENT for p in model.parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    align_parameters(model)
    assert all(p.data_ptr() % ALIGNMENT == 0 for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied


def test_load_model_returns_aligned_parameters():
    model, _ = load_model("tiny-random", seed=0)
    assert all(p.data_ptr() % ALIGNMENT == 0 for p in model.parameters())
