"""Playing an environment once, one completion per step (evaluation of AT-GRPO teams)."""

from __future__ import annotations

from typing import Any, Sequence

from teamrl.tasks.environment import Environment
from teamrl.tasks.task import Problem
from teamrl.workflows.context import EpisodeContext


async def play(ctx: EpisodeContext, env: Environment, problem: Problem, roles: Sequence[str] | None = None,
               max_turns: int | None = None) -> Any:
    """Run one episode with ``roles`` acting in order each turn (default: all); return the final state."""
    acting = list(roles or env.roles)
    state = env.reset(problem)
    for turn in range(max_turns or env.max_turns):
        if env.done(state):
            break
        base = state
        for role in acting:
            text = await ctx.generate(role, env.observe(base if env.parallel else state, role), turn=turn)
            state, _ = env.apply(state, role, text)
            if env.done(state):
                break
    return state
