"""The context a workflow acts through: the one episode protocol.

A workflow is ``async def run(ctx, task, problem, settings)``; it acts only through its context:

- ``await ctx.generate(role, messages, turn=None)`` samples one completion (recorded as a
  :class:`Sample`); ``generate_group(..., n)`` returns the ``n`` Samples of one prompt. ``turn``
  defaults to the role's call position (how many calls that role made before in this episode);
  every call also gets a global issue index (``Call.index``).
- ``ctx.reward(value, role=None)`` reports a reward now: ``role=None`` is a team reward, ``role=r``
  a reward of role r's latest call (its local reward).
- ``ctx.rng`` is a :class:`random.Random` seeded from (seed, problem id, episode).
- ``ctx.memo(key, compute)`` computes once per episode what its replay copies would recompute
  (a pure function of the texts so far, named by ``key``).
- ``ctx.sub_episode(role)`` opens a nested sub-episode whose samples are tagged with the parent
  episode and the call slot (M-GRPO's sub-agent calls); under grpo, magrpo and at_grpo, which
  cannot align them, opening one is refused in one line (``refuse_sub_episodes``).

The contract that makes branching by replay exact (:mod:`teamrl.workflows.episode`): given the
texts it receives, a workflow is deterministic (its randomness comes from ``ctx.rng`` only, and it
reads no clock or global state that changes between runs).
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from transformers import PreTrainedTokenizerBase

from teamrl.core.config import InputError
from teamrl.core.sample import Sample
from teamrl.core.seeding import derive_seed
from teamrl.policies.chat import Messages, render_chat
from teamrl.rollout.engine import GenerationRequest, SamplingParams
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.rollout.tool_calls import ToolAnswer, answer_with_tools


@dataclass
class Call:
    """One ``generate`` call of an episode: its issue index, who asked what, and its Samples once answered."""

    index: int
    role: str
    messages: Messages | str
    n: int
    turn: int
    params: SamplingParams
    tags: dict[str, Any]
    samples: list[Sample] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions shown to the model (the chat template's)


@dataclass
class RewardEvent:
    """A reward the workflow reported: ``role`` None is a team reward, else a local reward of that role."""

    value: float
    role: str | None


def problem_seed(problem_id: Hashable) -> int:
    """A stable integer for a problem id (Python's ``hash`` of a str changes between processes)."""
    return zlib.crc32(repr(problem_id).encode())


class BaseContext:
    """What every episode context shares: call positions, the event log, rewards, the RNG and sub-episodes.

    ``events`` holds the episode's calls (:class:`Call`, at issue) and rewards (:class:`RewardEvent`)
    in the order they happened; subclasses decide where a call's Samples come from (:meth:`_answer`).
    """

    def __init__(self, problem_id: Hashable, episode: int, tags: dict | None, params: SamplingParams,
                 seed: int = 0, workflow: str = "") -> None:
        self.problem_id = problem_id
        self.episode = episode
        self.tags = dict(tags or {})
        self.params = params
        self.seed = seed
        self.workflow = workflow  # its name, for error messages
        self.rng = random.Random(derive_seed(seed, problem_seed(problem_id), episode))
        self.events: list[Call | RewardEvent] = []
        # shared by an episode and its replay copies: results of pure functions of the texts so far (``memo``)
        self.cache: dict[Any, Any] = {}
        self._role_calls: dict[str, int] = {}
        self._sub_episodes = 0
        # the algorithm that cannot align sub-episodes (grpo, magrpo, at_grpo): ``sub_episode`` refuses, naming it
        self.refuse_sub_episodes: str | None = None

    @property
    def calls(self) -> list[Call]:
        """The episode's calls in issue order."""
        return [e for e in self.events if isinstance(e, Call)]

    @property
    def sub_episodes(self) -> int:
        """How many nested sub-episodes (``ctx.sub_episode``) this episode opened: its sub-agent calls."""
        return self._sub_episodes

    async def generate(self, role: str, messages: Messages | str, turn: int | None = None, branch: int = 0,
                       params: SamplingParams | None = None, tools: list[dict[str, Any]] | None = None,
                       tool_choice: Any = None, tool_parser: str = "hermes") -> str | ToolAnswer:
        """Sample one completion for ``role`` and return its text. With ``tools`` (OpenAI tool definitions, shown
        through the chat template or its fallback), a :class:`~teamrl.rollout.tool_calls.ToolAnswer`: the text,
        with ``tool_calls`` parsed by ``tool_parser`` as the gateway parses them (``tool_choice`` likewise)."""
        (sample,) = await self.generate_group(role, messages, n=1, turn=turn, branch=branch, params=params,
                                              tools=tools)
        return answer_with_tools(sample, tools, tool_choice, tool_parser) if tools else sample.text

    async def generate_group(
        self,
        role: str,
        messages: Messages | str,
        n: int,
        turn: int | None = None,
        branch: int = 0,
        params: SamplingParams | None = None,
        tags: dict | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[Sample]:
        """Sample ``n`` completions of one prompt for ``role`` (one prefill); return their Samples.

        The j-th sample gets ``branch = branch + j``; ``tags`` are added to the episode's tags.
        ``turn`` defaults to the role's call position in this episode; ``tools`` go to the chat template.
        """
        position = self._role_calls.get(role, 0)
        self._role_calls[role] = position + 1
        call = Call(len(self.calls), role, messages, n, position if turn is None else turn, params or self.params,
                    {**self.tags, **(tags or {})}, tools=tools)
        self.events.append(call)
        call.samples = await self._answer(call, branch)
        return call.samples

    async def _answer(self, call: Call, branch: int) -> list[Sample]:
        raise NotImplementedError

    def reward(self, value: Any, role: str | None = None) -> None:
        """Report a reward now: a team reward (``role`` None) or a local reward of ``role``'s latest call.

        Non-numbers are refused; NaN/inf pass through to the trainer (``train.nonfinite_reward``)."""
        who = "team" if role is None else f"role {role!r}"
        if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
            raise InputError(f"workflow {self.workflow or '?'!r}: ctx.reward for {who} got {value!r} "
                             f"({type(value).__name__}); expected a number (int or float)")
        if role is not None and role not in self._role_calls:
            raise InputError(
                f"workflow {self.workflow or '?'!r}: ctx.reward(role={role!r}) before any call of that role; "
                f"roles called so far: {sorted(self._role_calls)}"
            )
        self.events.append(RewardEvent(float(value), role))

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per episode and ``key`` (its replay copies reuse it): for work that is a pure
        function of the texts the episode received so far (an environment step), with those texts in ``key``."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def sub_episode(self, role_or_tags: str | dict) -> "SubEpisode":
        """A nested sub-episode: its calls are this episode's, tagged with ``parent_episode`` and ``call``
        (the sub-episode's slot: how many this episode opened before); a dict adds its own tags."""
        if self.refuse_sub_episodes:  # refused when opened, not at registration: a workflow may never open one
            raise InputError(
                f"workflow {self.workflow or '?'!r} opened a sub-episode (ctx.sub_episode({role_or_tags!r}), "
                f"problem {self.problem_id!r}), which algorithm {self.refuse_sub_episodes} cannot align: use "
                "algorithm=m_grpo (the workflow registered with sub_roles=...), or do not call ctx.sub_episode"
            )
        extra = role_or_tags if isinstance(role_or_tags, dict) else {"sub_role": role_or_tags}
        slot = self._sub_episodes
        self._sub_episodes += 1
        return SubEpisode(self, {**extra, "parent_episode": self.episode, "call": slot})


class SubEpisode:
    """A view of an episode for one nested sub-episode: its own call positions, its tags on every sample."""

    def __init__(self, parent: BaseContext, tags: dict[str, Any]) -> None:
        self.parent = parent
        self.tags = tags
        self.rng = parent.rng
        self.episode = parent.episode
        self.problem_id = parent.problem_id
        self._role_calls: dict[str, int] = {}

    async def generate(self, role: str, messages: Messages | str, turn: int | None = None, branch: int = 0,
                       params: SamplingParams | None = None, tools: list[dict[str, Any]] | None = None,
                       tool_choice: Any = None, tool_parser: str = "hermes") -> str | ToolAnswer:
        """As :meth:`BaseContext.generate`, inside the sub-episode."""
        (sample,) = await self.generate_group(role, messages, n=1, turn=turn, branch=branch, params=params,
                                              tools=tools)
        return answer_with_tools(sample, tools, tool_choice, tool_parser) if tools else sample.text

    async def generate_group(
        self,
        role: str,
        messages: Messages | str,
        n: int,
        turn: int | None = None,
        branch: int = 0,
        params: SamplingParams | None = None,
        tags: dict | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[Sample]:
        """As :meth:`BaseContext.generate_group`; ``turn`` defaults to the call position in the sub-episode."""
        position = self._role_calls.get(role, 0)
        self._role_calls[role] = position + 1
        return await self.parent.generate_group(
            role,
            messages,
            n,
            turn=position if turn is None else turn,
            branch=branch,
            params=params,
            tags={**self.tags, **(tags or {})},
            tools=tools,
        )

    def reward(self, value: Any, role: str | None = None) -> None:
        """As :meth:`BaseContext.reward` (the rewards are the episode's)."""
        self.parent.reward(value, role)

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """As :meth:`BaseContext.memo` (the cache is the episode's)."""
        return self.parent.memo(key, compute)


class EpisodeContext(BaseContext):
    """One episode's view of the framework (the recording context).

    Each ``generate`` call is routed to the role's policy, joins the batch of everything else
    in flight, and is recorded in ``samples`` with its ids, log-probs and tags.
    """

    def __init__(self, scheduler: GenerationScheduler, route: Callable[[str], str], tokenizer: PreTrainedTokenizerBase,
                 params: SamplingParams, problem_id: Hashable, episode: int, tags: dict | None = None,
                 seed: int = 0, workflow: str = "") -> None:
        super().__init__(problem_id, episode, tags, params, seed=seed, workflow=workflow)
        self.scheduler = scheduler
        self.route = route  # role -> policy name
        self.tokenizer = tokenizer
        self.samples: list[Sample] = []

    async def _answer(self, call: Call, branch: int) -> list[Sample]:
        return await self.sample(call.role, call.messages, call.n, call.turn, branch, call.params, call.tags,
                                 tools=call.tools)

    def render(self, messages: Messages | str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids) of a call: ``messages`` through the policy's chat template."""
        prompt_text = render_chat(self.tokenizer, messages, tools)
        return prompt_text, self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]

    async def sample(self, role: str, messages: Messages | str, n: int, turn: int, branch: int,
                     params: SamplingParams, tags: dict[str, Any],
                     tools: list[dict[str, Any]] | None = None) -> list[Sample]:
        """Generate and record ``n`` Samples (no call is logged: samplers use this to answer a branch's calls);
        ``tools``: the call's tool definitions, for the chat template."""
        try:
            policy = self.route(role)
        except KeyError as e:  # a role the workflow did not declare (nor a numbered instance of one)
            raise InputError(
                f"workflow {self.workflow or '?'!r}, problem {self.problem_id!r}: ctx.generate({role!r}, ...): "
                f"{e.args[0] if e.args else e}; declare it in register_workflow(name, roles=(...)) or "
                "call a declared role"
            ) from None
        prompt_text, prompt_ids = self.render(messages, tools)
        completions = await self.scheduler.generate(policy, GenerationRequest(prompt_ids, params, n=n))
        out = [Sample(
            role=role, policy=policy, problem_id=self.problem_id, prompt_ids=prompt_ids,
            completion_ids=c.token_ids, sampling_logprobs=c.logprobs, text=c.text, finish_reason=c.finish_reason,
            episode=self.episode, turn=turn, branch=branch + j, temperature=params.temperature, prompt_text=prompt_text,
            tags=dict(tags),
        ) for j, c in enumerate(completions)]
        self.samples += out
        return out


def total(values: list[float]) -> float:
    """The exactly rounded sum of ``values`` (a plain sum when one is NaN/inf: it stays non-finite for the trainer)."""
    return math.fsum(values) if all(math.isfinite(v) for v in values) else sum(values)


def team_rewards(events: list[Call | RewardEvent]) -> float:
    """The sum of the team rewards among ``events``."""
    return total([e.value for e in events if isinstance(e, RewardEvent) and e.role is None])


def own_rewards(events: list[Call | RewardEvent]) -> dict[int, float]:
    """Call index -> the rewards its role reported after it and before that role's next call (calls with none:
    absent)."""
    latest: dict[str, int] = {}
    out: dict[int, list[float]] = {}
    for e in events:
        if isinstance(e, Call):
            latest[e.role] = e.index
        elif e.role is not None and e.role in latest:
            out.setdefault(latest[e.role], []).append(e.value)
    return {i: total(v) for i, v in out.items()}
