"""Orch-Workers: an orchestrator splits the problem, workers solve the parts, a synthesizer answers.

Turn structure:

1. ``orchestrator`` sees the problem and writes a plan of at most ``workflow.options.max_subtasks``
   (default 3) subtasks, one per line: ``Subtask 1: ...`` (numbered lines ``1. ...`` are read
   too);
2. ``worker0 .. worker{k-1}`` each solve one subtask, in parallel, **without** seeing the
   original problem;
3. ``synthesizer`` sees the problem and the workers' outputs and writes the final answer.

A plan with more subtasks than the limit ends the episode with reward 0 (no worker or
synthesizer runs; ``stats["over_limit"]``). A plan with no readable subtask goes straight to the
synthesizer with no worker outputs (``stats["subtasks"] == 0``). Every sample gets the
final-outcome reward (there is no per-role reward in this workflow).
"""

from __future__ import annotations

import asyncio
import re
from typing import Sequence

from teamrl.tasks.solve import SolveTask
from teamrl.tasks.task import Problem
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.outcome import EpisodeOutcome, StudyOptions

ROLE_TYPES = ("orchestrator", "worker", "synthesizer")
WORKER_CHARS = 800  # of each worker output shown to the synthesizer
_SUBTASK = re.compile(r"(?im)^[\s*#>-]*(?:sub-?task|step|task)\s*\d+\s*[:.)\-]\s*(.+?)\s*$")
_NUMBERED = re.compile(r"(?m)^\s*\d+\s*[.)]\s+(.+?)\s*$")


def parse_plan(text: str) -> list[str]:
    """The subtasks of a plan: ``Subtask k: ...`` lines, else numbered ``k. ...`` lines."""
    found = [s for s in _SUBTASK.findall(text) if s.strip()]
    if not found:
        found = [s for s in _NUMBERED.findall(text) if s.strip()]
    return found


def plan_readable(text: str) -> bool:
    """Whether an orchestrator reply is in its format (``teamrl eval``'s valid replies): a plan of subtasks."""
    return bool(parse_plan(text))


#: the orchestrator writes a plan, a worker free text (not judged); the synthesizer gives the task's answer
FORMATS = {"orchestrator": plan_readable, "worker": None}


def orchestrator_prompt(task: SolveTask, problem: Problem, max_subtasks: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": (
        f"{task.question(problem)}\n\nYou lead a team. Split this problem into at most {max_subtasks} subtasks that "
        "helpers can solve without seeing the problem, so write each subtask with every number it needs. "
        "Write one per line as `Subtask 1: ...`, `Subtask 2: ...`. Do not solve the problem.")}]


def worker_prompt(subtask: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Solve this task and state the result briefly.\n\nTask: {subtask}"}]


def synthesizer_prompt(
    task: SolveTask, problem: Problem, subtasks: list[str], outputs: list[str]
) -> list[dict[str, str]]:
    done = "\n\n".join(
        f"Subtask {i + 1}: {s}\nHelper's result:\n{o[:WORKER_CHARS]}" for i, (s, o) in enumerate(zip(subtasks, outputs))
    )
    parts = [task.question(problem)]
    parts.append(f"Your helpers' work:\n\n{done}" if done else "Your helpers produced nothing usable.")
    parts.append(task.answer_instruction)
    return [{"role": "user", "content": "\n\n".join(parts)}]


async def orch_workers(
    ctx: EpisodeContext, task: SolveTask, problem: Problem, settings: StudyOptions
) -> EpisodeOutcome:
    """Run one Orch-Workers episode; see the module docstring."""
    plan = await ctx.generate("orchestrator", orchestrator_prompt(task, problem, settings.max_subtasks), turn=0)
    subtasks = parse_plan(plan)
    if len(subtasks) > settings.max_subtasks:
        return EpisodeOutcome(plan, None, False, stats={"subtasks": len(subtasks), "over_limit": True})
    outputs = list(
        await asyncio.gather(*[ctx.generate(f"worker{i}", worker_prompt(s), turn=1) for i, s in enumerate(subtasks)])
    )
    final = await ctx.generate("synthesizer", synthesizer_prompt(task, problem, subtasks, outputs), turn=2)
    answer = task.extract(final)
    (correct,) = task.correct_many(problem, [answer])
    return EpisodeOutcome(final, answer, correct, stats={"subtasks": len(subtasks), "over_limit": False})


def summary(outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """Orch-Workers' statistics over ``outcomes`` (registered as its ``Workflow.summary``): subtasks
    per plan and the share of plans over ``max_subtasks``."""
    n = len(outcomes)
    return {"orch/subtasks_mean": sum(o.stats["subtasks"] for o in outcomes) / n,
            "orch/over_limit": sum(o.stats["over_limit"] for o in outcomes) / n}
