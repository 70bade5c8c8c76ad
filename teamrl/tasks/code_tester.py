"""``code.coder_tester``: the coder writes the function, the tester writes assertions for it.

Rewards:
- team (the shared reward, also each role's team term): the fraction of the problem's hidden
  tests that the coder's program passes;
- coder (local): the same fraction;
- tester (local): the mean of validity (share of its assertions that the reference solution
  passes) and discrimination (share that a known-wrong program fails among the valid ones,
  bounded below by ``(valid - passed_by_wrong) / total`` since the sandbox reports counts).

The known-wrong program is the reference solution with its first comparison or arithmetic
operator flipped, kept only if it fails a hidden test; else a stub returning ``None``.
Sources need reference solutions (humaneval, mbpp, humanevalplus). The last ``test_size``
problems are held out (``split``; see :mod:`teamrl.tasks.code_team`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Sequence

from teamrl.core.config import ConfigError, option
from teamrl.tasks.code_data import CodeProblem, extract_code
from teamrl.tasks.code_team import CodeTeamOptions, CodeTeamTask
from teamrl.tasks.task import Problem

_FLIP = {ast.Lt: ast.GtE, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.GtE: ast.Lt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add}


@dataclass
class CoderTesterOptions(CodeTeamOptions):
    name: str = "code.coder_tester"
    source: str = option(
        "humaneval", choices=("humaneval", "mbpp", "humanevalplus"), doc="a data set with reference solutions"
    )


def assertions(text: str) -> tuple[str, list[str]]:
    """(setup, assert snippets) from a tester's answer: imports become setup, each top-level assert a test."""
    code = extract_code(text)
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return "", []
    setup = [ast.get_source_segment(code, n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    tests = [ast.get_source_segment(code, n) for n in tree.body if isinstance(n, ast.Assert)]
    return "\n".join(s for s in setup if s), [t for t in tests if t]


def mutate(program: str) -> str | None:
    """The program with its first flippable operator flipped (None if there is none)."""
    try:
        tree = ast.parse(program)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in _FLIP:
            node.ops[0] = _FLIP[type(node.ops[0])]()
            return ast.unparse(tree)
        if isinstance(node, ast.BinOp) and type(node.op) in _FLIP:
            node.op = _FLIP[type(node.op)]()
            return ast.unparse(tree)
    return None


class CoderTester(CodeTeamTask):
    """Coder + unit tester on a coding data set; see the module docstring for the rewards."""

    name = "code.coder_tester"
    roles = ("coder", "tester")
    max_reward = 1.0
    Options = CoderTesterOptions

    def __init__(self, opts: CoderTesterOptions | None = None) -> None:
        super().__init__(opts or CoderTesterOptions())
        self._wrong: dict[str, str] = {}

    def select(self, problems: list[Problem]) -> list[Problem]:
        """The split of :class:`CodeTeamTask`, once every problem of the data set (train and
        test alike are scored) has the reference solution the tester's reward needs."""
        missing = [p.id for p in problems if not p.data["code"].canonical_solution]
        if missing:
            raise ConfigError(f"task.source={self.opts.source!r}: {len(missing)} problems lack a reference solution "
                             f"(e.g. {missing[0]}); the tester's reward needs one")
        return super().select(problems)

    def request(self, code: CodeProblem, role: str) -> str:
        if role == "coder":
            return f"Implement `{code.entry_point}`. Reply with Python code only."
        return (f"Write 3 to 5 `assert` statements that test `{code.entry_point}` on inputs where you are sure of the "
                "expected output. Reply with the asserts only, as Python code.")

    def wrong_program(self, problem: Problem) -> str:
        """A program that fails at least one hidden test (cached per problem)."""
        if problem.id not in self._wrong:
            c: CodeProblem = problem.data["code"]
            candidate = mutate(c.canonical_solution or "")
            if candidate is None or self.pool.submit(candidate, c.tests).result().ok:
                candidate = f"def {c.entry_point}(*args, **kwargs):\n    return None\n"
            self._wrong[problem.id] = candidate
        return self._wrong[problem.id]

    def _scores(self, problem: Problem, joint: Sequence[dict[str, str]]) -> list[dict[str, float]]:
        c: CodeProblem = problem.data["code"]
        wrong = self.wrong_program(problem)
        coder_code = [extract_code(o.get("coder", "")) for o in joint]
        tests = [assertions(o.get("tester", "")) for o in joint]
        hidden = {code: self.pool.submit(code, c.tests) for code in set(coder_code)}
        checks = {}
        for setup, asserts in set((s, tuple(a)) for s, a in tests):
            if asserts:
                checks[(setup, asserts)] = (self.pool.submit(c.canonical_solution, asserts, setup=setup),
                                            self.pool.submit(wrong, asserts, setup=setup))
        out = []
        for code, (setup, asserts) in zip(coder_code, tests):
            coder = hidden[code].result().pass_fraction if code else 0.0
            tester = 0.0
            if asserts:
                ref, bad = (f.result() for f in checks[(setup, tuple(asserts))])
                total = len(asserts)
                valid = ref.tests_passed
                tester = 0.5 * (valid / total) + 0.5 * max(0, valid - bad.tests_passed) / total
            out.append({"coder": coder, "tester": tester, "team": coder})
        return out

    def rewards(self, problem: Problem, joint: Sequence[dict[str, str]]) -> list[float]:
        return [s["team"] for s in self._scores(problem, joint)]

    def reward(self, problem: Problem, outputs: dict[str, str]) -> float:
        return self.rewards(problem, [outputs])[0]

    def role_rewards(self, problem: Problem, outputs: dict[str, str]) -> dict[str, float]:
        s = self._scores(problem, [outputs])[0]
        return {"coder": s["coder"], "tester": s["tester"]}

    def passed(self, problem: Problem, outputs: dict[str, str]) -> bool:
        return self.reward(problem, outputs) == 1.0

    def feedback(self, problem: Problem, outputs: dict[str, str], reward: float) -> str:
        s = self._scores(problem, [outputs])[0]
        return f"The code passes {s['coder']:.0%} of the hidden tests; the tests score {s['tester']:.2f} of 1."

    def single_prompt(self, problem: Problem) -> list[dict[str, str]]:
        c: CodeProblem = problem.data["code"]
        return [{"role": "user", "content": f"Problem:\n{c.prompt}\n\nImplement `{c.entry_point}`, then write 3 to 5 "
                                            "`assert` statements that test it. Reply with Python code only."}]

    def split_single(self, text: str) -> dict[str, str]:
        code = extract_code(text)
        setup, asserts = assertions(code)
        try:
            tree = ast.parse(code)
            body = "\n".join(ast.get_source_segment(code, n) or "" for n in tree.body if not isinstance(n, ast.Assert))
        except (SyntaxError, ValueError):
            body = code
        return {"coder": body, "tester": "\n".join(([setup] if setup else []) + asserts)}
