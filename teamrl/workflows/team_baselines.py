"""Prompt-only ways to run a team task, the baselines a trained team is compared with.

- ``parallel``: every role answers its own prompt at once, no coordination (the MAGRPO
  team's own structure; with the untrained base model it is the ``concat`` baseline);
- ``sequential``: roles answer in order, each seeing the earlier roles' outputs;
- ``discussion``: one round: parallel drafts, then each role sees the others' drafts and revises;
- ``single``: one agent writes every part in one answer (the task splits it).

:func:`scored` makes each of them a workflow of the episode protocol (``teamrl eval`` runs them so):
the task's checked reward of the joint output is the final team reward.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from teamrl.tasks.task import Problem, TeamTask, checked_reward
from teamrl.workflows.adapters import joint_outcome
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.outcome import EpisodeOutcome


def _with_note(messages: list[dict[str, str]], note: str) -> list[dict[str, str]]:
    """The same prompt with ``note`` appended to its last user message."""
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m["role"] == "user":
            m["content"] = m["content"] + "\n\n" + note
            return out
    return out + [{"role": "user", "content": note}]


def _others(outputs: dict[str, str], role: str) -> str:
    return "\n\n".join(f"Your teammate ({r}) wrote:\n{t}" for r, t in outputs.items() if r != role)


async def parallel(ctx: EpisodeContext, task: TeamTask, problem: Problem) -> dict[str, str]:
    texts = await asyncio.gather(*[ctx.generate(r, task.prompt(problem, r)) for r in task.roles])
    return dict(zip(task.roles, texts))


async def sequential(ctx: EpisodeContext, task: TeamTask, problem: Problem) -> dict[str, str]:
    outputs: dict[str, str] = {}
    for r in task.roles:
        prompt = task.prompt(problem, r)
        if outputs:
            prompt = _with_note(prompt, _others(outputs, r) + "\n\nWrite your own part so that it fits with theirs.")
        outputs[r] = await ctx.generate(r, prompt)
    return outputs


async def discussion(ctx: EpisodeContext, task: TeamTask, problem: Problem) -> dict[str, str]:
    drafts = await parallel(ctx, task, problem)
    revised = await asyncio.gather(
        *[
            ctx.generate(
                r,
                _with_note(
                    task.prompt(problem, r),
                    f"Your draft:\n{drafts[r]}\n\n{_others(drafts, r)}\n\n"
                    "Revise your part so that the two fit together. Reply with your revised part only.",
                ),
                turn=1,
            )
            for r in task.roles
        ]
    )
    return dict(zip(task.roles, revised))


async def single(ctx: EpisodeContext, task: TeamTask, problem: Problem) -> dict[str, str]:
    text = await ctx.generate(task.roles[0], task.single_prompt(problem))
    return task.split_single(text)


def scored(prompt_team: Callable[[EpisodeContext, TeamTask, Problem], Awaitable[dict[str, str]]]
           ) -> Callable[..., Awaitable[EpisodeOutcome | float]]:
    """``prompt_team`` as a workflow ``run(ctx, task, problem, settings)``: the task's checked reward of the
    joint output is its final team reward (an outcome with the test verdict where the task has ``passed``)."""

    async def run(
        ctx: EpisodeContext, task: TeamTask, problem: Problem, settings: Any = None
    ) -> EpisodeOutcome | float:
        outputs = await prompt_team(ctx, task, problem)
        reward = checked_reward(task.name, f"reward(problem {problem.id!r})", task.reward(problem, outputs))
        return joint_outcome(task, problem, outputs, reward)

    run.__name__ = run.__qualname__ = prompt_team.__name__
    return run
