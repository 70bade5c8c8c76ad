"""GRPO, the one-role case: G independent episodes per problem, one group per problem.

The three places where algorithms differ:
1. sampling: ``group_size`` independent episodes of the workflow per problem (plus one greedy
   episode per problem for the ReMax baseline when ``advantage == "max"``);
2. group key: the problem;
3. reward assignment: each sample gets its episode's reward.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Hashable, Sequence

from teamrl.core.sample import Sample
from teamrl.tasks.task import Problem, Task
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.single_agent import single_agent

# (problem, episode index, tags) -> context
ContextFactory = Callable[[Problem, int, dict], EpisodeContext]


def group_key(sample: Sample) -> Hashable:
    """Samples are compared within their problem."""
    return (sample.problem_id,)


def assign_rewards(samples: Sequence[Sample], episode_reward: float) -> None:
    """Every call of an episode gets the episode's reward."""
    for s in samples:
        s.reward = float(episode_reward)


class GRPO:
    """Sampler + group key + reward assignment for single-agent GRPO."""

    name = "grpo"
    group_key = staticmethod(group_key)
    assign_rewards = staticmethod(assign_rewards)

    def __init__(self, group_size: int, greedy_baseline: bool = False) -> None:
        self.group_size = group_size
        self.greedy_baseline = greedy_baseline

    def rollout(self, problems: Sequence[Problem], task: Task, make_ctx: ContextFactory,
                run: Callable[[list[Awaitable]], list]) -> list[Sample]:
        """Run every episode of every problem together (one engine batch per turn) and return the samples."""
        jobs = [(p, make_ctx(p, e, {})) for p in problems for e in range(self.group_size)]
        if self.greedy_baseline:
            jobs += [(p, make_ctx(p, -1, {"greedy": True})) for p in problems]
        rewards = run([single_agent(ctx, task, p) for p, ctx in jobs])
        samples: list[Sample] = []
        for (_, ctx), r in zip(jobs, rewards):
            self.assign_rewards(ctx.samples, r)
            for s in ctx.samples:
                s.group = self.group_key(s)
                s.baseline = ctx.episode == -1  # the greedy episode
            samples += ctx.samples
        return samples
