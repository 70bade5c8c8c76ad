"""MAGRPO (Liu et al., 2025): agents act in parallel on local prompts; a shared reward scores joint actions.

It runs over any replayable workflow (:mod:`teamrl.workflows.episode`); a :class:`TeamTask` runs
through its default adapter ``team`` (``turns`` = ``num_turns``), which reproduces the algorithm
as first written. A node is a step of the episode: the calls pending at once (the roles acting
together; in a sequential workflow each call is its own step). **A step is branched when it holds
one of a role's first** ``num_turns`` **calls** (its call position in the episode, whatever ``turn=``
the workflow passes): each of its calls samples G completions (one prefill) and each joint action
continues as a replay copy to its next frontier. Every role that acts makes a first call, so every
role that acts is trained, in a sequential workflow too (a proposer -> critic -> judge team
samples G proposals, G critiques under each and G verdicts under each of those: G + G^2 + G^3
samples per problem, aligned). A step whose calls are all later calls of their roles is played
with one sample per call (logged, not trained: no group) and the episode goes on to its next
branched step or its end; the team rewards of the steps played count in the return passed up.
A joint action's reward r_t is the team rewards its copy reported in its segment (+ the final
team reward if the episode ended there). A sample's ``turn`` is its call's turn, as under every
algorithm; its node's level in the tree is ``tags["depth"]`` and the joint actions above it
``tags["path"]``. Before issue 35, ``num_turns`` counted steps: a sequential workflow trained its
first role only, and ``turn`` held the depth.

The three places where algorithms differ:
1. sampling: at every node (problem, history) each of the N calls of the step samples G
   completions of its own prompt; joint actions pair the j-th samples (``aligned``: G joint actions)
   or take the Cartesian product (``cross``: G^N). Every joint action that has not terminated
   goes on to its next branched step, a child node (with ``team``: the next turn, whose prompts
   the task builds from the history and feedback): a tree, expanded breadth-first so that all
   nodes of a level share engine batches.
2. group key: (problem, role, turn, parent path): an agent's G samples that saw the same prompt
   (a problem drawn twice in one batch is two instances: see :func:`~teamrl.tasks.task.batch_instances`).
3. reward assignment: the return of joint action k at node t is
   ``R_t = r_t + gamma * mean(R_{t+1} over its child node's joint actions)`` (no child node:
   ``R_t = r_t``; the team rewards of the steps played between the two, or after the last
   node, add to each R_{t+1}: gamma discounts once per branched level); a
   completion's return is the return of its joint action (aligned) or the mean over the G^(N-1)
   joint actions that contain it (cross). Every completion is thus credited with the average
   team outcome it took part in, which keeps each agent's G returns comparable.

Early termination (``termination_threshold`` set): a joint action whose normalised reward
reaches the threshold ends its branch (no children) and is credited with its reward for every
level left, its own included, ``R = r * (1 + gamma + ... + gamma^(L-1))``: the solved state is
taken to be absorbing. L is the larger of ``num_turns`` minus the node's lowest call position
(with ``team``: the turns left) and the branched levels of the problem's tree from the node's
down to its deepest (in a sequential workflow each role's first call is a level of its own: a
proposer -> critic -> judge team that solves at the proposer is credited three times). Returns
are assigned once the whole tree is expanded, so L is known. Every joint action's return thus
sums as many levels as a sibling's that continues, so stopping early never looks worse than
continuing from a worse state.

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

from teamrl.algorithms.base import Algorithm, FinishedEpisode, warn_once
from teamrl.algorithms.episodes import (
    ContextFactory,
    bind,
    play_out,
    resolve_workflow,
    workflow_roles,
    workflow_options_or_defaults,
)
from teamrl.core.config import option, register_section
from teamrl.core.sample import Sample
from teamrl.tasks.task import Problem, batch_instances
from teamrl.workflows.context import Call, EpisodeContext, total
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


def terminated_return(reward: float, remaining_levels: int, gamma: float) -> float:
    """The return of a joint action that ended its branch with ``remaining_levels`` branched levels (team
    turns; its own included) left: its reward at every one of them, discounted (the solved state is absorbing)."""
    return reward * sum(gamma ** k for k in range(remaining_levels))


def call_position(calls: Sequence[Call], call: Call) -> int:
    """How many calls ``call``'s role made before it in the episode (``calls``: the episode's, in issue order)."""
    return sum(1 for c in calls if c.role == call.role and c.index < call.index)


def group_key(sample: Sample) -> Hashable:
    """An agent's G samples of one node: same problem, role, turn and history."""
    return (sample.problem_id, sample.role, sample.turn, sample.tags.get("path", ()))


@dataclass
class MAGRPOConfig:
    """The ``magrpo:`` config section."""

    joint_mode: str = option(
        "aligned",
        choices=JOINT_MODES,
        doc="aligned: the j-th samples of the agents form G joint actions; cross: all G^N combinations",
    )
    num_turns: int = option(
        1,
        ge=1,
        doc="calls of each role branched: every step holding one of a role's first num_turns "
        "calls samples G per call and forms joint actions, so every role that acts trains; "
        "later steps play one untrained sample per call (the team workflow: its turns)",
    )
    gamma: float = option(1.0, ge=0, le=1, doc="discount: R_t = r_t + gamma * mean(children's returns)")
    termination_threshold: float | None = option(
        None, ge=0, le=1, doc="stop expanding a joint action whose normalised reward reaches this; null: never"
    )


register_section("magrpo", MAGRPOConfig)


class MAGRPO(Algorithm):
    """Sampler + group key + reward assignment for MAGRPO over any replayable workflow (default: ``team``)."""

    name = "magrpo"
    group_key = staticmethod(group_key)

    def __init__(
        self, config: MAGRPOConfig, workflow: str | None = None, workflow_options: Any = None, *, group_size: int = 4
    ) -> None:
        """``workflow``: a registered name (None: the task's default, ``team`` for a team task);
        ``workflow_options``: what its ``run`` receives (None: its defaults, ``turns`` = ``num_turns``)."""
        if config.joint_mode not in JOINT_MODES:
            raise ValueError(f"joint_mode {config.joint_mode!r}: choose one of {list(JOINT_MODES)}")
        self.config = config
        self.group_size = group_size
        self.workflow = workflow
        self.workflow_options = workflow_options
        self.max_reward = 1.0  # the task's, set by each rollout
        self.finished: list[FinishedEpisode] = []

    @property
    def roles(self) -> tuple[str, ...] | None:
        """The role types of the named workflow (None: the task's)."""
        return workflow_roles(self.workflow)

    def rollout(self, problems: Sequence[Problem], task: Any, make_ctx: ContextFactory,
                run: Callable[[list[Awaitable]], list]) -> list[Sample]:
        """Expand every problem's tree together; return all samples with returns and groups set."""
        name, spec = resolve_workflow(self.workflow, task)
        options = workflow_options_or_defaults(spec, self.workflow_options, turns=self.config.num_turns)
        self.max_reward = float(getattr(task, "max_reward", 1.0))
        self.finished = []
        ctxs = [make_ctx(inst, 0, {}) for inst in batch_instances(problems)]  # a repeated problem: its own groups
        for c in ctxs:
            c.workflow = name
            c.refuse_sub_episodes = self.name  # its joint actions cannot align sub-agent calls (m_grpo does)
        run([self._root(ctx, bind(spec, task, p, options)) for ctx, p in zip(ctxs, problems)])
        samples = [s for c in ctxs for s in c.samples]
        for s in samples:
            if s.group is None:
                s.group = self.group_key(s)
        played = [s for s in samples if s.tags.get("rollout")]
        if played:  # acting calls that never train: say so, once
            warn_once(
                self,
                "num_turns",
                f"magrpo: {len(played)} calls of role(s) {sorted({s.role for s in played})} came "
                f"after their role's first magrpo.num_turns={self.config.num_turns} call(s) and were played untrained "
                "(one sample, no group); raise magrpo.num_turns to train them",
            )
        return samples

    def branched(self, branch: Branch, frontier: Sequence[Call]) -> bool:
        """Whether a step is branched (G samples per call, joint actions): it holds one of a role's first
        ``num_turns`` calls; every other step is played with one untrained sample per call."""
        return any(call_position(branch.ctx.calls, c) < self.config.num_turns for c in frontier)

    async def _root(self, real: EpisodeContext, start: EpisodeFn) -> None:
        branch = Branch(start, real)
        await branch.advance()
        returns, _ = await self._walk(real, branch, 0, (), deepest := [0])
        # returns wait for the whole tree: a terminated joint action is credited down to its deepest level
        returns(deepest[0])

    async def _walk(self, real: EpisodeContext, branch: Branch, depth: int, path: tuple,
                    deepest: list[int]) -> tuple[Callable[[int], list[float]], float]:
        """Play ``branch`` on from its frontier (one untrained sample per call) until its next branched step, a
        node, or the end of its episode. Returns the child returns it passes up (each of that node's joint
        returns plus the team rewards played before the node; those rewards alone when the episode ended
        first), as a function of the tree's number of levels, and the mean team return of the episodes below."""
        played = total(
            await play_out(real, branch, {"path": path}, until=lambda frontier: self.branched(branch, frontier))
        )
        if branch.done:
            self._finish(real, branch, path)
            return (lambda levels: [played]), branch.cumulative_team_reward()
        returns, team = await self._node(real, branch, depth, path, deepest)
        return (lambda levels: [total([played, r]) for r in returns(levels)]), sum(team) / len(team)

    async def _node(self, real: EpisodeContext, branch: Branch, depth: int, path: tuple,
                    deepest: list[int]) -> tuple[Callable[[int], list[float]], list[float]]:
        """Sample this node's joint actions and walk their episodes on; return the function that, given the
        number of branched levels of the tree (``deepest[0]`` once every episode ended), assigns the node's
        returns to its samples and returns them, and the mean team return of the episodes below each joint action."""
        deepest[0] = max(deepest[0], depth + 1)
        G, frontier = self.group_size, branch.frontier
        groups = await asyncio.gather(*[real.sample(c.role, c.messages, G, c.turn, 0, c.params,
                                                    {**c.tags, "path": path, "depth": depth}, tools=c.tools)
                                        for c in frontier])
        joint = joint_indices(G, len(frontier), self.config.joint_mode)
        copies = [branch.extend([[groups[a][j]] for a, j in enumerate(idx)]) for idx in joint]
        branch.cancel()
        await asyncio.gather(*[c.advance() for c in copies])
        rewards = [c.segment_team_reward() for c in copies]
        stop = [self._terminated(r) for r in rewards]
        go_on = [not t and not c.done for t, c in zip(stop, copies)]
        walked = await asyncio.gather(*[
            self._walk(real, copies[k], depth + 1, path + (k,), deepest) for k in range(len(joint)) if go_on[k]])
        below = iter(walked)
        children = [next(below) if go_on[k] else None for k in range(len(joint))]
        # a terminated branch: the team rewards so far
        team = [child[1] if child else copies[k].cumulative_team_reward()
                for k, child in enumerate(children)]
        for k in range(len(joint)):
            if not go_on[k]:
                if copies[k].done:
                    self._finish(real, copies[k], path + (k,))
                copies[k].cancel()
        # with team: turns left counted from the step's turn; in a sequential workflow each role's first call is a level
        # of its own, so the levels of the tree below count too (the ones a continuing sibling walks)
        first = min(call_position(branch.ctx.calls, c) for c in frontier)

        def assign(levels: int) -> list[float]:
            left = max(self.config.num_turns - first, levels - depth)
            returns = [discounted_return(r, child[0](levels), self.config.gamma) if child
                       else terminated_return(r, left, self.config.gamma) if stop[k]
                       else discounted_return(r, [], self.config.gamma)
                       for k, (r, child) in enumerate(zip(rewards, children))]
            per_sample = completion_returns(joint, returns, G, len(frontier))
            per_reward = completion_returns(joint, rewards, G, len(frontier))
            per_team = completion_returns(joint, team, G, len(frontier))
            for a, samples in enumerate(groups):
                for j, s in enumerate(samples):
                    s.reward = per_sample[a][j]
                    s.tags["turn_reward"] = per_reward[a][j]
                    s.tags["normalised_reward"] = per_reward[a][j] / self.max_reward
                    s.tags["team_return"] = per_team[a][j]
            return returns

        return assign, team

    def _finish(self, real: EpisodeContext, branch: Branch, path: tuple) -> None:
        assert branch.result is not None
        self.finished.append(FinishedEpisode(real.problem_id, real.episode, branch.result, {"path": list(path)}))

    def _terminated(self, reward: float) -> bool:
        t = self.config.termination_threshold
        return t is not None and reward / self.max_reward >= t

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """``normalised_return``: the mean team return of an episode (every team reward the workflow reported,
        its final reward included) over the task's ``max_reward``, averaged over the tree as it was sampled (each
        problem's root, each joint action's episodes below it); ``normalised_return_last_turn``: the mean
        normalised reward of the joint actions at the deepest branched step (with ``team``: the last turn)."""
        nodes: dict[tuple[Hashable, int, Any], list[Sample]] = {}  # (problem, depth, path) -> its samples
        for s in samples:
            if "depth" in s.tags:  # branched (played samples are not trained)
                nodes.setdefault((s.problem_id, s.tags["depth"], s.tags["path"]), []).append(s)
        if not nodes:
            return {}

        def mean_over_nodes(depth: int, key: str) -> float:
            means = [sum(s.tags[key] for s in own) / len(own) for (_, d, _), own in nodes.items() if d == depth]
            return sum(means) / len(means)

        out = {}
        depths = {d for _, d, _ in nodes}
        if 0 in depths:  # none when train.nonfinite_reward=drop_group dropped the roots' groups
            out["normalised_return"] = mean_over_nodes(0, "team_return") / self.max_reward
        out["normalised_return_last_turn"] = mean_over_nodes(max(depths), "normalised_reward")
        return out
