"""Per-token log-probs of completion tokens, computing logits only where they are needed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from teamrl.core.memory import trim_freed_memory


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


def build_token_batch(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> TokenBatch:
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


def to_device(batch: Any, dev: torch.device) -> Any:
    """The same batch dataclass (:class:`TokenBatch`, :class:`SharedPrefixBatch`) with every tensor field on ``dev``."""
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(dev) for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


def completion_logprobs(model: nn.Module, batch: TokenBatch, temperature: Temperature = 1.0,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of the completion tokens under ``softmax(logits / temperature)``.

    Values at padding positions are finite but meaningless: mask them. With
    ``with_entropy`` also returns the per-token entropy [B, T] of the same distribution.
    """
    T = batch.completion_len
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False, logits_to_keep=T + 1)
    return token_logprobs(out.logits[:, :-1, :], batch.completion_ids, temperature, with_entropy)


# One sampling temperature for every row, or one per row (a float tensor [B]); 0 (greedy) means 1.
Temperature = float | torch.Tensor


def scale_by_temperature(logits: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    """``logits`` [B, ...] divided by the temperature (each row by its own when it is a tensor [B]); 0 and 1 leave a
    row as it is (dividing by 1 is exact, so rows at 1 are bit for bit those of an unscaled batch)."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=logits.device, dtype=logits.dtype)
        t = torch.where(t == 0, torch.ones_like(t), t)
        if bool((t == 1).all()):
            return logits
        return logits / t.view(-1, *([1] * (logits.dim() - 1)))
    return logits / temperature if temperature not in (0.0, 1.0) else logits


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: Temperature = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of ``token_ids`` under ``softmax(logits / temperature)`` (and entropies); ``temperature``
    is one for every row or a tensor [B] of each row's own."""
    logits = scale_by_temperature(logits.float(), temperature)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def truncated_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, top_k: int = 0,
                             top_p: float = 1.0) -> torch.Tensor:
    """Log-probs [..., T] of ``token_ids`` under the distribution a server samples from with top-k/top-p: ``logits /
    temperature`` cut to the top ``top_k`` (ties with the k-th kept) and then to the smallest top set whose mass
    reaches ``top_p`` (on the top-k-renormalised distribution), renormalised over what is left.

    That is vLLM's ``--logprobs-mode processed_logprobs`` (its ``apply_top_k_top_p``: masks ``logits < k-th
    largest``, then, in ascending order, every token whose cumulative probability is ``<= 1 - top_p`` but the
    largest); a token outside the set gets ``-inf``. ``temperature`` 0 means 1 (greedy requests).
    """
    x = logits.float()
    if temperature not in (0.0, 1.0):
        x = x / temperature
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1:
        ascending, order = x.sort(dim=-1)
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False
        x = x.scatter(-1, order, ascending.masked_fill(drop, float("-inf")))
    return torch.log_softmax(x, -1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


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


def build_shared_prefix_batch(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> SharedPrefixBatch:
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


def _prompt_pass(model: nn.Module, batch: SharedPrefixBatch):
    """Each distinct prompt once: its keys/values (a ``DynamicCache``) and the logits at its last position [U, 1, V]."""
    from transformers import DynamicCache

    ppos = (batch.prompt_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, position_ids=ppos,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1:, :]


def _completion_logits(
    model: nn.Module, batch: SharedPrefixBatch, rows: torch.Tensor, cache, first_logits: torch.Tensor
) -> torch.Tensor:
    """Logits [len(rows), T, V] predicting completion ``rows``' tokens, continuing ``cache`` (already one row per
    completion in ``rows``); ``first_logits``: the prompts' last-position logits, one row per distinct prompt."""
    idx = batch.prompt_index.index_select(0, rows)
    first = first_logits.index_select(0, idx)
    plen = batch.prompt_mask.sum(-1).index_select(0, idx)
    T = batch.completion_len
    if T == 1:
        return first
    cids = batch.completion_ids.index_select(0, rows)
    cpos = plen.unsqueeze(1) + torch.arange(T, device=plen.device).unsqueeze(0)
    attn = torch.cat(
        [batch.prompt_mask.index_select(0, idx), batch.completion_pad_mask.index_select(0, rows).long()], dim=1
    )
    rest = model(input_ids=cids[:, :-1], attention_mask=attn[:, :-1], position_ids=cpos[:, :-1],
                 past_key_values=cache, use_cache=True).logits
    return torch.cat([first, rest], dim=1)


def shared_prefix_logprobs(model: nn.Module, batch: SharedPrefixBatch, temperature: Temperature = 1.0,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same result as :func:`completion_logprobs` on the unshared batch, with one prompt pass per distinct prompt."""
    cache, last = _prompt_pass(model, batch)
    # index_select: differentiable, gradients of the G rows add up on the prompt
    cache.reorder_cache(batch.prompt_index)
    rows = torch.arange(batch.completion_ids.shape[0], device=batch.prompt_index.device)
    return token_logprobs(
        _completion_logits(model, batch, rows, cache, last), batch.completion_ids, temperature, with_entropy
    )


def shared_prefix_backward(model: nn.Module, batch: SharedPrefixBatch, rows_per_pass: int,
                           loss_of: Callable[[slice, torch.Tensor, torch.Tensor | None], torch.Tensor],
                           temperature: Temperature = 1.0, with_entropy: bool = False) -> None:
    """Backpropagate the sum of ``loss_of(rows, logprobs, entropy)`` over passes of at most ``rows_per_pass``
    completions (``rows``: a slice of the batch's completions), running each distinct prompt once.

    The gradient is that of one backward through :func:`shared_prefix_logprobs` of the whole batch,
    but only one pass's completion activations are alive at a time: the prompts' keys/values and
    last-position logits are cut from the graph as leaves, every pass adds its gradient to them,
    and one backward through the prompt pass at the end carries the sum into the weights.
    Between passes the memory the previous one freed goes back to the operating system
    (:func:`~teamrl.core.memory.trim_freed_memory`; the caller trims before the first): held in
    the heap, it added ~300 MB to the demo's peak RSS.
    """
    from transformers import DynamicCache

    cache, last = _prompt_pass(model, batch)
    kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    kv_leaves = [t.detach().requires_grad_() for t in kv]
    last_leaf = last.detach().requires_grad_()
    B = batch.completion_ids.shape[0]
    dev = batch.prompt_index.device
    for start in range(0, B, rows_per_pass):
        if start:
            trim_freed_memory()
        rows = slice(start, min(B, start + rows_per_pass))
        index = torch.arange(rows.start, rows.stop, device=dev)
        idx = batch.prompt_index.index_select(0, index)
        pass_cache = DynamicCache(
            [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in zip(kv_leaves[::2], kv_leaves[1::2])]
        )
        logits = _completion_logits(model, batch, index, pass_cache, last_leaf)
        rows_t = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        logp, ent = token_logprobs(logits, batch.completion_ids[rows], rows_t, with_entropy)
        loss_of(rows, logp, ent).backward()
    outputs = [(t, leaf.grad) for t, leaf in zip(kv + [last], kv_leaves + [last_leaf]) if leaf.grad is not None]
    if outputs:
        torch.autograd.backward([t for t, _ in outputs], [g for _, g in outputs])
