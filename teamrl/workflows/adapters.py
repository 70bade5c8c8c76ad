"""The old episode protocols as workflows: each task kind's default workflow (``default_workflow``).

- ``single``: a one-role :class:`Task`: the agent answers the task's prompt once; the task scores it
  (a :class:`SolveTask`'s episode returns an :class:`EpisodeOutcome`, so the study statistics apply; its
  reward is correctness, 1/0, unless the task overrides ``reward``: then that, e.g. partial credit).
- ``team``: a :class:`TeamTask`: each turn every role generates at once on its local prompt; the
  task's reward of the joint output is a team reward per turn, ``role_rewards`` local rewards; its
  feedback and the history go into the next turn's prompts (``turns`` turns, MAGRPO's ``num_turns``).
- ``env``: an :class:`Environment`: the team reward of the reset state is reported at the start;
  then each turn each role in order generates on its observation (the state before the turn when
  the environment is ``parallel``), its action is applied, its local reward and the team reward's
  change are reported: the team rewards sum to the final state's team reward. The calls are
  sequential even for parallel environments, so that a later role's candidates are applied after
  the earlier role's chosen action (AT-GRPO's semantics).

Both adapters look a replayed step up in ``ctx.memo`` (keyed by the texts so far) instead of
rescoring it, so branching by replay runs each environment step and each reward once per episode.

The research workflows (``research``, ``research_single``) live in :mod:`teamrl.workflows.research_team`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from teamrl.core.config import option
from teamrl.tasks.environment import Environment
from teamrl.tasks.solve import SolveTask
from teamrl.tasks.task import Problem, Task, TeamTask, checked_reward, checked_rewards
from teamrl.workflows.outcome import EpisodeOutcome


async def single(ctx, task: Task, problem: Problem, settings: object = None) -> EpisodeOutcome | float:
    """One answer to the task's prompt: its checked reward. A SolveTask: the outcome by correctness, its
    reward the task's own ``reward`` where the task's class overrides :meth:`SolveTask.reward` (partial credit)."""
    text = await ctx.generate("agent", task.prompt(problem))
    if isinstance(task, SolveTask):
        answer = task.extract(text)
        (correct,) = task.correct_many(problem, [answer])
        own = None
        if type(task).reward is not SolveTask.reward:  # else the reward is correctness itself (1/0)
            own = checked_reward(task.name, f"reward(problem {problem.id!r})", task.reward(problem, text))
        return EpisodeOutcome(text, answer, correct, team_reward=own)
    return checked_reward(task.name, f"reward(problem {problem.id!r})", task.reward(problem, text))


@dataclass
class TeamOptions:
    turns: int = option(1, ge=1, doc="turns of the team (every role acts once per turn); MAGRPO sets magrpo.num_turns")
    pass_at_1: bool = option(False, doc="return whether the last joint answer passes every test (the task's passed() "
                                        "hook: one more test run per episode), as teamrl eval's pass@1 does")


def joint_outcome(
    task: TeamTask,
    problem: Problem,
    outputs: dict[str, str],
    final_reward: float,
    pass_at_1: bool = True,
    memo: Callable[[Callable[[], bool]], bool] = lambda compute: compute(),
) -> EpisodeOutcome | float:
    """What a team episode returns: an :class:`EpisodeOutcome` whose ``correct`` is the task's
    ``passed(problem, outputs)`` where it has that hook (coding tasks) and ``pass_at_1`` asks for it,
    else ``final_reward`` alone (no notion of a fully correct joint answer). ``memo`` computes the
    verdict (a workflow passes ``ctx.memo`` so that replayed copies run the tests once)."""
    passed = getattr(task, "passed", None) if pass_at_1 else None
    if passed is None:
        return final_reward
    return EpisodeOutcome("", None, memo(lambda: bool(passed(problem, outputs))), team_reward=final_reward)


async def team(ctx, task: TeamTask, problem: Problem, settings: TeamOptions) -> EpisodeOutcome | float:
    """Every role at once on its local prompt, ``settings.turns`` times; rewards reported per turn
    (the final team reward is 0; with ``settings.pass_at_1`` the last joint answer's test verdict is the outcome)."""
    history: list[dict[str, str]] = []
    outputs: dict[str, str] = {}
    feedback = ""
    for turn in range(settings.turns):
        texts = await asyncio.gather(
            *[ctx.generate(role, task.prompt(problem, role, turn, history, feedback), turn=turn) for role in task.roles]
        )
        outputs = dict(zip(task.roles, texts))
        history = history + [outputs]
        key = ("team", tuple(tuple(o.values()) for o in history))  # a replayed turn is scored once per episode
        reward, locals_ = ctx.memo(key, lambda: _score_team(task, problem, outputs))
        ctx.reward(reward)
        for role, local in locals_.items():
            ctx.reward(local, role=role)
        if turn + 1 < settings.turns:
            feedback = ctx.memo(key + ("feedback",), lambda: task.feedback(problem, outputs, reward))
    return joint_outcome(task, problem, outputs, 0.0, settings.pass_at_1,
                         memo=lambda compute: ctx.memo(key + ("passed",), compute))


def _score_team(task: TeamTask, problem: Problem, outputs: dict[str, str]) -> tuple[float, dict[str, float]]:
    """The team reward and the roles' local rewards of one joint output, checked."""
    (reward,) = checked_rewards(task.name, f"rewards(problem {problem.id!r})", task.rewards(problem, [outputs]), 1,
                                per="joint action")
    return reward, {role: checked_reward(task.name, f"role_rewards(problem {problem.id!r})[{role!r}]", local)
                    for role, local in task.role_rewards(problem, outputs).items()}


@dataclass
class EnvOptions:
    max_turns: int = option(
        0, ge=0, doc="turns per episode; 0: the environment's max_turns (AT-GRPO sets at_grpo.max_turns)"
    )


async def env(ctx, environment: Environment, problem: Problem, settings: EnvOptions,
              acting: tuple[str, ...] = ()) -> EpisodeOutcome:
    """Roles act in order each turn until done; local rewards and team-reward changes reported as they happen.
    ``acting``: the roles that act (default: all of the environment's)."""
    name = environment.name
    state = environment.reset(problem)
    team_now = checked_reward(name, "team_reward(reset state)", environment.team_reward(state))
    ctx.reward(team_now)
    texts: tuple[str, ...] = ()
    for turn in range(settings.max_turns or environment.max_turns):
        if environment.done(state):
            break
        before = state
        for role in acting or environment.roles:
            text = await ctx.generate(
                role, environment.observe(before if environment.parallel else state, role), turn=turn
            )
            texts += (text,)
            # apply never changes the state it is given, so a step replayed by a branch copy is looked up, not rerun
            state, local, team_new = ctx.memo(("env", texts), lambda: _step(environment, state, role, text))
            ctx.reward(local, role=role)
            ctx.reward(team_new - team_now)
            team_now = team_new
            if environment.done(state):
                break
    # every team reward was reported as it changed: the final team reward is 0
    return EpisodeOutcome("", None, bool(environment.success(state)), stats={"team_reward": team_now}, team_reward=0.0)


async def env_last_role(ctx, environment: Environment, problem: Problem, settings: object = None) -> EpisodeOutcome:
    """The single-agent baseline of an environment: only its last role acts (one agent doing the task alone)."""
    return await env(ctx, environment, problem, EnvOptions(), acting=tuple(environment.roles)[-1:])


def _step(environment: Environment, state: object, role: str, text: str) -> tuple[object, float, float]:
    """(new state, local reward, team reward of the new state) of one action, checked."""
    new_state, local = environment.apply(state, role, text)
    return (new_state, checked_reward(environment.name, f"apply(role {role!r}) local reward", local),
            checked_reward(environment.name, "team_reward", environment.team_reward(new_state)))
