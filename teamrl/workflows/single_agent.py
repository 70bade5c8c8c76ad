"""The one-role workflow: the agent answers the task's prompt once; the task scores it."""

from __future__ import annotations

from teamrl.tasks.solve import SolveTask
from teamrl.tasks.task import Problem, Task, checked_reward
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.outcome import EpisodeOutcome, WorkflowSettings

ROLES = ("agent",)


async def single_agent(ctx: EpisodeContext, task: Task, problem: Problem) -> float:
    """Return the episode reward."""
    text = await ctx.generate("agent", task.prompt(problem))
    return checked_reward(task.name, f"reward(problem {problem.id!r})", task.reward(problem, text))


async def single_solve(ctx: EpisodeContext, task: SolveTask, problem: Problem, settings: WorkflowSettings) -> EpisodeOutcome:
    """The single-agent RL baseline of the workflow study: one answer, scored by its correctness."""
    text = await ctx.generate("agent", task.prompt(problem))
    answer = task.extract(text)
    (correct,) = task.correct_many(problem, [answer])
    return EpisodeOutcome(text, answer, correct)
