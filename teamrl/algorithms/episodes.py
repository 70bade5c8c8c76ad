"""What every sampler needs to run a workflow's episodes: the workflow, its settings, bound episodes."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from teamrl.tasks.task import Problem
from teamrl.workflows import WORKFLOWS, Workflow, WorkflowSettings, default_workflow
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.episode import EpisodeFn

# (problem, episode index, tags) -> context
ContextFactory = Callable[[Problem, int, dict], EpisodeContext]


def resolve_workflow(name: str | None, task: Any) -> tuple[str, Workflow]:
    """(name, entry) of the workflow to run: ``name`` when given, else the task's default adapter."""
    chosen = name or default_workflow(task)
    return chosen, WORKFLOWS.get_entry(chosen, "workflow.name")


def workflow_roles(name: str | None) -> tuple[str, ...] | None:
    """The role types of a named workflow (None: no workflow named, or an adapter: the task's roles act)."""
    return (WORKFLOWS.get_entry(name, "workflow.name").role_types or None) if name else None


def workflow_settings(spec: Workflow, given: Any = None, **defaults: Any) -> Any:
    """``given``, or the workflow's default settings: its options dataclass (with those of ``defaults``
    it declares: how an algorithm passes e.g. ``turns`` to the team adapter) or :class:`WorkflowSettings`."""
    if given is not None:
        return given
    if spec.options is None:
        return WorkflowSettings()
    names = {f.name for f in dataclasses.fields(spec.options)}
    return spec.options(**{k: v for k, v in defaults.items() if k in names and v is not None})


def bind(spec: Workflow, task: Any, problem: Problem, settings: Any) -> EpisodeFn:
    """The episode of ``problem`` as a function of its context only."""
    return lambda ctx: spec.run(ctx, task, problem, settings)
