"""Data sets, environments and verifiers. ``make_task`` builds one from its config mapping."""

from __future__ import annotations

from typing import Any

from teamrl.core.config import ConfigError, build_dataclass
from teamrl.tasks.code_team import CodeHelperMain
from teamrl.tasks.code_env import CodeEnv
from teamrl.tasks.code_tester import CoderTester
from teamrl.tasks.environment import Environment
from teamrl.tasks.math_env import MathEnv
from teamrl.tasks.plan_path import PlanPath
from teamrl.tasks.research import ResearchEnv
from teamrl.tasks.sokoban import Sokoban
from teamrl.tasks.solve import CodeSolve, MathSolve
from teamrl.tasks.sudoku import Sudoku
from teamrl.tasks.task import Problem, Task, TeamTask
from teamrl.tasks.word_count import WordCountTask
from teamrl.tasks.writing import WritingExpand, WritingTLDR

TASKS: dict[str, type[Task] | type[TeamTask] | type[Environment] | type[ResearchEnv]] = {
    WordCountTask.name: WordCountTask,
    WritingTLDR.name: WritingTLDR,
    WritingExpand.name: WritingExpand,
    CodeHelperMain.name: CodeHelperMain,
    CoderTester.name: CoderTester,
    PlanPath.name: PlanPath,
    Sokoban.name: Sokoban,
    Sudoku.name: Sudoku,
    MathEnv.name: MathEnv,
    CodeEnv.name: CodeEnv,
    MathSolve.name: MathSolve,
    CodeSolve.name: CodeSolve,
    ResearchEnv.name: ResearchEnv,
}


def make_task(options: dict[str, Any]) -> Task | TeamTask | Environment | ResearchEnv:
    """Build the task named ``options["name"]``, validating its options like the rest of the config."""
    name = options.get("name")
    if name not in TASKS:
        raise ConfigError(f"task.name: {name!r} is not a known task; choose one of {sorted(TASKS)}")
    cls = TASKS[name]
    return cls(build_dataclass(cls.Options, options, "task."))


__all__ = ["TASKS", "Environment", "Problem", "ResearchEnv", "Task", "TeamTask", "make_task"]
