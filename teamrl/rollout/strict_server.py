"""``teamrl serve --strict vllm|sglang``: behave like the real servers where they differ from teamrl's.

The default ``teamrl serve`` is teamrl's own engine behind vLLM's wire format (one random
stream per batch, teamrl's log-probs, a 400 for unknown fields). A real vLLM or SGLang server
differs in ways that silently break RL training, so the HTTP engine is tested against this
imitation of them. Each behaviour below was read in the servers' released source (vLLM 0.33.0,
SGLang 0.5.23); none was checked against a running server (none runs on these machines).

vLLM 0.33.0 (``flavor="vllm"``):

- **Seeding.** Every prompt of a request gets the request's ``seed``; with ``n > 1`` sample
  ``j`` gets ``seed + j`` (``ParentRequest._get_child_sampling_params``). A seeded sequence draws
  its noise from its own generator, so its noise depends only on the seed and the position:
  identical prompts with one seed give identical completions. Without a seed every sequence
  draws from the global generator.
- **Sampling defaults from ``generation_config.json``** (``--generation-config auto``): a request
  that leaves ``repetition_penalty``, ``temperature``, ``top_p``, ``top_k``, ``min_p`` (or
  ``max_tokens``) unset gets the model's value.
- **Log-probs** are the raw model's (``--logprobs-mode raw_logprobs``, before penalties and
  temperature) unless the server runs with ``processed_logprobs`` (after penalties, temperature,
  min-p, top-k and top-p).
- Unknown request fields are ignored; greedy (``temperature`` 0) with ``n > 1`` is a 400; at most
  4 stop strings and 1024 prompts per request; ``max_tokens`` is cut to fit ``max_model_len``;
  generation also stops at the EOS ids of ``generation_config`` (``stop_reason`` = that id).
- LoRA: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` answer in plain text; a second
  load of one name is a 400; ``GET /v1/models`` lists adapters with ``parent`` and
  ``max_model_len``, ``owned_by: "vllm"``.

SGLang 0.5.23 (``flavor="sglang"``): the same sampler, except that LoRA load/unload live at
``/load_lora_adapter`` and ``/unload_lora_adapter`` (no ``/v1``); a request picks an adapter by
``model: "base:adapter"`` (or ``lora_path``), and any other unknown model name silently samples
from the base; ``return_tokens_as_token_ids`` and ``include_stop_str_in_output`` are ignored (the
text never keeps a stop string); the stop is reported as ``matched_stop`` (the EOS id or the
stop string); every copy of an ``n > 1`` request gets the same seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

FLAVORS = ("vllm", "sglang")
# The generation_config keys vLLM reads as request defaults, and the request field each one fills.
GENERATION_DEFAULT_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_p": "top_p",
                             "top_k": "top_k", "min_p": "min_p", "presence_penalty": "presence_penalty",
                             "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class StrictBehaviour:
    """What a strict server imitates; the defaults are vLLM 0.33.0's."""

    flavor: str = "vllm"
    logprobs_mode: str = "raw_logprobs"
    max_stop_strings: int | None = 4
    max_prompts: int = 1024
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    extra_eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"strict flavor {self.flavor!r}: choose one of {list(FLAVORS)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {self.logprobs_mode!r}: choose one of {list(LOGPROBS_MODES)}")
        unknown = [k for k in self.generation_defaults if k not in GENERATION_DEFAULT_FIELDS]
        if unknown:
            raise ValueError(
                f"generation config key {unknown[0]!r}: the server reads only {list(GENERATION_DEFAULT_FIELDS)}"
            )


def generation_defaults(model: torch.nn.Module) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(request defaults, EOS ids) that vLLM takes from the model's ``generation_config``.

    Only values the config sets away from transformers' defaults count (vLLM reads the diff).
    """
    cfg = getattr(model, "generation_config", None)
    if cfg is None:
        return {}, ()
    diff = cfg.to_diff_dict()
    defaults = {k: diff[k] for k in GENERATION_DEFAULT_FIELDS if diff.get(k) is not None}
    eos = cfg.eos_token_id
    return defaults, tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)


@dataclass
class RowSamplingParams:
    """One sequence's sampling parameters after the server applied its defaults."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # <= 0: off
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop: tuple[str, ...]
    ignore_eos: bool


@dataclass
class RowOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish: str  # "length" or "stop"
    stop_reason: int | str | None  # None: the tokenizer's EOS; int: another stop id; str: a stop string


def decode_row(model: torch.nn.Module, tokenizer: Any, prompt: Sequence[int], s: RowSamplingParams, seed: int | None,
               eos_ids: Sequence[int], logprobs_mode: str) -> RowOutput:
    """Generate one sequence the way vLLM's sampler does, with this sequence's own generator.

    The noise of step ``t`` is the ``t``-th exponential draw of a generator seeded with ``seed``
    (a random seed when None), so two sequences with one seed share their noise.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed if seed is not None else random.getrandbits(63))
    dev = next(model.parameters()).device
    past = None
    ids = torch.tensor([list(prompt)], device=dev)
    out_ids: list[int] = []
    logps: list[float] = []
    prompt_set = torch.tensor(sorted(set(prompt)), dtype=torch.long)
    for _ in range(s.max_tokens):
        with torch.inference_mode():
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float().cpu()
        raw = torch.log_softmax(logits, -1)
        logits = _penalised(logits, prompt_set, out_ids, s)
        if s.temperature < 1e-5:
            processed = torch.log_softmax(logits, -1)
            tok = int(logits.argmax())
        else:
            logits = logits / s.temperature
            if s.min_p > 0:
                probs = torch.softmax(logits, -1)
                logits = logits.masked_fill(probs < s.min_p * probs.max(), float("-inf"))
            logits = _top_k_top_p(logits, s.top_k, s.top_p)
            processed = torch.log_softmax(logits, -1)
            noise = torch.empty_like(processed).exponential_(generator=gen)
            tok = int((processed.exp() / noise).argmax())
        out_ids.append(tok)
        logps.append(float((raw if logprobs_mode == "raw_logprobs" else processed)[tok]))
        if not s.ignore_eos and tok in eos_ids:
            return RowOutput(out_ids, logps, "stop", None if tok == tokenizer.eos_token_id else tok)
        if s.stop:
            text = tokenizer.decode(out_ids, skip_special_tokens=True)
            hit = next((x for x in s.stop if x in text), None)
            if hit is not None:
                return RowOutput(out_ids, logps, "stop", hit)
        ids = torch.tensor([[tok]], device=dev)
    return RowOutput(out_ids, logps, "length", None)


def _penalised(
    logits: torch.Tensor, prompt_set: torch.Tensor, out_ids: list[int], s: RowSamplingParams
) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties."""
    if s.repetition_penalty == 1 and s.presence_penalty == 0 and s.frequency_penalty == 0:
        return logits
    logits = logits.clone()
    counts = torch.bincount(torch.tensor(out_ids, dtype=torch.long), minlength=logits.shape[0]).float() if out_ids \
        else torch.zeros_like(logits)
    if s.repetition_penalty != 1:
        seen = counts > 0
        seen[prompt_set] = True
        logits = torch.where(
            seen, torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty), logits
        )
    return logits - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()


def _top_k_top_p(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Mask all but the top ``k`` and the smallest set of mass ``p`` (the token crossing it stays)."""
    V = logits.shape[0]
    if (k <= 0 or k >= V) and p >= 1:
        return logits
    order = logits.argsort(descending=True)
    drop = torch.zeros(V, dtype=torch.bool)
    if 0 < k < V:
        drop[order[k:]] = True
    if p < 1:
        probs = torch.softmax(logits.masked_fill(drop, float("-inf")), -1)[order]
        before = probs.cumsum(0) - probs
        drop[order[before >= p]] = True
    return logits.masked_fill(drop, float("-inf"))
