"""MAGRPO (Liu et al., 2025): agents act in parallel on local prompts; a shared reward scores joint actions.

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
from typing import Awaitable, Callable, Hashable, Sequence

from teamrl.core.sample import Sample
from teamrl.tasks.task import Problem, TeamTask, batch_instances, checked_rewards
from teamrl.workflows.context import EpisodeContext

JOINT_MODES = ("aligned", "cross")
ContextFactory = Callable[[Problem, int, dict], EpisodeContext]


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
class MAGRPOSettings:
    group_size: int = 4
    joint_mode: str = "aligned"
    num_turns: int = 1
    gamma: float = 1.0
    termination_threshold: float | None = None  # normalised reward at which a joint action stops expanding


class MAGRPO:
    """Sampler + group key + reward assignment for MAGRPO over a :class:`TeamTask`."""

    name = "magrpo"
    group_key = staticmethod(group_key)

    def __init__(self, settings: MAGRPOSettings) -> None:
        if settings.joint_mode not in JOINT_MODES:
            raise ValueError(f"joint_mode {settings.joint_mode!r}: choose one of {list(JOINT_MODES)}")
        self.s = settings

    def rollout(self, problems: Sequence[Problem], task: TeamTask, make_ctx: ContextFactory,
                run: Callable[[list[Awaitable]], list]) -> list[Sample]:
        """Expand every problem's tree together; return all samples with returns and groups set."""
        ctxs = [make_ctx(inst, 0, {}) for inst in batch_instances(problems)]  # a repeated problem: its own groups
        run([self._node(ctx, task, p, 0, (), [], "") for ctx, p in zip(ctxs, problems)])
        samples = [s for c in ctxs for s in c.samples]
        for s in samples:
            s.group = self.group_key(s)
        return samples

    async def _node(self, ctx: EpisodeContext, task: TeamTask, problem: Problem, turn: int, path: tuple,
                    history: list[dict[str, str]], feedback: str) -> list[float]:
        """Sample this node's joint actions, expand children, assign returns; return the joint returns."""
        G, roles = self.s.group_size, task.roles
        groups = await asyncio.gather(*[
            ctx.generate_group(role, task.prompt(problem, role, turn, history, feedback), n=G, turn=turn,
                               tags={"path": path}) for role in roles])
        joint = joint_indices(G, len(roles), self.s.joint_mode)
        outputs = [{role: groups[a][j].text for a, (role, j) in enumerate(zip(roles, idx))} for idx in joint]
        rewards = checked_rewards(task.name, f"rewards(problem {problem.id!r})", task.rewards(problem, outputs), len(outputs),
                                  per="joint action")
        stop = [self._terminated(r, task) for r in rewards]
        expand = [turn + 1 < self.s.num_turns and not t for t in stop]
        children = await asyncio.gather(*[
            self._node(ctx, task, problem, turn + 1, path + (k,), history + [outputs[k]],
                       task.feedback(problem, outputs[k], rewards[k]))
            for k in range(len(joint)) if expand[k]])
        child_iter = iter(children)
        left = self.s.num_turns - turn
        returns = [terminated_return(r, left, self.s.gamma) if t
                   else discounted_return(r, next(child_iter) if e else [], self.s.gamma)
                   for r, t, e in zip(rewards, stop, expand)]
        per_sample = completion_returns(joint, returns, G, len(roles))
        per_reward = completion_returns(joint, rewards, G, len(roles))
        for a, samples in enumerate(groups):
            for j, s in enumerate(samples):
                s.reward = per_sample[a][j]
                s.tags["turn_reward"] = per_reward[a][j]
                s.tags["normalised_reward"] = per_reward[a][j] / task.max_reward
        return returns

    def _terminated(self, reward: float, task: TeamTask) -> bool:
        t = self.s.termination_threshold
        return t is not None and reward / task.max_reward >= t
