"""Data sets, environments and verifiers. ``make_task`` builds one from its config mapping."""

from __future__ import annotations

from typing import Any

from teamrl.core.config import ConfigError, build_dataclass
from teamrl.tasks.task import Problem, Task
from teamrl.tasks.word_count import WordCountTask

TASKS: dict[str, type[Task]] = {WordCountTask.name: WordCountTask}


def make_task(options: dict[str, Any]) -> Task:
    """Build the task named ``options["name"]``, validating its options like the rest of the config."""
    name = options.get("name")
    if name not in TASKS:
        raise ConfigError(f"task.name: {name!r} is not a known task; choose one of {sorted(TASKS)}")
    cls = TASKS[name]
    return cls(build_dataclass(cls.Options, options, "task."))


__all__ = ["TASKS", "Problem", "Task", "make_task"]
