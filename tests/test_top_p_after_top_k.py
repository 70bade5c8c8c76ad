"""Sampling filters apply in HF/vLLM order: top-k first, then top-p on the top-k-renormalised distribution."""

import math

import torch

from teamrl.rollout.hf_engine import _sample


def _draw(probs: list[float], k: int, p: float, n: int = 2000) -> set[int]:
    logits = torch.tensor([[math.log(q) for q in probs]] * n)
    gen = torch.Generator().manual_seed(0)
    tok, _ = _sample(logits, torch.ones(n), torch.full((n,), k, dtype=torch.long), torch.full((n,), p), gen)
    return set(tok.tolist())


def test_top_p_is_applied_after_top_k() -> None:
    # top-k=2 keeps [.5, .3] -> renormalised [.625, .375]; token 0 alone reaches p=0.6 (HF keeps only it).
    assert _draw([0.5, 0.3, 0.2], k=2, p=0.6) == {0}


def test_top_p_alone_and_top_k_alone_unchanged() -> None:
    assert _draw([0.5, 0.3, 0.2], k=0, p=0.6) == {0, 1}  # mass before token 1 is 0.5 < 0.6
    assert _draw([0.5, 0.3, 0.2], k=2, p=1.0) == {0, 1}
    assert _draw([0.5, 0.3, 0.2], k=2, p=0.7) == {0, 1}  # .625 < .7: token 1 is needed to reach p
