"""Workflows: roles and their turn structure, written as plain Python against :class:`EpisodeContext`.

``WORKFLOWS`` is a :class:`~teamrl.core.registry.Registry` of the workflows that run on a
:class:`~teamrl.tasks.solve.SolveTask` and return an :class:`EpisodeOutcome`. Shipped:
``single`` (the single-agent RL baseline), ``eval_opt``, ``voting`` and ``orch_workers``; add
your own with ``@register_workflow("name", roles=(...))``. Each entry gives the episode function
and its role types (instances such as ``generator0`` share their type's policy).

``REWARDS`` holds how an episode's outcome becomes each sample's reward (``workflow.reward``):
``outcome`` and ``per_role`` are shipped; add your own with ``@register_reward("name")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from teamrl.core.config import ConfigError
from teamrl.core.registry import Registry
from teamrl.core.sample import Sample
from teamrl.workflows.eval_opt import eval_opt
from teamrl.workflows.orch_workers import orch_workers
from teamrl.workflows.outcome import EpisodeOutcome, WorkflowSettings, own_reward
from teamrl.workflows.single_agent import single_solve
from teamrl.workflows.voting import voting


@dataclass(frozen=True)
class Workflow:
    """A workflow: its episode coroutine ``run(ctx, task, problem, settings)`` and the role types it uses.

    ``options``: the workflow's own options dataclass; ``workflow.options`` in the config is
    validated against it and passed as ``settings``. Without one, ``settings`` is the shipped
    :class:`WorkflowSettings` (``workflow.max_iterations``, ``num_generators``, ``max_subtasks``).
    """

    run: Callable[..., Awaitable[EpisodeOutcome]]
    role_types: tuple[str, ...]
    options: type | None = None


def _workflow(obj: Any) -> Workflow:
    """What a ``workflow.name: package.module:object`` reference names: a Workflow or a decorated function."""
    found = obj if isinstance(obj, Workflow) else getattr(obj, "teamrl_workflow", None)
    if not isinstance(found, Workflow):
        raise ConfigError(f"workflow.name: {obj!r} is not a workflow; decorate the episode function with "
                          "@register_workflow(name, roles=(...))")
    return found


WORKFLOWS: Registry[Workflow] = Registry("workflow", convert=_workflow)
WORKFLOWS.register("single", Workflow(single_solve, ("agent",)))
WORKFLOWS.register("eval_opt", Workflow(eval_opt, ("generator", "evaluator")))
WORKFLOWS.register("voting", Workflow(voting, ("generator", "aggregator")))
WORKFLOWS.register("orch_workers", Workflow(orch_workers, ("orchestrator", "worker", "synthesizer")))


def register_workflow(name: str, roles: tuple[str, ...], options: type | None = None) -> Callable:
    """Decorator: register an ``async def run(ctx, task, problem, settings) -> EpisodeOutcome`` as
    ``workflow.name: <name>`` with its role types (and its options dataclass, if it has one).
    The function is returned unchanged, with the :class:`Workflow` in ``fn.teamrl_workflow``."""
    if isinstance(roles, str) or not roles or not all(isinstance(r, str) and r for r in roles):
        raise ConfigError(f"register_workflow {name!r}: roles must be a tuple of role names, got {roles!r}")

    def add(fn: Callable[..., Awaitable[EpisodeOutcome]]) -> Callable[..., Awaitable[EpisodeOutcome]]:
        fn.teamrl_workflow = WORKFLOWS.register(name, Workflow(fn, tuple(roles), options))  # type: ignore[attr-defined]
        return fn

    return add


RewardFn = Callable[[Sample, EpisodeOutcome], float]
REWARDS: Registry[RewardFn] = Registry("reward")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(sample, outcome) -> float`` as ``workflow.reward: <name>``."""
    return REWARDS.register(name)


@register_reward("outcome")
def outcome_reward(sample: Sample, outcome: EpisodeOutcome) -> float:
    """Every sample gets the final answer's correctness (1 or 0)."""
    return outcome.reward


@register_reward("per_role")
def per_role_reward(sample: Sample, outcome: EpisodeOutcome) -> float:
    """A sample's own reward where the workflow set one (``tags["role_reward"]``), else the outcome."""
    own = own_reward(sample)
    return own if own is not None else outcome.reward


__all__ = ["REWARDS", "WORKFLOWS", "EpisodeOutcome", "Workflow", "WorkflowSettings", "register_reward",
           "register_workflow"]
