"""The context a workflow acts through: ``await ctx.generate(role, messages)`` records a Sample."""

from __future__ import annotations

from typing import Callable, Hashable

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

    def __init__(self, scheduler: GenerationScheduler, route: Callable[[str], str], tokenizer: PreTrainedTokenizerBase,
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
        (sample,) = await self.generate_group(role, messages, n=1, turn=turn, branch=branch, params=params)
        return sample.text

    async def generate_group(self, role: str, messages: Messages | str, n: int, turn: int = 0, branch: int = 0,
                             params: SamplingParams | None = None, tags: dict | None = None) -> list[Sample]:
        """Sample ``n`` completions of one prompt for ``role`` (one prefill); return their Samples.

        The j-th sample gets ``branch = branch + j``; ``tags`` are added to the episode's tags.
        """
        p = params or self.params
        prompt_ids = encode_chat(self.tokenizer, messages)
        prompt_text = render_chat(self.tokenizer, messages)
        policy = self.route(role)
        completions = await self.scheduler.generate(policy, GenerationRequest(prompt_ids, p, n=n))
        out = [Sample(
            role=role, policy=policy, problem_id=self.problem_id, prompt_ids=prompt_ids,
            completion_ids=c.token_ids, sampling_logprobs=c.logprobs, text=c.text, finish_reason=c.finish_reason,
            episode=self.episode, turn=turn, branch=branch + j, temperature=p.temperature, prompt_text=prompt_text,
            tags={**self.tags, **(tags or {})},
        ) for j, c in enumerate(completions)]
        self.samples += out
        return out
