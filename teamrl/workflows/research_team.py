"""The research episode: a main agent that delegates to a tool-using sub-agent (M-GRPO), or one agent with the tools.

Team: the main agent replies with ``<subtask>`` or ``<answer>``. A subtask opens a nested
sub-agent episode (its tool loop, up to ``max_sub_turns`` replies) whose ``<result>`` comes back
to the main agent as an observation. Every sub-agent sample carries its parent's ids in its
tags (``parent_episode``: the main rollout's episode index; ``call``: which call of that
rollout), so the main outcome can flow down to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from teamrl.tasks.research import RESULT_CHARS, ResearchEnv
from teamrl.tasks.task import Problem
from teamrl.tasks.tool_planner import truncate
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.outcome import EpisodeOutcome


@dataclass
class SubCall:
    """One sub-agent call: its subtask, result (None: it never returned one) and format validity."""

    subtask: str
    result: str | None
    format_valid: bool
    turns: int


@dataclass
class ResearchOutcome:
    """How one rollout ended: the final answer (None: none given), whether every main reply was
    well-formed, the main reward, and the sub-agent calls in order."""

    answer: str | None
    valid: bool
    reward: float
    correct: bool
    calls: list[SubCall] = field(default_factory=list)


async def sub_agent(ctx: EpisodeContext, env: ResearchEnv, problem: Problem, subtask: str, call: int) -> SubCall:
    """One nested sub-agent episode: the tool loop until ``<result>`` or the turn limit."""
    messages = env.sub_prompt(problem, subtask)
    valid = True
    sub = ctx.sub_episode("sub")  # tags its samples with parent_episode and call (its slot: == ``call``)
    for turn in range(env.opts.max_sub_turns):
        (s,) = await sub.generate_group("sub", messages, n=1, turn=turn)
        valid = valid and env.sub_well_formed(s.text)
        action = env.parse_sub(s.text)
        if action.kind == "result":
            return SubCall(subtask, action.arg, valid, turn + 1)
        if action.kind == "invalid":
            return SubCall(subtask, None, False, turn + 1)
        observation = env.run_tool(action)
        messages = messages + [{"role": "assistant", "content": s.text},
                               {"role": "user", "content": f"Tool output:\n{observation}"}]
    return SubCall(subtask, None, False, env.opts.max_sub_turns)  # out of turns without a result


async def research_team(ctx: EpisodeContext, env: ResearchEnv, problem: Problem) -> ResearchOutcome:
    """Main turns with nested sub-agent calls; returns the rollout's outcome (main reward included)."""
    messages = env.main_prompt(problem)
    calls: list[SubCall] = []
    for turn in range(env.opts.max_sub_calls + 1):
        text = await ctx.generate("main", messages, turn=turn)
        action = env.parse_main(text)
        if action.kind == "answer":
            return _outcome(env, problem, action.arg, True, calls)
        if action.kind != "subtask" or len(calls) >= env.opts.max_sub_calls:
            return _outcome(env, problem, None, False, calls)  # no action, or a call over the limit
        call = await sub_agent(ctx, env, problem, action.arg, len(calls))
        calls.append(call)
        shown = truncate(call.result, RESULT_CHARS) if call.result is not None else "(the helper returned no result)"
        messages = messages + [{"role": "assistant", "content": text},
                               {"role": "user", "content": f"Helper result: {shown}"}]
    return _outcome(env, problem, None, False, calls)


async def research_single(ctx: EpisodeContext, env: ResearchEnv, problem: Problem) -> ResearchOutcome:
    """The single-agent baseline: the ``main`` agent uses the tools itself and answers."""
    messages = env.single_prompt(problem)
    for turn in range(env.opts.max_sub_turns):
        text = await ctx.generate("main", messages, turn=turn)
        action = env.parse_single(text)
        if action.kind == "answer":
            return _outcome(env, problem, action.arg, True, [])
        if action.kind == "invalid":
            break
        messages = messages + [{"role": "assistant", "content": text},
                               {"role": "user", "content": f"Tool output:\n{env.run_tool(action)}"}]
    return _outcome(env, problem, None, False, [])


async def research(ctx: EpisodeContext, env: ResearchEnv, problem: Problem, settings: object = None) -> EpisodeOutcome:
    """Workflow ``research``: :func:`research_team` in the episode protocol (final team reward: the main reward)."""
    return as_episode_outcome(await research_team(ctx, env, problem))


async def research_solo(
    ctx: EpisodeContext, env: ResearchEnv, problem: Problem, settings: object = None
) -> EpisodeOutcome:
    """Workflow ``research_single``: :func:`research_single` in the episode protocol."""
    return as_episode_outcome(await research_single(ctx, env, problem))


def as_episode_outcome(res: ResearchOutcome) -> EpisodeOutcome:
    """A research rollout's outcome as an :class:`EpisodeOutcome` (``stats``: ``valid`` and the ``calls``)."""
    return EpisodeOutcome(
        "", res.answer, res.correct, stats={"valid": res.valid, "calls": res.calls}, team_reward=res.reward
    )


def _outcome(
    env: ResearchEnv, problem: Problem, answer: str | None, valid: bool, calls: list[SubCall]
) -> ResearchOutcome:
    return ResearchOutcome(answer, valid, env.main_reward(problem, answer, valid), env.correct(problem, answer), calls)
