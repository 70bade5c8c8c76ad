"""Data sets, environments and verifiers. ``make_task`` builds one from its config mapping.

``TASKS`` is a :class:`~teamrl.core.registry.Registry`: register your own task class with
``@register_task("name")`` (it needs an ``Options`` dataclass, validated like the rest of the
config), or name it in the config as ``task.name: package.module:Class``.
"""

from __future__ import annotations

from typing import Any, Callable

from teamrl.core.config import ConfigError, build_dataclass
from teamrl.core.registry import Registry
from teamrl.tasks.code_team import CodeHelperMain
from teamrl.tasks.code_env import CodeEnv
from teamrl.tasks.code_tester import CoderTester
from teamrl.tasks.environment import Environment
from teamrl.tasks.math_env import MathEnv
from teamrl.tasks.plan_path import PlanPath
from teamrl.tasks.research import ResearchEnv
from teamrl.tasks.reverse_text import ReverseText, ReverseTextTeam
from teamrl.tasks.sokoban import Sokoban
from teamrl.tasks.solve import CodeSolve, MathSolve
from teamrl.tasks.sudoku import Sudoku
from teamrl.tasks.task import Problem, Task, TeamTask
from teamrl.tasks.word_count import WordCountTask
from teamrl.tasks.writing import WritingExpand, WritingTLDR

TaskClass = type[Task] | type[TeamTask] | type[Environment] | type[ResearchEnv]


def _task_class(obj: Any) -> TaskClass:
    """What a ``task.name: package.module:Class`` reference names must be a task class with ``Options``."""
    if not isinstance(obj, type) or not hasattr(obj, "Options"):
        raise ConfigError(f"task.name: {obj!r} is not a task class (a class with an Options dataclass)")
    return obj


TASKS: Registry[TaskClass] = Registry("task", convert=_task_class)
for _cls in (WordCountTask, WritingTLDR, WritingExpand, CodeHelperMain, CoderTester, PlanPath, Sokoban, Sudoku, MathEnv,
             CodeEnv, MathSolve, CodeSolve, ResearchEnv, ReverseText,
             ReverseTextTeam):
    TASKS.register(_cls.name, _cls)


def register_task(name: str) -> Callable[[TaskClass], TaskClass]:
    """Class decorator: register a task class as ``task.name: <name>`` (sets its ``name``)."""
    def add(cls: TaskClass) -> TaskClass:
        _task_class(cls)
        cls.name = name
        return TASKS.register(name)(cls)

    return add


def make_task(options: dict[str, Any]) -> Task | TeamTask | Environment | ResearchEnv:
    """Build the task named ``options["name"]``, validating its options like the rest of the config."""
    cls = TASKS.get_entry(options.get("name"), "task.name")
    return cls(build_dataclass(cls.Options, options, "task."))


__all__ = ["TASKS", "register_task", "Environment", "Problem", "ResearchEnv", "Task", "TeamTask", "make_task"]
