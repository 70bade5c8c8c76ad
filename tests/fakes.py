"""Model-free stand-ins for unit tests of the algorithms and the sampling loop.

``ScriptedContext`` answers ``generate_group`` like :class:`~teamrl.workflows.context.EpisodeContext`
but with texts from a function instead of a model, so an algorithm's rewards, returns and
group keys can be checked in milliseconds. ``FixedLogitsModel`` + ``FakeTokenizer`` drive
:class:`~teamrl.rollout.hf_engine.HFEngine` with a known next-token distribution.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Callable, Hashable

import torch

from teamrl.core.sample import Sample
from teamrl.workflows.context import BaseContext


def _prompt_text(messages) -> str:
    return messages if isinstance(messages, str) else messages[-1]["content"]


class ScriptedContext(BaseContext):
    """An episode context whose j-th completion of a call is ``text(role, prompt, j)``."""

    def __init__(self, problem_id: Hashable, episode: int = 0, tags: dict | None = None,
                 text: Callable[[str, str, int], str] = lambda role, prompt, j: f"{role}-{j}") -> None:
        super().__init__(problem_id, episode, tags, params=None)
        self.text = text
        self.samples: list[Sample] = []
        self.scheduler = SimpleNamespace(holds=0)  # replayed branches hold a scheduler's flush; nothing to hold here

    async def _answer(self, call, branch) -> list[Sample]:
        return await self.sample(call.role, call.messages, call.n, call.turn, branch, call.params, call.tags)

    async def sample(self, role, messages, n, turn, branch, params, tags, tools=None) -> list[Sample]:
        prompt = _prompt_text(messages)
        out = [Sample(role=role, policy=role, problem_id=self.problem_id, prompt_ids=[1], completion_ids=[2],
                      sampling_logprobs=[0.0], text=self.text(role, prompt, j), episode=self.episode, turn=turn,
                      branch=branch + j, prompt_text=prompt, tags=dict(tags)) for j in range(n)]
        self.samples += out
        return out


def run_all(coros) -> list:
    """The scheduler's ``run``: every coroutine concurrently, results in order."""
    async def main():
        return await asyncio.gather(*coros)
    return asyncio.run(main())


def scripted_factory(text: Callable[[str, str, int], str] | None = None, contexts: list | None = None):
    """A ``make_ctx(problem, episode, tags)`` that builds :class:`ScriptedContext` s (collected in ``contexts``)."""
    def make(problem, episode, tags):
        ctx = ScriptedContext(problem.id, episode, tags, *([text] if text else []))
        if contexts is not None:
            contexts.append(ctx)
        return ctx
    return make


class FixedLogitsModel(torch.nn.Module):
    """A causal LM stand-in whose next-token logits are ``logits`` at every position."""

    def __init__(self, logits: list[float] | torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("fixed", torch.as_tensor(logits, dtype=torch.float32))

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                logits_to_keep=0, **_):
        B, L = input_ids.shape
        keep = L if not logits_to_keep else min(L, logits_to_keep)
        return SimpleNamespace(logits=self.fixed.expand(B, keep, -1).clone())


class FakeTokenizer:
    """Token ids decode to their numbers separated by spaces."""

    def __init__(self, eos_token_id: int | None = None, pad_token_id: int = 0) -> None:
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(int(i)) for i in ids)

    def batch_decode(self, rows, skip_special_tokens=True) -> list[str]:
        return [self.decode(r) for r in rows]
