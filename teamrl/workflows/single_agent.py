"""The one-role workflow: the agent answers the task's prompt once; the task scores it."""

from __future__ import annotations

from teamrl.tasks.task import Problem, Task
from teamrl.workflows.context import EpisodeContext

ROLES = ("agent",)


async def single_agent(ctx: EpisodeContext, task: Task, problem: Problem) -> float:
    """Return the episode reward."""
    text = await ctx.generate("agent", task.prompt(problem))
    return task.reward(problem, text)
