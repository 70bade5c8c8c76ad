"""What every sampler needs to run a workflow's episodes: the workflow, its options, bound episodes."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Sequence

from teamrl.tasks.task import Problem
from teamrl.workflows import WORKFLOWS, Workflow, StudyOptions, default_workflow
from teamrl.workflows.context import Call, EpisodeContext
from teamrl.workflows.episode import Branch, EpisodeFn

# (problem, episode index, tags) -> context
ContextFactory = Callable[[Problem, int, dict], EpisodeContext]


def resolve_workflow(name: str | None, task: Any) -> tuple[str, Workflow]:
    """(name, entry) of the workflow to run: ``name`` when given, else the task's default adapter."""
    chosen = name or default_workflow(task)
    return chosen, WORKFLOWS.get_entry(chosen, "workflow.name")


def workflow_roles(name: str | None) -> tuple[str, ...] | None:
    """The role types of a named workflow (None: no workflow named, or an adapter: the task's roles act)."""
    return (WORKFLOWS.get_entry(name, "workflow.name").role_types or None) if name else None


def workflow_options_or_defaults(spec: Workflow, given: Any = None, **defaults: Any) -> Any:
    """What the workflow's ``run`` receives: ``given``, or its default options: its options dataclass (with those of
    ``defaults`` it declares: how an algorithm passes e.g. ``turns`` to the team adapter) or :class:`StudyOptions`."""
    if given is not None:
        return given
    if spec.options is None:
        return StudyOptions()
    names = {f.name for f in dataclasses.fields(spec.options)}
    return spec.options(**{k: v for k, v in defaults.items() if k in names and v is not None})


def bind(spec: Workflow, task: Any, problem: Problem, options: Any) -> EpisodeFn:
    """The episode of ``problem`` as a function of its context only."""
    return lambda ctx: spec.run(ctx, task, problem, options)


async def play_out(real: EpisodeContext, branch: Branch, tags: dict[str, Any],
                   until: Callable[[Sequence[Call]], bool] = lambda frontier: False) -> list[float]:
    """Play ``branch`` (standing at its frontier) on with one sample per call, until its episode ends or
    ``until(frontier)`` says a step should be branched; return the team reward of each step played.

    Its samples are logged but not trained (one sample has no group to compare it with); they carry
    ``tags`` and ``tags["rollout"] = True``."""
    played: list[float] = []
    while not branch.done and not until(branch.frontier):
        answers = await asyncio.gather(*[real.sample(c.role, c.messages, 1, c.turn, 0, c.params,
                                                     {**c.tags, **tags, "rollout": True}, tools=c.tools)
                                         for c in branch.frontier])
        for (s,) in answers:
            s.trainable = False
            s.group = ("rollout", s.problem_id, tags.get("path", ()))
        branch.resolve(answers)
        await branch.advance()
        played.append(branch.segment_team_reward())
    return played
