"""Per-token log-probs of completion tokens, computing logits only where they are needed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


@dataclass
class TokenBatch:
    """Prompts left-padded to ``P`` and completions right-padded to ``T``, side by side.

    Left-padding the prompts puts every completion at the same columns, so one
    ``logits_to_keep = T + 1`` forward returns exactly the logits that predict completion tokens.
    """

    input_ids: torch.Tensor        # [B, P + T]
    attention_mask: torch.Tensor   # [B, P + T]
    position_ids: torch.Tensor     # [B, P + T]
    completion_ids: torch.Tensor   # [B, T]
    completion_pad_mask: torch.Tensor  # [B, T] True on real completion tokens

    @property
    def completion_len(self) -> int:
        return self.completion_ids.shape[1]


def build_token_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int) -> TokenBatch:
    """Pack prompt and completion ids (lists of ints) into a :class:`TokenBatch`."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    B = len(prompts)
    P = max(len(p) for p in prompts)
    T = max(1, max(len(c) for c in completions))
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P + T), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        ids[i, P:P + len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, P - len(p):P + len(c)] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(ids, mask, pos, ids[:, P:], mask[:, P:].bool())


def completion_logprobs(model: nn.Module, batch: TokenBatch, temperature: float = 1.0,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of the completion tokens under ``softmax(logits / temperature)``.

    Values at padding positions are finite but meaningless: mask them. With
    ``with_entropy`` also returns the per-token entropy [B, T] of the same distribution.
    """
    T = batch.completion_len
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False, logits_to_keep=T + 1)
    logits = out.logits[:, :-1, :].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
