"""The public extension API: what a user's own team is written against (see docs/extending.md).

- :func:`register_task`, :func:`register_workflow`, :func:`register_reward`: decorators that add
  to the registries :data:`TASKS`, :data:`WORKFLOWS`, :data:`REWARDS` (config values are checked
  against them; ``package.module:object`` in the config works without registering);
- :class:`Task`, :class:`SolveTask`, :class:`Problem`: what a task is built from;
  :class:`EpisodeContext`, :class:`EpisodeOutcome`: what a workflow acts through and returns;
- :func:`openai_workflow`, :func:`external_workflow`: a team written against the ``openai`` package,
  or run by another program over HTTP, trained through the gateway (docs/gateway.md);
- :func:`register_tool_parser`: how a model family writes tool calls (:data:`TOOL_CALL_PARSERS`; the gateway's
  ``workflow.options.tool_parser`` and ``ctx.generate(..., tools=..., tool_parser=...)`` name one), and
  :class:`ToolAnswer`, what ``ctx.generate(..., tools=[...])`` returns;
- :func:`load_plugin`: import a file that registers (what ``teamrl train --plugin FILE`` does);
  installed packages register through entry points in the group ``teamrl.plugins``.
"""

from teamrl.core.registry import ENTRY_POINT_GROUP, Registry, load_plugin
from teamrl.rollout.tool_calls import TOOL_CALL_PARSERS, ToolAnswer
from teamrl.tasks import TASKS, register_task
from teamrl.tasks.solve import SolveTask
from teamrl.tasks.task import Problem, Task
from teamrl.workflows import REWARDS, WORKFLOWS, EpisodeOutcome, Workflow, register_reward, register_workflow
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.openai_workflow import external_workflow, openai_workflow

register_tool_parser = TOOL_CALL_PARSERS.register  # @register_tool_parser("name") on parse(text) -> (content, payloads)

__all__ = [
    "ENTRY_POINT_GROUP",
    "REWARDS",
    "TASKS",
    "TOOL_CALL_PARSERS",
    "WORKFLOWS",
    "EpisodeContext",
    "EpisodeOutcome",
    "Problem",
    "Registry",
    "SolveTask",
    "Task",
    "ToolAnswer",
    "Workflow",
    "external_workflow",
    "load_plugin",
    "openai_workflow",
    "register_reward",
    "register_task",
    "register_tool_parser",
    "register_workflow",
]
