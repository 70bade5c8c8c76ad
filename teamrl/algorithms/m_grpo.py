"""M-GRPO (Hong et al., 2025): a main agent with a tool-using sub-agent, trained with group-relative advantages.

It runs over the episode protocol: the default workflow is ``research`` (the research team of
:mod:`teamrl.workflows.research_team`), or any registered workflow that declares sub-episode
roles and opens them with ``ctx.sub_episode``: the samples a sub-episode generates carry its
parent's ids (``parent_episode``, ``call``: its slot) and are the sub-agent's; a rollout's main
reward is its team return; a sub-call's format validity comes from ``outcome.stats["calls"]``
where the workflow reports it (else valid).

The three places where algorithms differ:
1. sampling: K (``rollout.group_size``) rollouts of :func:`~teamrl.workflows.research_team.research_team`
   per question; each may call the sub-agent 0..``max_sub_calls`` times, and each call is a
   multi-turn sub-trajectory (its samples are tagged with ``parent_episode`` and ``call``).
2. group keys: main samples ``(question,)`` (GRPO over the K rollouts); sub samples
   ``(question, "sub")``: pooled over the question's K rollouts *after trajectory alignment*.
   The group's members are rollouts and aligned sub-trajectories, not turns: every sample is
   tagged with its ``trajectory`` (main: its rollout; sub: its rollout and slot), and the group
   mean and std are taken with each trajectory once, whatever its number of turns
   (:func:`~teamrl.losses.advantages.trajectory_advantages`); each turn gets its trajectory's
   advantage.
3. reward assignment: a main sample gets its rollout's main reward (correct / wrong / invalid,
   see :mod:`teamrl.tasks.research`); a sub-trajectory gets
   :func:`~teamrl.tasks.research.sub_reward` of its parent rollout's main reward and its own
   format validity (``m_grpo.sub_reward``), so the outcome flows down through the parent ids.

Trajectory alignment (:func:`align_subtrajectories`): the number of sub-agent calls varies per
rollout, so every rollout is given exactly ``d_max`` sub-trajectory slots. A rollout with more
calls keeps a random ``d_max`` of them (the rest are dropped: logged, not trained); one with
fewer keeps all and fills the remaining slots with random duplicates of its own; one with no
calls fills its slots with random duplicates of the question's other kept sub-trajectories. So
every question gives exactly ``K * d_max`` sub-trajectories (none when no rollout of the
question called the sub-agent at all: there is nothing to learn from).

How duplicates count in the loss: **each duplicate is a full sample** (a copy of every turn of
the sub-trajectory with the same reward), in the group statistics (a trajectory of its own)
and in the token loss alike, so every rollout contributes exactly ``d_max`` sub-trajectories,
the paper's fixed batch. A sub-trajectory duplicated once thus weighs twice. Copies carry ``tags["duplicate"] = True``.

Baselines: ``m_grpo.sub_agent: frozen`` trains the main agent only (sub samples are tagged
``no_update``); ``m_grpo.agents: single`` is single-agent GRPO where one agent has the tools.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable, Sequence

from teamrl.algorithms.base import Algorithm, FinishedEpisode, warn_once
from teamrl.algorithms.episodes import ContextFactory, bind, workflow_options_or_defaults
from teamrl.core.config import option, register_moved_key, register_section
from teamrl.core.sample import Sample
from teamrl.core.seeding import derive_seed
from teamrl.tasks.research import SUB_REWARD_MODES, sub_reward
from teamrl.tasks.task import Problem, batch_instances
from teamrl.workflows import WORKFLOWS, EpisodeOutcome
from teamrl.workflows.episode import EpisodeFn, EpisodeResult, run_episode
from teamrl.workflows.research_team import SubCall, as_episode_outcome, research_single, research_team

SUB_AGENT_MODES = ("trained", "frozen")
AGENT_MODES = ("team", "single")
Slot = tuple[int, int]  # (rollout index, call index) of the sub-trajectory a slot holds


def is_sub_sample(sample: Sample) -> bool:
    """Whether a sample was generated in a nested sub-episode (``ctx.sub_episode`` tags it with its parent)."""
    return "parent_episode" in sample.tags or sample.role == "sub"


def group_key(sample: Sample) -> Hashable:
    """Main: the question (GRPO over its K rollouts); sub: the question's pooled, aligned sub-trajectories."""
    if is_sub_sample(sample):
        return (sample.problem_id, "sub")
    return (sample.problem_id,)


def sub_calls(result: EpisodeResult) -> list[SubCall] | None:
    """The sub-agent calls a research episode reported (``stats["calls"]``), None for a workflow that reports none."""
    return result.outcome.stats.get("calls") if result.outcome is not None else None


def correct(result: EpisodeResult) -> bool:
    """Whether an episode's final answer was right (False when it returned no outcome)."""
    return bool(result.outcome.correct) if result.outcome is not None else False


def align_subtrajectories(counts: Sequence[int], d_max: int, rng: random.Random) -> list[list[Slot]]:
    """Which sub-trajectory fills each of the ``d_max`` slots of each rollout of one question.

    ``counts[i]`` is the number of sub-agent calls of rollout i. More than ``d_max``: a random
    ``d_max`` of them, in call order; fewer: all, then random duplicates of its own; none: random
    draws from the other rollouts' kept sub-trajectories. Returns ``len(counts)`` lists of exactly
    ``d_max`` ``(rollout, call)`` slots, or empty lists when no rollout made a call. A slot that
    repeats an earlier one is a duplicate; a ``(rollout, call)`` that appears nowhere was dropped.
    """
    if d_max < 1:
        raise ValueError(f"d_max={d_max}: must be >= 1")
    if any(c < 0 for c in counts):
        raise ValueError(f"counts={list(counts)}: call counts must be >= 0")
    if not any(counts):
        return [[] for _ in counts]
    slots: list[list[Slot]] = []
    for i, n in enumerate(counts):
        if n >= d_max:
            keep = sorted(rng.sample(range(n), d_max))
        elif n > 0:
            keep = list(range(n)) + rng.choices(range(n), k=d_max - n)
        else:
            keep = []
        slots.append([(i, c) for c in keep])
    pool = sorted({s for row in slots for s in row})
    for i, n in enumerate(counts):
        if n == 0:
            slots[i] = rng.choices(pool, k=d_max)
    return slots


def prepare_sub_samples(sub: Sequence[Sample], outcomes: dict[tuple[Hashable, int], float], d_max: int, mode: str,
                        seed: int, frozen: bool = False) -> list[Sample]:
    """Sub-agent rewards, alignment and groups: the sub-agent's half of M-GRPO's reward assignment.

    ``outcomes`` maps every rollout ``(problem_id, episode)`` to its main reward (rollouts
    without calls included: they get slots too). Returns the aligned samples (duplicates as
    copies tagged ``duplicate``) followed by the dropped ones (tagged ``dropped`` and
    ``no_update``); with ``frozen`` every returned sample is tagged ``no_update``. A pure
    function of its inputs: the decoupled sub-agent worker calls it with what the store gave it.
    """
    if mode not in SUB_REWARD_MODES:
        raise ValueError(f"m_grpo.sub_reward {mode!r}: choose one of {list(SUB_REWARD_MODES)}")
    rng = random.Random(seed)
    trajs: dict[tuple[Hashable, int, int], list[Sample]] = defaultdict(list)
    for s in sub:
        trajs[(s.problem_id, s.tags["parent_episode"], s.tags["call"])].append(s)
    orphans = sorted({k[:2] for k in trajs} - set(outcomes), key=repr)
    if orphans:
        raise ValueError(
            f"sub-agent samples of rollout(s) {orphans[:3]} have no main outcome; outcomes has {len(outcomes)} rollouts"
        )
    episodes: dict[Hashable, list[int]] = defaultdict(list)
    for pid, ep in outcomes:
        episodes[pid].append(ep)
    calls: dict[tuple[Hashable, int], list[int]] = defaultdict(list)  # (problem, episode) -> its call ids, in order
    for pid, ep, c in trajs:
        calls[(pid, ep)].append(c)
    for ids in calls.values():
        ids.sort()
    out: list[Sample] = []
    used: set[tuple[Hashable, int, int]] = set()
    for pid in sorted(episodes, key=repr):  # a fixed order: the RNG draws do not depend on dict order
        eps = sorted(episodes[pid])
        counts = [len(calls[(pid, ep)]) for ep in eps]
        for rollout, row in enumerate(align_subtrajectories(counts, d_max, rng)):
            for slot, (i, j) in enumerate(row):
                key = (pid, eps[i], calls[(pid, eps[i])][j])
                samples = sorted(trajs[key], key=lambda s: s.turn)
                valid = bool(samples[-1].tags.get("format_valid", False))
                r = sub_reward(outcomes[(pid, eps[i])], valid, mode)
                dup = key in used
                used.add(key)
                for s in samples:
                    t = dataclasses.replace(s, tags={**s.tags, "duplicate": True}) if dup else s
                    t.trajectory = (eps[rollout], slot)  # one slot: one sub-trajectory in the group statistics
                    t.reward = r
                    t.group = group_key(t)
                    if frozen:
                        t.trainable = False
                    out.append(t)
    for key, samples in trajs.items():
        if key not in used:
            r = sub_reward(outcomes[key[:2]], bool(samples[-1].tags.get("format_valid", False)), mode)
            for s in samples:
                s.reward, s.group = r, group_key(s)
                s.tags["dropped"] = True
                s.trainable = False
                out.append(s)
    return out


@dataclass
class MGRPOConfig:
    """The ``m_grpo:`` config section."""

    d_max: int = option(
        2,
        ge=1,
        doc="sub-trajectories per rollout after alignment (random duplicates when fewer calls, random drops when more)",
    )
    sub_agent: str = option(
        "trained", choices=SUB_AGENT_MODES, doc="frozen: the sub-agent acts but gets no update (baseline)"
    )
    agents: str = option(
        "team",
        choices=AGENT_MODES,
        doc="team: main + sub-agent; single: one agent with the tools (single-agent GRPO baseline)",
    )
    sub_reward: str = option(
        "gated",
        choices=("gated", "outcome", "format"),
        doc="a sub-trajectory's reward: gated = main reward if its format is valid else 0; outcome = main reward; "
        "format = 1 if valid else 0",
    )


register_section("m_grpo", MGRPOConfig)


# the former decoupled trainer's keys: a placement now (docs/scale.md); a config that gives one fails, naming it
register_moved_key(
    "m_grpo.decoupled", "policy.mode=separate and policy.placement=ray (decoupled inprocess: policy.placement=local)"
)
register_moved_key("m_grpo.ray_timeout_s", "policy.ray_timeout_s")
register_moved_key("m_grpo.ray_address", "policy.ray_address")


@dataclass
class RawRollout:
    """A rollout before the sub-agent's reward assignment: what the decoupled store carries."""

    main: list[Sample]
    sub: list[Sample]
    outcomes: dict[tuple[Hashable, int], float]
    seed: int  # of the alignment RNG
    metrics: dict[str, float]


class MGRPO(Algorithm):
    """Sampler + group keys + reward assignment for M-GRPO over a workflow with sub-episodes (default: ``research``)."""

    name = "m_grpo"
    group_key = staticmethod(group_key)

    def __init__(
        self,
        config: MGRPOConfig,
        workflow: str | None = None,
        workflow_options: Any = None,
        *,
        k: int = 4,
        seed: int = 0,
    ) -> None:
        """``workflow``: a registered workflow that opens sub-episodes (None: ``research``, or
        ``research_single`` with ``agents: single``); ``workflow_options``: what its ``run`` receives."""
        for key, value, allowed in (
            ("sub_agent", config.sub_agent, SUB_AGENT_MODES),
            ("agents", config.agents, AGENT_MODES),
            ("sub_reward", config.sub_reward, SUB_REWARD_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"m_grpo.{key} {value!r}: choose one of {list(allowed)}")
        if config.d_max < 1:
            raise ValueError(f"m_grpo.d_max={config.d_max}: must be >= 1")
        self.config = config
        self.k = k
        self.seed = seed
        self.workflow = workflow
        self.workflow_options = workflow_options
        self.calls = 0  # rollouts so far: seeds the alignment RNG of the next one
        self.last_metrics: dict[str, float] = {}

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint must hold for a resumed run to draw the same trajectory alignment."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` (on resume)."""
        self.calls = int(state["calls"])

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles that act: main and sub, or main alone (single-agent baseline)."""
        if self.workflow is not None:
            return WORKFLOWS.get_entry(self.workflow, "workflow.name").role_types
        return ("main", "sub") if self.config.agents == "team" else ("main",)

    def rollout(self, problems: Sequence[Problem], env: Any, make_ctx: ContextFactory,
                run: Callable[[list[Awaitable]], list]) -> list[Sample]:
        """All rollouts of all questions together; main and aligned sub samples with rewards and groups set."""
        raw = self.rollout_raw(problems, env, make_ctx, run)
        sub = prepare_sub_samples(raw.sub, raw.outcomes, self.config.d_max, self.config.sub_reward, raw.seed,
                                  frozen=self.config.sub_agent == "frozen")
        self._warn_alignment(raw, sub)
        return raw.main + sub

    def _warn_alignment(self, raw: RawRollout, sub: Sequence[Sample]) -> None:
        """Say once per run when ``d_max`` dropped sub-agent calls (untrained) or filled slots with duplicates."""
        dropped = {(s.problem_id, s.tags["parent_episode"], s.tags["call"]) for s in sub if s.tags.get("dropped")}
        duplicated = {(s.problem_id, s.trajectory) for s in sub if s.tags.get("duplicate")}
        if not (dropped or duplicated):
            return
        made: dict[tuple[Hashable, int], set[int]] = {key: set() for key in raw.outcomes}
        for s in raw.sub:
            made[(s.problem_id, s.tags["parent_episode"])].add(s.tags["call"])
        counts = [len(calls) for calls in made.values()]
        warn_once(
            self,
            "d_max",
            f"m_grpo: the rollouts made {min(counts)} to {max(counts)} sub-agent calls, not "
            f"m_grpo.d_max={self.config.d_max} each: sub-trajectories dropped untrained: {len(dropped)}, slots filled "
            f"with duplicates: {len(duplicated)}; set m_grpo.d_max to the number of calls a rollout makes",
        )

    def rollout_raw(self, problems: Sequence[Problem], env: Any, make_ctx: ContextFactory,
                    run: Callable[[list[Awaitable]], list]) -> RawRollout:
        """Run the K rollouts per question; main samples get rewards, sub samples their format validity only."""
        self.calls += 1
        # a problem drawn twice is two instances (ids ``<id>#2``, ...): their outcomes and groups stay apart
        jobs = [
            (p, make_ctx(inst, e, {})) for p, inst in zip(problems, batch_instances(problems)) for e in range(self.k)
        ]
        results: list[EpisodeResult] = run([run_episode(self._episode(env, p), ctx) for p, ctx in jobs])
        main, sub, outcomes = [], [], {}
        for (p, ctx), res in zip(jobs, results):
            outcomes[(ctx.problem_id, ctx.episode)] = res.team_return
            calls = sub_calls(res)
            for s in ctx.samples:
                s.tags["solved"] = correct(res)
                if is_sub_sample(s):
                    s.tags["format_valid"] = calls[s.tags["call"]].format_valid if calls is not None else True
                    sub.append(s)
                else:
                    s.reward, s.group = res.team_return, group_key(s)
                    s.trajectory = ctx.episode  # all main turns of a rollout: one member of its group
                    main.append(s)
        self.finished = [FinishedEpisode(ctx.problem_id, ctx.episode, res) for (_, ctx), res in zip(jobs, results)]
        all_calls = [c for r in results for c in (sub_calls(r) or [])]
        metrics = {
            "success_rate": sum(correct(r) for r in results) / len(results),
            "main_reward": sum(r.team_return for r in results) / len(results),
            "main_valid": sum(bool(r.outcome.stats.get("valid", True)) if r.outcome else True for r in results)
            / len(results),
            # the sub-episodes each rollout opened, whether or not its workflow reports stats["calls"]
            "sub_calls_per_rollout": sum(ctx.sub_episodes for _, ctx in jobs) / len(results),
        }
        if all_calls:
            metrics["sub_format_valid"] = sum(c.format_valid for c in all_calls) / len(all_calls)
        self.last_metrics = metrics
        return RawRollout(main, sub, outcomes, derive_seed(self.seed, self.calls, 17), metrics)

    def _episode(self, env: Any, problem: Problem) -> EpisodeFn:
        """The episode of ``problem``: the configured workflow, or the research team (single: one agent with the
        tools)."""
        if self.workflow is not None:
            spec = WORKFLOWS.get_entry(self.workflow, "workflow.name")
            return bind(spec, env, problem, workflow_options_or_defaults(spec, self.workflow_options))
        # looked up now: tests replace them
        workflow = research_team if self.config.agents == "team" else research_single

        async def start(ctx: Any) -> EpisodeOutcome:
            return as_episode_outcome(await workflow(ctx, env, problem))
        return start

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Success rate, main reward and validity, sub-agent calls and format validity of the last rollout."""
        return dict(self.last_metrics)
