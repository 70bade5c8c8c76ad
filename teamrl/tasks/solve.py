"""``math.solve`` and ``code.solve``: one verifiable answer per problem (the workflow study's tasks).

A :class:`SolveTask` is a single-agent :class:`~teamrl.tasks.task.Task` (reward 1 for a correct
answer, else 0) that also tells a multi-role workflow what it needs: the problem text any role
may be shown (:meth:`SolveTask.question`), how a final answer must be written
(``answer_instruction``), how to read one out of a text (:meth:`SolveTask.extract`) and whether
answers are right (:meth:`SolveTask.correct_many`). The Eval-Opt, Voting and Orch-Workers
workflows (:mod:`teamrl.workflows`) and the single-agent RL baseline all run on these tasks.

Both tasks hold out their last ``test_size`` problems: ``split: train`` (the default) trains on
the rest, ``split: test`` gives the held-out ones (evaluation during training, ``teamrl eval``).

- ``math.solve``: the problems of the ``math`` environment (a seeded arithmetic generator by
  default, an easy one-operation generator, GSM8K, MATH-500 or reasoning-gym), answers graded
  by math-verify (:func:`~teamrl.tasks.math_env.grade_answer`); the answer is the last
  ``Answer:`` line or ``\\boxed{}``, else (with ``last_number``, the default, as GSM8K
  evaluations do) the last number in the text.
- ``code.solve``: HumanEval (from the package) or MBPP / HumanEval+ / CoopHumanEval by path;
  an answer is correct when the program passes every test, run in the sandbox (never here).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import ClassVar, Sequence

from teamrl.core.config import option
from teamrl.tasks.code_data import CodeProblem, extract_code, prompt_imports
from teamrl.tasks.code_team import CodeProblems, CodeProblemsOptions
from teamrl.tasks.math_env import MathOptions, extract_answer, grade_answer, load_math_problems
# SPLITS and split_problems live in teamrl.tasks.task (the team coding tasks, which this module imports, use
# them too); imported here for the solve tasks and for callers that import them from this module
from teamrl.tasks.task import SPLITS, Problem, Task, split_problems


class SolveTask(Task):
    """A task with one verifiable answer per problem; see the module docstring."""

    answer_instruction: ClassVar[str]  # how a final answer must be written (appended to answering prompts)
    max_reward: ClassVar[float] = 1.0

    def question(self, problem: Problem) -> str:
        """The problem as every role may be shown it."""
        raise NotImplementedError

    def extract(self, text: str) -> str | None:
        """The answer in ``text`` (None: no readable answer)."""
        raise NotImplementedError

    def correct_many(self, problem: Problem, answers: Sequence[str | None]) -> list[bool]:
        """Whether each extracted answer solves ``problem`` (None is wrong)."""
        raise NotImplementedError

    def prompt(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.question(problem)}\n\n{self.answer_instruction}"}]

    def valid(self, problem: Problem, text: str) -> bool:
        """Format validity (``teamrl eval``): the reply has an answer :meth:`extract` can read."""
        return self.extract(text) is not None

    def reward(self, problem: Problem, text: str) -> float:
        return 1.0 if self.correct_many(problem, [self.extract(text)])[0] else 0.0

    def rewards(self, problems: Sequence[Problem], texts: Sequence[str]) -> list[float]:
        by_problem: dict[str, list[int]] = {}
        for i, p in enumerate(problems):
            by_problem.setdefault(p.id, []).append(i)
        out = [0.0] * len(texts)
        for idx in by_problem.values():
            ok = self.correct_many(problems[idx[0]], [self.extract(texts[i]) for i in idx])
            for i, c in zip(idx, ok):
                out[i] = 1.0 if c else 0.0
        return out


@dataclass
class MathSolveOptions:
    """The ``math`` environment's data options, plus the held-out split."""

    name: str = "math.solve"
    # the data fields of MathOptions, reused so that their docs and checks stay in one place
    source: str = MathOptions.__dataclass_fields__["source"]
    path: str = MathOptions.__dataclass_fields__["path"]
    num_problems: int = MathOptions.__dataclass_fields__["num_problems"]
    seed: int = MathOptions.__dataclass_fields__["seed"]
    max_operand: int = MathOptions.__dataclass_fields__["max_operand"]
    split: str = option("train", choices=SPLITS, doc="train: all but the last test_size problems; test: those")
    test_size: int = option(16, ge=0, doc="problems held out for evaluation")
    last_number: bool = option(True, doc="without an `Answer:` line or \\boxed{}, read the last number in the text")


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (thousands separators dropped), None if none."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


class MathSolve(SolveTask):
    """A math problem answered with ``Answer: <value>``; correct when it equals the truth."""

    name: ClassVar[str] = "math.solve"
    Options = MathSolveOptions
    answer_instruction: ClassVar[str] = "Reason step by step, then end with one line `Answer: <value>`."

    def __init__(self, opts: MathSolveOptions | None = None) -> None:
        self.opts = opts or MathSolveOptions()
        data = MathOptions(
            source=self.opts.source,
            path=self.opts.path,
            num_problems=self.opts.num_problems,
            seed=self.opts.seed,
            max_operand=self.opts.max_operand,
        )
        self._problems = split_problems(load_math_problems(data), self.opts.split, self.opts.test_size, "math.solve")

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def question(self, problem: Problem) -> str:
        return f"Problem:\n{problem.data['question']}"

    def valid(self, problem: Problem, text: str) -> bool:
        """Format validity: the reply ends in the asked-for form (an ``Answer:`` line or ``\\boxed{}``); the
        last-number fallback of :meth:`extract` is leniency in scoring, not the format."""
        return extract_answer(text) is not None

    def extract(self, text: str) -> str | None:
        answer = extract_answer(text)
        if answer is None and self.opts.last_number:
            answer = last_number(text)
        return answer

    def correct_many(self, problem: Problem, answers: Sequence[str | None]) -> list[bool]:
        truth = str(problem.data["answer"])
        return [a is not None and grade_answer(a, truth) for a in answers]

    def demonstrations(self, problem: Problem) -> list[tuple[str, list[dict[str, str]], str]]:
        """Warm start (``teamrl sft``): the agent's prompt and a reply in the answer format with the
        true value (the generator's expression shown as the working, where it has one)."""
        work = f"{problem.data['expression']} = {problem.data['answer']}\n" if "expression" in problem.data else ""
        return [("agent", self.prompt(problem), f"{work}Answer: {problem.data['answer']}")]


@dataclass
class CodeSolveOptions(CodeProblemsOptions):
    name: str = "code.solve"
    split: str = option("train", choices=SPLITS, doc="train: all but the last test_size problems; test: those")
    test_size: int = option(16, ge=0, doc="problems held out for evaluation")


class CodeSolve(CodeProblems, SolveTask):
    """A function written in a ```python block; correct when it passes every test in the sandbox."""

    name: ClassVar[str] = "code.solve"
    Options = CodeSolveOptions
    answer_instruction: ClassVar[str] = "Reply with the complete function in one ```python code block."

    def __init__(self, opts: CodeSolveOptions | None = None) -> None:
        super().__init__(opts or CodeSolveOptions())
        self._problems = split_problems(self._problems, self.opts.split, self.opts.test_size, "code.solve")

    def question(self, problem: Problem) -> str:
        c: CodeProblem = problem.data["code"]
        return f"Problem:\n{c.prompt}\n\nThe function to write is `{c.entry_point}`."

    def extract(self, text: str) -> str | None:
        code = extract_code(text)
        return code or None

    def valid(self, problem: Problem, text: str) -> bool:
        """Format validity (``teamrl eval``): the reply holds a program (its fenced block, else the
        whole text) that parses as Python and defines the function asked for. Any non-empty text is
        *scored* (:meth:`extract`), but prose, a critique or a verdict is not a code reply."""
        code = self.extract(text)
        if code is None:
            return False
        try:
            tree = ast.parse(code)
        except (SyntaxError, ValueError):  # ValueError: a NUL byte in the text
            return False
        entry = problem.data["code"].entry_point
        return any(
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry for node in ast.walk(tree)
        )

    def correct_many(self, problem: Problem, answers: Sequence[str | None]) -> list[bool]:
        """Distinct programs run once each, in parallel, in the sandbox."""
        c: CodeProblem = problem.data["code"]
        programs = {a: prompt_imports(c.prompt) + a + "\n" for a in answers if a}
        futures = {a: self.pool.submit(prog, c.tests) for a, prog in programs.items()}
        passed = {a: (r := f.result()).tests_total > 0 and r.tests_passed == r.tests_total for a, f in futures.items()}
        return [bool(a) and passed[a] for a in answers]
