"""Workflows written against the OpenAI API, trained through the gateway (:mod:`teamrl.rollout.gateway`).

``@openai_workflow("name", roles=(...))`` turns a plain function ``episode(problem, client)``
(sync or async) into a workflow: each episode starts the function (sync code in a worker thread)
with an ``openai.OpenAI`` client (``openai.AsyncOpenAI`` for an ``async def``) whose base URL is
that episode's gateway URL; every ``client.chat.completions.create(model=<role>, ...)`` becomes a
Sample of the role. The function returns the episode's reward: a number (the team's) or
``{"reward": number, "roles": {role: number}, "correct": bool}``; per-role rewards reach the
role's samples under ``workflow.reward: per_role``.

``external_workflow("name", roles=(...))`` registers a workflow whose episodes are run by other
programs over HTTP: each waits until a client claims it (``POST /episodes``; the answer carries the
episode's token), calls the endpoint and posts the reward (``POST /episodes/<id>/reward``), both
with that token.

``problem`` is a dict: ``{"id", "question", "answer_instruction", "data"}`` (in external mode,
JSON: values that are not JSON become strings).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from teamrl.core.config import InputError
from teamrl.policies.router import role_type
from teamrl.rollout.asgi import RequestError
from teamrl.rollout.gateway import Gateway, GatewayOptions, parse_reward, shared_gateway
from teamrl.tasks.solve import SolveTask
from teamrl.tasks.task import Problem
from teamrl.workflows import register_workflow
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.outcome import EpisodeOutcome


@dataclass
class GatewayOutcome(EpisodeOutcome):
    """An OpenAI-API episode's outcome: the reward it reported (``stats["dropped"]``: none in time)."""

    team_reward: float = 0.0

    @property
    def reward(self) -> float:
        return self.team_reward


_EXECUTORS: dict[int, ThreadPoolExecutor] = {}


def _executor(workers: int) -> ThreadPoolExecutor:
    """Threads for sync episode functions (asyncio's default pool is far smaller than a rollout)."""
    if workers not in _EXECUTORS:
        _EXECUTORS[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="teamrl-episode")
    return _EXECUTORS[workers]


def problem_view(task: SolveTask, problem: Problem, json_safe: bool = False) -> dict[str, Any]:
    """What an episode function (or an external client) is given about ``problem``."""
    view = {"id": problem.id, "question": task.question(problem), "answer_instruction": task.answer_instruction,
            "data": problem.data}
    return json.loads(json.dumps(view, default=str)) if json_safe else view


async def run_gateway_episode(name: str, episode_fn: Callable | None, roles: tuple[str, ...], ctx: EpisodeContext,
                              task: SolveTask, problem: Problem, opts: GatewayOptions,
                              gateway: Gateway | None = None) -> GatewayOutcome:
    """One episode through the gateway: open it, run the function (or wait for an external client's
    reward) within ``reward_timeout_s``, then put the answered calls' Samples into ``ctx.samples``."""
    gw = gateway or shared_gateway(opts)
    external = episode_fn is None
    view = problem_view(task, problem, json_safe=external)
    ep = gw.open_episode(ctx, roles, view, external=external)
    dropped, value, client = False, None, None
    try:
        if external:
            value = await asyncio.wait_for(ep.reward, opts.reward_timeout_s)
        else:
            import openai

            # the episode's own token opens its routes; with a gateway token, that is the api_key (so a call
            # after the episode closed gets the gateway's 410, not a 401)
            kwargs = dict(base_url=gw.episode_url(ep), api_key=opts.token or ep.token, timeout=opts.reward_timeout_s,
                          default_headers={"X-Episode-Token": ep.token})
            if inspect.iscoroutinefunction(episode_fn):
                client = openai.AsyncOpenAI(**kwargs)
                value = await asyncio.wait_for(episode_fn(view, client), opts.reward_timeout_s)
            else:
                client = openai.OpenAI(**kwargs)
                running = _executor(opts.max_episodes).submit(episode_fn, view, client)
                value = await asyncio.wait_for(asyncio.wrap_future(running), opts.reward_timeout_s)
    except asyncio.TimeoutError:
        dropped = True
    except BaseException:
        gw.finish_episode(ep, dropped=True)
        raise
    samples = gw.finish_episode(ep, dropped)
    if client is not None and inspect.iscoroutinefunction(episode_fn):
        # here, in the loop its connections belong to (wait_for cancelled a dropped episode's coroutine): left to the
        # garbage collector, they were torn down after the loop closed ("Event loop is closed")
        await client.close()
    elif client is not None and not dropped:
        client.close()  # a dropped episode's thread may still use it: its calls get a 410
    if dropped:
        return GatewayOutcome("", None, False, {"dropped": True, "calls": 0, **call_stats([])})
    if external:
        team, per_role, correct = value
    else:
        try:
            team, per_role, correct = parse_reward(value, roles)
        except RequestError as e:
            raise InputError(f"workflow {name!r}: the episode function returned {value!r}; {e.message}") from None
    for s in samples:
        own = per_role.get(s.role, per_role.get(role_type(s.role)))
        if own is not None:
            s.role_reward = own
    ctx.samples += samples
    return GatewayOutcome("", None, team > 0 if correct is None else correct,
                          {"dropped": False, "calls": len(samples), **call_stats(samples)}, team_reward=team)


CALL_STATS = ("tool_calls", "tool_calls_malformed", "prefix_breaks")


def call_stats(samples: list) -> dict[str, int]:
    """An episode's answers returned as tool calls, those whose tool-call text was malformed (returned as text) and
    its calls whose prompt broke the agent's previous turn (the gateway's tags on each Sample)."""
    return {"tool_calls": sum(bool(s.tags.get("tool_calls")) for s in samples),
            "tool_calls_malformed": sum("tool_call_errors" in s.tags for s in samples),
            "prefix_breaks": sum("prefix_break" in s.tags for s in samples)}


def gateway_summary(outcomes: list) -> dict[str, float]:
    """A step's gateway counts (metrics ``tool_calls``, ``tool_calls_malformed``, ``prefix_breaks``): sums over its
    episodes."""
    return {k: float(sum(o.stats.get(k, 0) for o in outcomes)) for k in CALL_STATS}


def openai_workflow(name: str, roles: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """Decorator: register ``episode(problem, client) -> reward`` (sync or async, written against the
    ``openai`` package) as ``workflow.name: <name>`` with its roles (each role a ``model`` name).
    Its options (``workflow.options``) are :class:`~teamrl.rollout.gateway.GatewayOptions`."""

    def add(episode_fn: Callable) -> Callable:
        async def run(
            ctx: EpisodeContext, task: SolveTask, problem: Problem, settings: GatewayOptions
        ) -> GatewayOutcome:
            return await run_gateway_episode(name, episode_fn, tuple(roles), ctx, task, problem, settings)

        register_workflow(name, roles, options=GatewayOptions, replayable=False, summary=gateway_summary)(run)
        episode_fn.teamrl_workflow = run.teamrl_workflow  # type: ignore[attr-defined]
        return episode_fn

    return add


def external_workflow(name: str, roles: tuple[str, ...]) -> Any:
    """Register ``workflow.name: <name>``: episodes run by other programs over HTTP (see the module docstring)."""

    async def run(ctx: EpisodeContext, task: SolveTask, problem: Problem, settings: GatewayOptions) -> GatewayOutcome:
        return await run_gateway_episode(name, None, tuple(roles), ctx, task, problem, settings)

    register_workflow(name, roles, options=GatewayOptions, replayable=False, summary=gateway_summary)(run)
    return run.teamrl_workflow
