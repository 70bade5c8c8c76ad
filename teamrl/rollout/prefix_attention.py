"""Decode attention over a prompt shared by several sampled rows, read once per prompt.

A group-relative rollout samples G completions of each prompt. Copying the prompt's keys and
values to each of the G rows makes every decode step read G copies of them: with ~500-token
prompts that read was a third or more of a decode step on CPU (memory-bound, like a
matrix-vector product per row). Here the prompt's keys/values stay once per distinct prompt;
the rows of one prompt are attended to it together (their queries side by side, one matrix
product per prompt), the generated tokens per row, and the two softmax parts are combined
exactly through their maxima and sums (the split-softmax identity of flash attention).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION_NAME = "teamrl_shared_prompt"
# Model types whose attention calls the registered attention function with plain (q, k, v) and a scaling
# (no sliding window, soft-capping or attention sinks): the shared-prompt decode is exact for them.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


@dataclass
class SharedPrompts:
    """The prompts' keys/values (one row per distinct prompt) and where each live decode row reads them.

    ``keys[layer]`` / ``values[layer]``: [U, kv_heads, P, head_dim], left-padded; ``valid``: [U, P]
    True on real prompt tokens; ``slot_index``: [rows] ``prompt * max_rows + slot`` of each live
    row (the slot is the row's place among its prompt's rows); ``max_rows``: the most rows of one prompt.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    slot_index: torch.Tensor
    max_rows: int


def supports_shared_prompts(model: torch.nn.Module) -> bool:
    """Whether ``model``'s decode can read shared prompt keys/values (:func:`shared_prompt_attention`)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager", ATTENTION_NAME):
        return False
    window = getattr(cfg, "sliding_window", None)
    return window is None or not getattr(cfg, "use_sliding_window", True)


def shared_prompt_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            shared_prompts: SharedPrompts | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one new token per row over its prompt (shared) and its own generated tokens (``key``/``value``).

    Without ``shared_prompts`` this is SDPA (the prefill, and any other call). ``attention_mask``
    is not used on the shared path: rows are live sequences whose generated tokens are all
    visible, and the prompt padding is ``shared_prompts.valid``.
    """
    if shared_prompts is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[2] != 1:
        raise ValueError(f"shared-prompt attention decodes one token per row; got {query.shape[2]} query positions")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("shared-prompt attention supports plain causal attention only (no sliding window or softcap)")
    rows, q_heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    p_keys, p_values = shared_prompts.keys[module.layer_idx], shared_prompts.values[module.layer_idx]
    prompts, _, plen, _ = p_keys.shape
    n = shared_prompts.max_rows
    q = query.reshape(rows, kv_heads, group, dim)  # query head h reads kv head h // group (repeat_kv's order)

    # Prompt part: each prompt's rows side by side as query positions, one matrix product per prompt and kv head.
    q_slots = q.new_zeros((prompts * n, kv_heads, group, dim)).index_copy_(0, shared_prompts.slot_index, q)
    q_slots = (
        q_slots.view(prompts, n, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(prompts, kv_heads, n * group, dim)
    )
    s1 = torch.matmul(q_slots, p_keys.transpose(-1, -2)) * scale  # [U, kv, n*g, P]
    s1 = s1.masked_fill(~shared_prompts.valid[:, None, None, :], float("-inf"))
    m1 = s1.amax(-1, keepdim=True)
    e1 = (s1 - m1).exp_()
    l1 = e1.sum(-1, keepdim=True)
    o1 = torch.matmul(e1, p_values)  # [U, kv, n*g, D]

    def to_rows(t: torch.Tensor) -> torch.Tensor:
        t = (
            t.view(prompts, kv_heads, n, group, t.shape[-1])
            .permute(0, 2, 1, 3, 4)
            .reshape(prompts * n, kv_heads, group, t.shape[-1])
        )
        return t.index_select(0, shared_prompts.slot_index)

    m1, l1, o1 = to_rows(m1), to_rows(l1), to_rows(o1)
    # Generated part: each row's own tokens (all visible).
    s2 = torch.matmul(q, key.transpose(-1, -2)) * scale  # [R, kv, g, S]
    m2 = s2.amax(-1, keepdim=True)
    e2 = (s2 - m2).exp_()
    l2 = e2.sum(-1, keepdim=True)
    o2 = torch.matmul(e2, value)
    m = torch.maximum(m1, m2)
    w1, w2 = (m1 - m).exp_(), (m2 - m).exp_()
    out = (o1 * w1 + o2 * w2) / (l1 * w1 + l2 * w2)
    return out.reshape(rows, 1, q_heads, dim), None  # [batch, q_len, heads, head_dim], as SDPA returns it


AttentionInterface.register(ATTENTION_NAME, shared_prompt_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


@contextlib.contextmanager
def shared_prompt_decoding(model: torch.nn.Module) -> Iterator[None]:
    """Inside: ``model``'s attention is :func:`shared_prompt_attention` (SDPA unless a call passes
    ``shared_prompts``)."""
    cfg = model.config
    before = cfg._attn_implementation
    cfg._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        cfg._attn_implementation = before
