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
    return token_logprobs(out.logits[:, :-1, :], batch.completion_ids, temperature, with_entropy)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of ``token_ids`` under ``softmax(logits / temperature)`` (and entropies)."""
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@dataclass
class SharedPrefixBatch:
    """Completions that share prompts: each distinct prompt is run once and its KV cache reused.

    GRPO-family batches hold G completions per prompt; computing the prompt once instead of G
    times is exact (gradients flow back through the shared cache) and saves (G - 1) prompt
    forwards and backwards per group.
    """

    prompt_ids: torch.Tensor        # [U, P] left-padded distinct prompts
    prompt_mask: torch.Tensor       # [U, P]
    prompt_index: torch.Tensor      # [B] which prompt each completion continues
    completion_ids: torch.Tensor    # [B, T] right-padded
    completion_pad_mask: torch.Tensor  # [B, T]

    @property
    def completion_len(self) -> int:
        return self.completion_ids.shape[1]


def build_shared_prefix_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int) -> SharedPrefixBatch:
    """Pack completions with their prompts deduplicated."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    unique: dict[tuple[int, ...], int] = {}
    index = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
    ups = list(unique)
    P = max(len(p) for p in ups)
    T = max(1, max(len(c) for c in completions))
    pids = torch.full((len(ups), P), pad_id, dtype=torch.long)
    pmask = torch.zeros((len(ups), P), dtype=torch.long)
    for i, p in enumerate(ups):
        pids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        pmask[i, P - len(p):] = 1
    cids = torch.full((len(completions), T), pad_id, dtype=torch.long)
    cmask = torch.zeros((len(completions), T), dtype=torch.bool)
    for i, c in enumerate(completions):
        cids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        cmask[i, :len(c)] = True
    return SharedPrefixBatch(pids, pmask, torch.tensor(index), cids, cmask)


def shared_prefix_logprobs(model: nn.Module, batch: SharedPrefixBatch, temperature: float = 1.0,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same result as :func:`completion_logprobs` on the unshared batch, with one prompt pass per distinct prompt."""
    from transformers import DynamicCache

    ppos = (batch.prompt_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, position_ids=ppos,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    idx = batch.prompt_index
    cache.reorder_cache(idx)  # index_select: differentiable, gradients of the G rows add up on the prompt
    first_logits = out.logits[:, -1:, :].index_select(0, idx)
    plen = batch.prompt_mask.sum(-1).index_select(0, idx)
    T = batch.completion_len
    cpos = plen.unsqueeze(1) + torch.arange(T, device=plen.device).unsqueeze(0)
    attn = torch.cat([batch.prompt_mask.index_select(0, idx), batch.completion_pad_mask.long()], dim=1)
    if T > 1:
        rest = model(input_ids=batch.completion_ids[:, :-1], attention_mask=attn[:, :-1], position_ids=cpos[:, :-1],
                     past_key_values=cache, use_cache=True).logits
        logits = torch.cat([first_logits, rest], dim=1)
    else:
        logits = first_logits
    return token_logprobs(logits, batch.completion_ids, temperature, with_entropy)
