"""MAGRPO (Liu et al., 2025): agents act in parallel on local prompts; a shared reward scores joint actions.

It runs over any replayable workflow (:mod:`teamrl.workflows.episode`); a :class:`TeamTask` runs
through its default adapter ``team`` (``turns`` = ``num_turns``), which reproduces the algorithm
as first written. A node is a step of the episode: the calls pending at once (the roles acting
together; in a sequential workflow each call is its own step). Each frontier call samples G
completions (one prefill); each joint action continues as a replay copy to its next frontier.
Branching stops after ``num_turns`` steps (the depth); a leaf whose episode goes on is then
rolled out to its end with one sample per call (tagged ``no_update``: no group, not trained) and
the team rewards of that tail count as its child return. A joint action's reward r_t is the
team rewards its copy reported in its segment (+ the final team reward if the episode ended
there); samples' ``turn`` is the depth.

The three places where algorithms differ:
1. sampling: at every node (problem, turn, history) each of the N agents samples G completions
   of its own local prompt; joint actions pair the j-th samples (``aligned``: G joint actions)
   or take the Cartesian product (``cross``: G^N). With several turns every joint action that
   has not terminated becomes a child node whose prompts the task builds from the history and
   feedback: a tree, expanded breadth-first so that all nodes of a turn share engine batches.
2. group key: (problem, role, turn, parent path): an agent's G samples that saw the same prompt
   (a problem drawn twice in one batch is two instances: see :func:`~teamrl.tasks.task.batch_instances`).
3. reward assignment: the return of joint action k at turn t is
   ``R_t = r_t + gamma * mean(R_{t+1} over its children)`` (no children: ``R_t = r_t``); a
   completion's return is the return of its joint action (aligned) or the mean over the G^(N-1)
   joint actions that contain it (cross). Every completion is thus credited with the average
   team outcome it took part in, which keeps each agent's G returns comparable.

Early termination (``termination_threshold`` set): a joint action whose normalised reward
reaches the threshold ends its branch (no children) and is credited with its reward for every
remaining turn, ``R_t = r_t * (1 + gamma + ... + gamma^(T-1-t))``: the solved state is taken
to be absorbing. Every joint action's return thus sums the same number of turns, whether it
stopped or not, so stopping early never looks worse than continuing from a worse state.

Differences from the reference code (CoMLRL), on purpose: the discount is applied; early
termination is off unless ``termination_threshold`` is set, and is decided per joint action
(the reference stops a whole node when its mean reward reaches the threshold) with the
terminated action credited as above.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable, Sequence

from teamrl.algorithms.base import Algorithm
from teamrl.algorithms.episodes import ContextFactory, bind, resolve_workflow, workflow_roles, workflow_settings
from teamrl.core.config import option, register_section
from teamrl.core.sample import Sample
from teamrl.tasks.task import Problem, batch_instances
from teamrl.workflows.context import Call, EpisodeContext, team_rewards, total
from teamrl.workflows.episode import Branch, EpisodeFn

JOINT_MODES = ("aligned", "cross")


def joint_indices(group_size: int, num_agents: int, mode: str) -> list[tuple[int, ...]]:
    """Which sample of each agent forms each joint action.

    ``aligned``: [(0, 0, ...), (1, 1, ...), ...] (G actions); ``cross``: the product (G^N actions).
    """
    if mode == "aligned":
        return [(j,) * num_agents for j in range(group_size)]
    if mode == "cross":
        return list(itertools.product(range(group_size), repeat=num_agents))
    raise ValueError(f"joint_mode {mode!r}: choose one of {list(JOINT_MODES)}")


def completion_returns(joint: Sequence[tuple[int, ...]], joint_returns: Sequence[float], group_size: int,
                       num_agents: int) -> list[list[float]]:
    """``[agent][j]``: the mean return over the joint actions that contain sample j of that agent."""
    total = [[0.0] * group_size for _ in range(num_agents)]
    count = [[0] * group_size for _ in range(num_agents)]
    for idx, r in zip(joint, joint_returns):
        for a, j in enumerate(idx):
            total[a][j] += r
            count[a][j] += 1
    return [[t / c if c else 0.0 for t, c in zip(ta, ca)] for ta, ca in zip(total, count)]


def discounted_return(reward: float, child_returns: Sequence[float], gamma: float) -> float:
    """R_t = r_t + gamma * mean(children's returns); a leaf returns its reward."""
    return reward + (gamma * sum(child_returns) / len(child_returns) if child_returns else 0.0)


def terminated_return(reward: float, remaining_turns: int, gamma: float) -> float:
    """The return of a joint action that ended its branch with ``remaining_turns`` turns (its own
    included) left: its reward at every one of them, discounted (the solved state is absorbing)."""
    return reward * sum(gamma ** k for k in range(remaining_turns))


def group_key(sample: Sample) -> Hashable:
    """An agent's G samples of one node: same problem, role, turn and history."""
    return (sample.problem_id, sample.role, sample.turn, sample.tags.get("path", ()))


@dataclass
class MAGRPOConfig:
    """The ``magrpo:`` config section."""

    joint_mode: str = option("aligned", choices=JOINT_MODES,
                             doc="aligned: the j-th samples of the agents form G joint actions; cross: all G^N combinations")
    num_turns: int = option(1, ge=1, doc="branching depth in steps (with the team workflow: turns); each joint action of "
                                         "step t gets G joint actions at step t+1")
    gamma: float = option(1.0, ge=0, le=1, doc="discount: R_t = r_t + gamma * mean(children's returns)")
    termination_threshold: float | None = option(None, ge=0, le=1,
                                                 doc="stop expanding a joint action whose normalised reward reaches this; null: never")


@dataclass
class MAGRPOSettings(MAGRPOConfig):
    """What MAGRPO reads: its config section plus the group size (``rollout.group_size``)."""

    group_size: int = 4


register_section("magrpo", MAGRPOConfig)


class MAGRPO(Algorithm):
    """Sampler + group key + reward assignment for MAGRPO over any replayable workflow (default: ``team``)."""

    name = "magrpo"
    group_key = staticmethod(group_key)

    def __init__(self, settings: MAGRPOSettings, workflow: str | None = None, workflow_settings: Any = None) -> None:
        """``workflow``: a registered name (None: the task's default, ``team`` for a team task);
        ``workflow_settings``: what its ``run`` receives (None: its defaults, ``turns`` = ``num_turns``)."""
        if settings.joint_mode not in JOINT_MODES:
            raise ValueError(f"joint_mode {settings.joint_mode!r}: choose one of {list(JOINT_MODES)}")
        self.s = settings
        self.workflow = workflow
        self.workflow_settings = workflow_settings

    @property
    def roles(self) -> tuple[str, ...] | None:
        """The role types of the named workflow (None: the task's)."""
        return workflow_roles(self.workflow)

    def rollout(self, problems: Sequence[Problem], task: Any, make_ctx: ContextFactory,
                run: Callable[[list[Awaitable]], list]) -> list[Sample]:
        """Expand every problem's tree together; return all samples with returns and groups set."""
        name, spec = resolve_workflow(self.workflow, task)
        settings = workflow_settings(spec, self.workflow_settings, turns=self.s.num_turns)
        max_reward = float(getattr(task, "max_reward", 1.0))
        ctxs = [make_ctx(inst, 0, {}) for inst in batch_instances(problems)]  # a repeated problem: its own groups
        for c in ctxs:
            c.workflow = name
        run([self._root(ctx, bind(spec, task, p, settings), max_reward) for ctx, p in zip(ctxs, problems)])
        samples = [s for c in ctxs for s in c.samples]
        for s in samples:
            if s.group is None:
                s.group = self.group_key(s)
        return samples

    async def _root(self, real: EpisodeContext, start: EpisodeFn, max_reward: float) -> list[float]:
        branch = Branch(start, real)
        frontier = await branch.advance()
        return await self._node(real, branch, frontier, 0, (), max_reward) if frontier else []

    async def _node(self, real: EpisodeContext, branch: Branch, frontier: list[Call], depth: int, path: tuple,
                    max_reward: float) -> list[float]:
        """Sample this node's joint actions, expand children, assign returns; return the joint returns."""
        G = self.s.group_size
        groups = await asyncio.gather(*[real.sample(c.role, c.messages, G, depth, 0, c.params, {**c.tags, "path": path})
                                        for c in frontier])
        joint = joint_indices(G, len(frontier), self.s.joint_mode)
        copies = [branch.extend([[groups[a][j]] for a, j in enumerate(idx)]) for idx in joint]
        branch.cancel()
        await asyncio.gather(*[c.advance() for c in copies])
        rewards = [c.segment_team_reward() for c in copies]
        stop = [self._terminated(r, max_reward) for r in rewards]
        expand = [depth + 1 < self.s.num_turns and not t and not c.done for t, c in zip(stop, copies)]
        finish = [not e and not t and not c.done for e, t, c in zip(expand, stop, copies)]  # past the depth: roll out
        children = await asyncio.gather(*[
            self._node(real, copies[k], copies[k].frontier, depth + 1, path + (k,), max_reward)
            for k in range(len(joint)) if expand[k]])
        tails = await asyncio.gather(*[self._roll_out(real, copies[k], path + (k,)) for k in range(len(joint)) if finish[k]])
        child_iter, tail_iter = iter(children), iter(tails)
        left = self.s.num_turns - depth
        returns = []
        for k, r in enumerate(rewards):
            if stop[k]:
                returns.append(terminated_return(r, left, self.s.gamma))
            elif expand[k]:
                returns.append(discounted_return(r, next(child_iter), self.s.gamma))
            elif finish[k]:
                returns.append(discounted_return(r, [next(tail_iter)], self.s.gamma))
            else:
                returns.append(discounted_return(r, [], self.s.gamma))
            if not expand[k]:
                copies[k].cancel()
        per_sample = completion_returns(joint, returns, G, len(frontier))
        per_reward = completion_returns(joint, rewards, G, len(frontier))
        for a, samples in enumerate(groups):
            for j, s in enumerate(samples):
                s.reward = per_sample[a][j]
                s.tags["turn_reward"] = per_reward[a][j]
                s.tags["normalised_reward"] = per_reward[a][j] / max_reward
        return returns

    async def _roll_out(self, real: EpisodeContext, branch: Branch, path: tuple) -> float:
        """Play a leaf past the branching depth to its end, one sample per call (logged, not trained);
        return the team rewards it earned after the leaf's segment (+ the final team reward)."""
        start = len(branch.ctx.events)
        while not branch.done:
            answers = await asyncio.gather(*[
                real.sample(c.role, c.messages, 1, c.turn, 0, c.params, {**c.tags, "path": path})
                for c in branch.frontier])
            branch.resolve(answers)
            await branch.advance()
            for (s,) in answers:
                s.trainable = False  # no group to compare it with
                s.group = ("rollout", s.problem_id, path)
        assert branch.result is not None
        return total([team_rewards(branch.ctx.events[start:]), branch.result.final_reward])

    def _terminated(self, reward: float, max_reward: float) -> bool:
        t = self.s.termination_threshold
        return t is not None and reward / max_reward >= t
