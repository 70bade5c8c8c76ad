"""What a study workflow returns, and the settings every study workflow reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkflowSettings:
    """Limits of the study workflows (the ``workflow`` config section).

    ``max_iterations`` 0 means the task's default: 3 generator attempts for math, 2 for code.
    """

    max_iterations: int = 0
    num_generators: int = 3
    max_subtasks: int = 3

    def iterations_for(self, task_name: str) -> int:
        if self.max_iterations:
            return self.max_iterations
        return 2 if task_name.startswith("code") else 3


@dataclass
class EpisodeOutcome:
    """One episode of a workflow: its final text and answer, whether that answer is correct,
    and the workflow's own statistics (verdicts, votes, plans) for the diagnostics.

    Samples that earn a per-role reward carry it in ``sample.role_reward``; the
    algorithm uses it when ``workflow.reward`` is ``per_role``.
    """

    final_text: str
    answer: str | None
    correct: bool
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def reward(self) -> float:
        """The final-outcome reward: 1 for a correct final answer, else 0."""
        return 1.0 if self.correct else 0.0
