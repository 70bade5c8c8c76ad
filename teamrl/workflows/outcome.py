"""What a study workflow returns, and the options every study workflow reads."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from teamrl.core.config import option
from teamrl.core.sample import Sample


@dataclass(frozen=True)
class StudyOptions:
    """The options of the study workflows (``workflow.options`` of ``eval_opt``, ``voting``, ``orch_workers``).

    ``max_iterations`` 0 means the task's default: 3 generator attempts for math, 2 for code.
    """

    max_iterations: int = option(0, ge=0, doc="Eval-Opt generator attempts; 0: 3 for math, 2 for code")
    num_generators: int = option(3, ge=2, doc="Voting generators")
    max_subtasks: int = option(3, ge=1, doc="Orch-Workers plan limit; a longer plan gets reward 0")

    def iterations_for(self, task_name: str) -> int:
        if self.max_iterations:
            return self.max_iterations
        return 2 if task_name.startswith("code") else 3


# A workflow's warm-start demonstration: (role type, the prompt's messages, the reply to learn).
DemoRow = tuple[str, list[dict[str, str]], str]


def solved_reply(task: Any, problem: Any) -> str | None:
    """The task's own demonstration reply for ``problem`` (its ``demonstrations`` hook's first row); None without
    one."""
    hook = getattr(task, "demonstrations", None)
    rows = hook(problem) if hook is not None else []
    return rows[0][2] if rows else None


def wrong_reply(reply: str, answer: Any, offset: int) -> str | None:
    """``reply`` (a solved reply stating ``answer``) with that integer answer moved by ``offset`` wherever the reply
    states it (``= 7``, ``Answer: 7``): a plausible wrong candidate for a demonstration. None when the answer is not
    an integer or the reply does not state it."""
    try:
        value = int(str(answer).strip())
    except ValueError:
        return None
    wrong = reply
    for form in ("= {}", "Answer: {}"):
        wrong = re.sub(re.escape(form.format(value)) + r"(?!\d)", form.format(value + offset), wrong)
    return wrong if wrong != reply else None


@dataclass
class EpisodeOutcome:
    """One episode of a workflow: its final text and answer, whether that answer is correct,
    and the workflow's own statistics (verdicts, votes, plans) for the diagnostics.

    Samples that earn a per-role reward carry it (``sample.role_reward``, read by :func:`own_reward`; set it
    directly, or report
    it with ``ctx.reward(value, role=...)``); the algorithm uses it when ``workflow.reward`` is
    ``per_role``. ``team_reward``: the final team reward, when it is not 1/0 by correctness.
    """

    final_text: str
    answer: str | None
    correct: bool
    stats: dict[str, Any] = field(default_factory=dict)
    team_reward: float | None = None

    @property
    def reward(self) -> float:
        """The final team reward: ``team_reward`` if set, else 1 for a correct final answer and 0 otherwise."""
        if self.team_reward is not None:
            return float(self.team_reward)
        return 1.0 if self.correct else 0.0


#: A workflow's summary of a batch of its episodes' outcomes: metric name -> number (``Workflow.summary``).
Summary = Callable[[Sequence[EpisodeOutcome]], Mapping[str, float]]


def stat_means(outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """The mean of every ``stats`` entry that is a finite number (or a boolean) in every outcome: what
    ``teamrl eval`` shows for a workflow that registers no summary (text entries cannot be averaged)."""
    out: dict[str, float] = {}
    for k in dict.fromkeys(k for o in outcomes for k in o.stats):
        values = [o.stats.get(k) for o in outcomes]
        if all(isinstance(v, (bool, int, float)) and math.isfinite(v) for v in values):
            out[k] = sum(float(v) for v in values) / len(values)
    return out


def own_reward(sample: Sample) -> float | None:
    """A sample's own (per-role) reward, None where its workflow gave it none: the one place that reads it."""
    return None if sample.role_reward is None else float(sample.role_reward)


def set_own_reward(sample: Sample, value: float) -> None:
    """Set a sample's own (per-role) reward: the one place that writes it (besides workflows that set the field)."""
    sample.role_reward = float(value)
