"""The public extension API: what a user's own team is written against (see docs/extending.md).

- :func:`register_task`, :func:`register_workflow`, :func:`register_reward`: decorators that add
  to the registries :data:`TASKS`, :data:`WORKFLOWS`, :data:`REWARDS` (config values are checked
  against them; ``package.module:object`` in the config works without registering);
- :class:`Task`, :class:`SolveTask`, :class:`Problem`: what a task is built from;
  :class:`EpisodeContext`, :class:`EpisodeOutcome`: what a workflow acts through and returns;
- :func:`openai_workflow`, :func:`external_workflow`: a team written against the ``openai`` package,
  or run by another program over HTTP, trained through the gateway (docs/gateway.md);
- :func:`load_plugin`: import a file that registers (what ``teamrl train --plugin FILE`` does);
  installed packages register through entry points in the group ``teamrl.plugins``.
"""

from teamrl.core.registry import ENTRY_POINT_GROUP, Registry, load_plugin
from teamrl.tasks import TASKS, register_task
from teamrl.tasks.solve import SolveTask
from teamrl.tasks.task import Problem, Task
from teamrl.workflows import REWARDS, WORKFLOWS, EpisodeOutcome, Workflow, register_reward, register_workflow
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.openai_workflow import external_workflow, openai_workflow

__all__ = [
    "ENTRY_POINT_GROUP",
    "REWARDS",
    "TASKS",
    "WORKFLOWS",
    "EpisodeContext",
    "EpisodeOutcome",
    "Problem",
    "Registry",
    "SolveTask",
    "Task",
    "Workflow",
    "external_workflow",
    "load_plugin",
    "openai_workflow",
    "register_reward",
    "register_task",
    "register_workflow",
]
