"""The generation engine interface.

An engine takes every pending request of one policy at once and returns completions with
token ids and the log-probs they were sampled with. The in-process Hugging Face engine
(:mod:`teamrl.rollout.hf_engine`) implements it; a vLLM or OpenAI-compatible server backend
implements the same two methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

FINISH_REASONS = ("eos", "stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those filters. Stop
    strings end a completion after the token that completes them; the text keeps the stop
    string. With ``ignore_eos`` generation runs to ``max_new_tokens`` (EOS may still be drawn and
    generation goes on past it); with ``min_new_tokens`` EOS cannot be drawn before that many
    tokens (its probability is 0 until then, as HF's ``min_new_tokens`` and vLLM's ``min_tokens``):
    ``min_new_tokens = max_new_tokens`` gives texts of exactly that length with no EOS in them
    (benchmarks against frameworks that force length that way). Log-probs are those of
    ``softmax(logits / temperature)`` with EOS not removed (the blocking is a sampling filter, like
    top-k/top-p, which the trainer's log-probs do not model either).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens}: must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 disables)")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))

    @classmethod
    def from_rollout(cls, rollout: Any, **changes: Any) -> SamplingParams:
        """The sampling settings of the ``rollout`` config section (:class:`~teamrl.core.config.RolloutConfig`): each
        field of this class read from the section's field of the same name, then ``changes`` (e.g. ``temperature=0``
        for greedy evaluation). The one place a config becomes sampling parameters."""
        given = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(cls)}
        given["stop"] = tuple(given["stop"])
        return cls(**{**given, **changes})


@dataclass
class GenerationRequest:
    """``n`` completions of one prompt (given as token ids)."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1


@dataclass
class Completion:
    """One sampled completion.

    ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under ``softmax(logits / temperature)``
    (before top-k/top-p filtering and with EOS in it while ``min_new_tokens`` blocks it), the distribution
    the trainer recomputes. For greedy
    requests it is the log-prob under temperature 1. Through a vLLM server (``HTTPEngine``,
    ``--logprobs-mode processed_logprobs``) it is vLLM's: after top-k/top-p, renormalised over the
    kept tokens (the same without them). The loss recomputes its own log-probs; it reads these only
    for the importance correction (``train.loss.importance_correction`` token or sequence), and the
    server checks compare them with the trainer's truncated distribution. ``token_ids`` include
    the EOS token when ``finish_reason == "eos"``; ``text`` is decoded without special tokens.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class Engine(ABC):
    """Generates for all pending requests of one policy in one call."""

    @abstractmethod
    def generate(
        self, policy: str, requests: Sequence[GenerationRequest], seed: int | None = None
    ) -> list[list[Completion]]:
        """Return, for each request, its ``n`` completions. Same seed and inputs, same outputs."""

    def generate_many(
        self, calls: Sequence[tuple[str, Sequence[GenerationRequest], int | None]]
    ) -> list[list[list[Completion]]]:
        """``generate(policy, requests, seed)`` for each ``(policy, requests, seed)`` of one scheduler flush.

        Each policy gets what its own ``generate`` call would return. This default runs the calls one
        after another; an engine that decodes policies sharing a base model in one batch overrides it.
        """
        return [self.generate(policy, requests, seed) for policy, requests, seed in calls]

    def sync_weights(self, policy: str) -> None:
        """Make the engine sample from ``policy``'s current weights (after an optimizer step).

        In-process engines share the training model and need nothing; a server backend
        pushes the new weights or adapter here.
        """
