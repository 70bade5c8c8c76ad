"""Workflows: roles and their turn structure, written as plain Python against :class:`EpisodeContext`.

``WORKFLOWS`` names the workflows of the workflow study, which run on a
:class:`~teamrl.tasks.solve.SolveTask` and return an :class:`EpisodeOutcome`: ``single`` (the
single-agent RL baseline), ``eval_opt``, ``voting`` and ``orch_workers``. Each entry gives the
episode function and its role types (instances such as ``generator0`` share their type's policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from teamrl.workflows.eval_opt import eval_opt
from teamrl.workflows.orch_workers import orch_workers
from teamrl.workflows.outcome import EpisodeOutcome, WorkflowSettings
from teamrl.workflows.single_agent import single_solve
from teamrl.workflows.voting import voting


@dataclass(frozen=True)
class Workflow:
    """A study workflow: its episode coroutine and the role types it uses."""

    run: Callable[..., Awaitable[EpisodeOutcome]]
    role_types: tuple[str, ...]


WORKFLOWS: dict[str, Workflow] = {
    "single": Workflow(single_solve, ("agent",)),
    "eval_opt": Workflow(eval_opt, ("generator", "evaluator")),
    "voting": Workflow(voting, ("generator", "aggregator")),
    "orch_workers": Workflow(orch_workers, ("orchestrator", "worker", "synthesizer")),
}

__all__ = ["WORKFLOWS", "EpisodeOutcome", "Workflow", "WorkflowSettings"]
