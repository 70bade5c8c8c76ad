"""The context a workflow acts through: ``await ctx.generate(role, messages)`` records a Sample."""

from __future__ import annotations

from typing import Hashable

from transformers import PreTrainedTokenizerBase

from teamrl.core.sample import Sample
from teamrl.policies.chat import Messages, encode_chat, render_chat
from teamrl.rollout.engine import GenerationRequest, SamplingParams
from teamrl.rollout.scheduler import GenerationScheduler


class EpisodeContext:
    """One episode's view of the framework.

    Each ``generate`` call is routed to the role's policy, joins the batch of everything else
    in flight, and is recorded in ``samples`` with its ids, log-probs and tags.
    """

    def __init__(self, scheduler: GenerationScheduler, route: "callable", tokenizer: PreTrainedTokenizerBase,
                 params: SamplingParams, problem_id: Hashable, episode: int, tags: dict | None = None) -> None:
        self.scheduler = scheduler
        self.route = route  # role -> policy name
        self.tokenizer = tokenizer
        self.params = params
        self.problem_id = problem_id
        self.episode = episode
        self.tags = dict(tags or {})
        self.samples: list[Sample] = []

    async def generate(self, role: str, messages: Messages | str, turn: int = 0, branch: int = 0,
                       params: SamplingParams | None = None) -> str:
        """Sample one completion for ``role`` and return its text."""
        p = params or self.params
        prompt_ids = encode_chat(self.tokenizer, messages)
        policy = self.route(role)
        (completion,) = await self.scheduler.generate(policy, GenerationRequest(prompt_ids, p, n=1))
        self.samples.append(Sample(
            role=role, policy=policy, problem_id=self.problem_id, prompt_ids=prompt_ids,
            completion_ids=completion.token_ids, sampling_logprobs=completion.logprobs, text=completion.text,
            finish_reason=completion.finish_reason, episode=self.episode, turn=turn, branch=branch,
            temperature=p.temperature, prompt_text=render_chat(self.tokenizer, messages), tags=dict(self.tags),
        ))
        return completion.text
