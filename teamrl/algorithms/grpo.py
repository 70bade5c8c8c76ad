"""GRPO per role call: G independent episodes of a workflow per problem, compared call by call.

The three places where algorithms differ:
1. sampling: ``group_size`` independent episodes per problem, all in flight together (plus one
   greedy episode per problem for the ReMax baseline when ``advantage == "max"``); the workflow
   is the configured one or the task's default adapter (``single``, ``team``, ``env``, ``research``);
2. group key: (problem, role type, turn): a sample is compared with the samples of the same role
   type at the same call position of the same problem's episodes (three instances of one role
   called at once, e.g. ``generator0..2``, over G episodes form one group of 3G). The single-agent default
   (``single`` on a task, no
   workflow named) keeps its key ``(problem,)``: the same grouping;
3. reward assignment: a registered reward (``teamrl.workflows.REWARDS``, ``workflow.reward``):
   ``outcome``, the episode's team return for every sample, or ``per_role``, a sample's own
   reward (the rewards its role reported after the call, or what the workflow set) where it has
   one and the team return elsewhere.

``metrics`` turns the last rollout's episode outcomes into accuracy and the workflow's own statistics
(the summary it registered: :func:`teamrl.workflows.outcome_metrics`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, Hashable, Sequence

from teamrl.algorithms.base import Algorithm, FinishedEpisode, warn_once
from teamrl.algorithms.episodes import (
    ContextFactory,
    bind,
    resolve_workflow,
    workflow_roles,
    workflow_options_or_defaults,
)
from teamrl.core.config import InputError
from teamrl.core.sample import Sample
from teamrl.policies.router import role_type
from teamrl.tasks.task import Problem
from teamrl.workflows import REWARDS, WORKFLOWS, EpisodeOutcome, outcome_metrics
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.episode import EpisodeResult, run_episode


def group_key(sample: Sample) -> Hashable:
    """Samples are compared within (problem, role type, turn)."""
    return (sample.problem_id, role_type(sample.role), sample.turn)


def _kind(kind: tuple[str, ...]) -> str:
    return "after " + ", ".join(kind) if kind else "first"


def calls_before(ctx: EpisodeContext) -> list[tuple[Sample, tuple[str, ...]]]:
    """Each sample of an episode with the kind of its call: the role types that acted before it, in order, a run
    of calls of one type counted once, up to the last call of another type than its own (so the instances of
    one role called at once, ``generator0..2``, are one kind). Two samples of one group (problem, role type,
    turn) of different kinds are different calls that share a call position (a critic's post-tool call and
    another episode's round-2 review after a revision)."""
    acted: list[str] = []
    out = []
    for call in ctx.calls:
        own = role_type(call.role)
        kind = tuple(acted[:-1] if acted and acted[-1] == own else acted)
        out += [(s, kind) for s in call.samples]
        if not acted or acted[-1] != own:
            acted.append(own)
    return out


def mixed_group(ctxs: Sequence[EpisodeContext]) -> tuple[Sample, tuple, tuple] | None:
    """A group that holds calls of two kinds (see :func:`calls_before`): one of its samples and the two kinds; None
    if none."""
    kinds: dict[Hashable, tuple] = {}
    for ctx in ctxs:
        for s, kind in calls_before(ctx):
            seen = kinds.setdefault(s.group, kind)
            if seen != kind:
                return s, seen, kind
    return None


def assign_rewards(samples: Sequence[Sample], outcome: EpisodeOutcome, mode: str) -> None:
    """Each sample's reward from the registered reward ``mode`` (``outcome``: the outcome reward for
    every sample; ``per_role``: a sample's own reward where it has one)."""
    reward = REWARDS.get_entry(mode, "workflow.reward")
    for s in samples:
        value = reward(s, outcome)
        # a user's reward: named, as a task's is
        if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
            raise InputError(f"workflow.reward {mode!r}: returned {value!r} for a {s.role!r} sample; expected a number")
        s.reward = float(value)


def reward_view(result: EpisodeResult) -> EpisodeOutcome:
    """The outcome a reward function sees: the workflow's (or an empty one), its reward the team return."""
    base = result.outcome or EpisodeOutcome("", None, False)
    return dataclasses.replace(base, team_reward=result.team_return)


class GRPO(Algorithm):
    """Sampler + group key + reward assignment for GRPO per role call over any workflow."""

    name = "grpo"
    group_key = staticmethod(group_key)

    def __init__(self, group_size: int, greedy_baseline: bool = False, workflow: str | None = None, options: Any = None,
                 reward: str = "outcome") -> None:
        """``workflow`` and ``reward``: registered names (or ``package.module:object``; no workflow: the
        task's default); ``options``: what the workflow's ``run`` receives (None: its defaults)."""
        self.spec = WORKFLOWS.get_entry(workflow, "workflow.name") if workflow else None
        REWARDS.get_entry(reward, "workflow.reward")
        self.workflow = workflow
        self.group_size = group_size
        self.greedy_baseline = greedy_baseline
        self.options = options
        self.reward_mode = reward
        self._workflow_run = workflow or ""

    can_evaluate = True  # held-out evaluation during training: any workflow (its outcomes, else its rewards)

    @property
    def roles(self) -> tuple[str, ...] | None:
        """The role types of the named workflow (None: the task's)."""
        return workflow_roles(self.workflow)

    def episodes(self, problems: Sequence[Problem], task: Any, make_ctx: ContextFactory,
                 run: Callable[[list[Awaitable]], list], episodes_per_problem: int,
                 extra: Sequence[tuple[Problem, int, dict]] = ()) -> tuple[list[EpisodeContext], list[EpisodeResult]]:
        """Run ``episodes_per_problem`` episodes of every problem (and the ``extra`` ones) together."""
        name, spec = resolve_workflow(self.workflow, task)
        self._workflow_run = name
        options = workflow_options_or_defaults(spec, self.options)
        jobs = [(p, e, {}) for p in problems for e in range(episodes_per_problem)] + list(extra)
        ctxs = [make_ctx(p, e, tags) for p, e, tags in jobs]
        for ctx in ctxs:
            ctx.workflow = name
            ctx.refuse_sub_episodes = self.name  # its groups cannot align sub-agent calls (m_grpo does)
        results = run([run_episode(bind(spec, task, p, options), ctx) for (p, _, _), ctx in zip(jobs, ctxs)])
        return ctxs, results

    def rollout(self, problems: Sequence[Problem], task: Any, make_ctx: ContextFactory,
                run: Callable[[list[Awaitable]], list]) -> list[Sample]:
        """Run G episodes per problem (one engine batch per policy per step) and return the samples."""
        extra = [(p, -1, {"greedy": True}) for p in problems] if self.greedy_baseline else []
        ctxs, results = self.episodes(problems, task, make_ctx, run, self.group_size, extra)
        per_problem = self.workflow is None and self._workflow_run == "single"
        self.finished = [FinishedEpisode(c.problem_id, c.episode, r) for c, r in zip(ctxs, results) if c.episode != -1]
        # gateway episodes: none reported a reward in time
        if self.outcomes and all(o.stats.get("dropped") for o in self.outcomes):
            raise InputError(
                f"workflow {self._workflow_run!r}: all {len(self.outcomes)} episodes of this step were dropped (no "
                "reward within workflow.options.reward_timeout_s); nothing to train on"
            )
        samples: list[Sample] = []
        for ctx, result in zip(ctxs, results):
            assign_rewards(ctx.samples, reward_view(result), self.reward_mode)
            for s in ctx.samples:
                s.baseline = ctx.episode == -1  # the greedy episode (ReMax baseline)
                s.group = (s.problem_id,) if per_problem else self.group_key(s)
                if result.outcome is not None:
                    s.tags["correct"] = result.outcome.correct
            samples += ctx.samples
        mixed = None if per_problem else mixed_group(ctxs)
        if mixed:  # a group of GRPO compares calls by position: say once when a position holds different calls
            s, one, other = mixed
            warn_once(
                self,
                "mixed_group",
                f"grpo: workflow {self._workflow_run!r}: the group of role {role_type(s.role)!r} "
                f"turn {s.turn} (problem {s.problem_id!r}) holds different calls "
                f"({_kind(one)} vs {_kind(other)}); pass turn= to ctx.generate to give each kind of call its own group",
            )
        return samples

    def evaluate(self, problems: Sequence[Problem], task: Any, make_ctx: ContextFactory,
                 run: Callable[[list[Awaitable]], list]) -> dict[str, float]:
        """One episode per problem (the caller's contexts decide the sampling, e.g. greedy); accuracy and the
        workflow's diagnostics. A workflow that returns no outcome (a task scored by its reward alone, partial credit
        such as reverse_text's) has as ``accuracy`` the mean normalised return, the score ``teamrl eval`` shows.
        Trains nothing and keeps no state."""
        _, results = self.episodes(problems, task, make_ctx, run, 1)
        outcomes = [r.outcome for r in results if r.outcome is not None]
        if outcomes or not results:
            return outcome_metrics(self._workflow_run, outcomes)
        return {"accuracy": sum(r.team_return for r in results) / (len(results) * getattr(task, "max_reward", 1.0))}

    @property
    def outcomes(self) -> list[EpisodeOutcome]:
        """The outcomes of the last rollout's episodes (greedy baselines left out)."""
        return [e.result.outcome for e in self.finished if e.result.outcome is not None]

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Episode correctness and the workflow's diagnostics over the last rollout (none without outcomes)."""
        return outcome_metrics(self._workflow_run, self.outcomes)


class WorkflowGRPO(GRPO):
    """GRPO on a named workflow (the workflow study's spelling): ``WorkflowGRPO(workflow, group_size, options,
    reward)``."""

    def __init__(self, workflow: str, group_size: int, options: Any, reward: str = "outcome") -> None:
        super().__init__(group_size, workflow=workflow, options=options, reward=reward)
