"""Eval-Opt: a generator answers, an evaluator judges, the generator revises until judged correct.

Turn structure (iteration ``i`` = turn ``i``):

1. ``generator`` answers the problem (from iteration 2 on: its previous answer, the critique,
   and the instruction to solve it again with a different method);
2. unless this was the last allowed attempt, ``evaluator`` sees the problem and the answer and
   replies ``Verdict: Correct`` or ``Verdict: Incorrect`` with a short critique;
3. a ``Correct`` verdict ends the episode; anything else (``Incorrect``, or no readable
   verdict) sends the critique back to the generator.

The final answer is the last generation. The last attempt is not evaluated: no verdict could
change the outcome. The critique must not reveal an answer: lines that state one (``Answer:``,
``\\boxed{}``) and code blocks are removed before the generator sees it.

Per-role reward (``workflow.reward: per_role``): an evaluator sample gets 1 when its verdict
matches the truth of the answer it judged (an unreadable verdict counts as ``Incorrect``);
generator samples get the final outcome.
"""

from __future__ import annotations

import re
from typing import Sequence

from teamrl.tasks.solve import SolveTask
from teamrl.tasks.task import Problem
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.outcome import DemoRow, EpisodeOutcome, StudyOptions, solved_reply, wrong_reply

ROLES = ("generator", "evaluator")
CRITIQUE_CHARS = 400
_VERDICT = re.compile(r"verdict\s*[:=\-]?\s*\**\s*(correct|incorrect|wrong|right)\b", re.I)
_ANSWER_LINE = re.compile(r"(?im)^.*\b(?:final\s+)?answer\s*(?:is\b|[:=]).*$")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{[^{}]*\}")
_CODE_BLOCK = re.compile(r"```.*?(?:```|\Z)", re.S)


def parse_verdict(text: str) -> bool | None:
    """True for ``Verdict: Correct``, False for ``Incorrect``, None when there is no verdict.

    The last ``Verdict:`` label wins; without one, a reply whose first word is ``Correct`` or
    ``Incorrect`` counts.
    """
    found = _VERDICT.findall(text)
    if found:
        return found[-1].lower() in ("correct", "right")
    first = re.match(r"\W*(correct|incorrect)\b", text, re.I)
    if first:
        return first.group(1).lower() == "correct"
    return None


def verdict_readable(text: str) -> bool:
    """Whether an evaluator reply is in its format (``teamrl eval``'s valid replies): a readable verdict."""
    return parse_verdict(text) is not None


#: the evaluator gives a verdict, not the task's answer (the generator's replies are judged by the task)
FORMATS = {"evaluator": verdict_readable}


def redact_critique(text: str) -> str:
    """The critique without answer lines, ``\\boxed{}`` values, code blocks or the verdict label."""
    text = _CODE_BLOCK.sub("", text)
    text = _BOXED.sub("", text)
    text = _ANSWER_LINE.sub("", text)
    text = _VERDICT.sub("", text)
    text = "\n".join(line for line in text.splitlines() if line.strip()).strip()
    return text[:CRITIQUE_CHARS] or "(no critique)"


def generator_prompt(
    task: SolveTask, problem: Problem, previous: str | None, critique: str | None
) -> list[dict[str, str]]:
    parts = [task.question(problem)]
    if previous is not None:
        parts += [f"Your previous answer:\n{previous}", f"A reviewer judged it not correct. Critique:\n{critique}",
                  "Solve the problem again with a different method."]
    parts.append(task.answer_instruction)
    return [{"role": "user", "content": "\n\n".join(parts)}]


def evaluator_prompt(task: SolveTask, problem: Problem, candidate: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": (
        f"{task.question(problem)}\n\nA proposed solution:\n{candidate}\n\n"
        "Check the solution. Reply with one line `Verdict: Correct` or `Verdict: Incorrect`, then a short critique "
        "of at most two sentences. Do not state the answer.")}]


async def eval_opt(
    ctx: EpisodeContext, task: SolveTask, problem: Problem, settings: StudyOptions
) -> EpisodeOutcome:
    """Run one Eval-Opt episode; see the module docstring."""
    iterations = settings.iterations_for(task.name)
    attempts: list[str] = []
    verdicts: list[bool | None] = []
    evaluator_samples = []
    previous = critique = None
    for i in range(iterations):
        text = await ctx.generate("generator", generator_prompt(task, problem, previous, critique), turn=i)
        attempts.append(text)
        if i == iterations - 1:
            break
        (sample,) = await ctx.generate_group("evaluator", evaluator_prompt(task, problem, text), n=1, turn=i)
        verdict = parse_verdict(sample.text)
        verdicts.append(verdict)
        evaluator_samples.append(sample)
        if verdict:
            break
        previous, critique = text, redact_critique(sample.text)
    answers = [task.extract(t) for t in attempts]
    correct = task.correct_many(problem, answers)
    for sample, verdict, truth in zip(evaluator_samples, verdicts, correct):
        sample.role_reward = 1.0 if bool(verdict) == truth else 0.0
    return EpisodeOutcome(attempts[-1], answers[-1], correct[-1], stats={
        "iterations": len(attempts), "first_correct": correct[0],
        "verdicts": [(v, c) for v, c in zip(verdicts, correct)],  # (verdict or None, truth) per evaluation
    })


DEMO_CRITIQUE = "The calculation is wrong; redo it step by step."


def demonstrations(task: SolveTask, problem: Problem, settings: StudyOptions) -> list[DemoRow]:
    """Warm start (the study's format): the generator's first answer as the task demonstrates; the evaluator judging
    that answer ``Verdict: Correct`` and the same reply with a wrong integer answer ``Verdict: Incorrect`` with a
    critique; the generator's second attempt after that critique. The first row only where the answer is not an
    integer."""
    right = solved_reply(task, problem)
    if right is None:
        return []
    rows: list[DemoRow] = [("generator", generator_prompt(task, problem, None, None), right)]
    wrong = wrong_reply(right, problem.data.get("answer"), 1)
    if wrong is not None:
        rows += [("evaluator", evaluator_prompt(task, problem, right), "Verdict: Correct\nEach step checks out."),
                 ("evaluator", evaluator_prompt(task, problem, wrong), f"Verdict: Incorrect\n{DEMO_CRITIQUE}"),
                 ("generator", generator_prompt(task, problem, wrong, DEMO_CRITIQUE), right)]
    return rows


def summary(outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """Eval-Opt's statistics over ``outcomes`` (registered as its ``Workflow.summary``): first-attempt
    accuracy, iterations used, and the evaluator's confusion as rates over all its evaluations
    (``evaluator/true_correct``: judged correct and correct, ... ``evaluator/unparsed``: no verdict)."""
    n = len(outcomes)
    out = {"first_attempt_accuracy": sum(o.stats["first_correct"] for o in outcomes) / n,
           "iterations_mean": sum(o.stats["iterations"] for o in outcomes) / n}
    judged = [(v, c) for o in outcomes for v, c in o.stats["verdicts"]]
    if judged:
        m = len(judged)
        out["evaluator/true_correct"] = sum(bool(v) and c for v, c in judged) / m
        out["evaluator/false_correct"] = sum(bool(v) and not c for v, c in judged) / m
        out["evaluator/true_incorrect"] = sum(not v and not c for v, c in judged) / m
        out["evaluator/false_incorrect"] = sum(not v and c for v, c in judged) / m
        out["evaluator/unparsed"] = sum(v is None for v, _ in judged) / m
    return out
