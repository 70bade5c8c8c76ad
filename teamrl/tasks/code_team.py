"""``code.helper_main``: agent 1 writes a helper ``aux``, agent 2 the main function that may call it.

The combined program runs in the sandbox with the problem's tests. Reward levels (MAGRPO
paper family, max 4.0; the normalised return is reward / 4):

| level | points | rule |
|---|---|---|
| aux | +0.4 | the helper defines ``aux`` with a ``return <value>`` |
| main | +0.6 | the main agent defines the entry point with a ``return <value>``; **required**: otherwise the reward
stops here |
| parses | +0.5 | helper + main parse as one program; **required** |
| tests | +1.0 x fraction | fraction of the problem's tests passed in the sandbox |
| collaboration | +0.5 | main calls ``aux`` and at least one test passes |
| not a wrapper | +1.0 | main's body is more than ``return aux(...)`` |
| ignored | -0.5 | main calls ``aux`` and throws its result away (a bare call statement) |

Identical programs within one ``rewards`` call run once; the distinct ones run in parallel in a
:class:`~teamrl.sandbox.SandboxPool`.

The two-role coding tasks (this one, ``code.coder_tester`` and the ``code`` environment) hold out
the last ``test_size`` problems of the data set (:class:`CodeTeamOptions`): ``split: train`` (the
default) trains on the others, ``split: test`` gives the held-out ones (``teamrl eval``, the
held-out evaluation during and after training). The split is made on the whole data set first;
``num_problems`` then takes the first N training problems, so the held-out problems never depend
on it (``code.solve`` differs: it takes the first ``num_problems`` and holds out the last
``test_size`` of those).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Sequence

from teamrl.core.config import ConfigError, option
from teamrl.sandbox import ExecutionResult, SandboxLimits, SandboxPool
from teamrl.tasks.code_data import CODE_SOURCES, CodeProblem, extract_code, load_code_problems, prompt_imports
from teamrl.tasks.task import SPLITS, Problem, TeamTask, split_problems

LEVELS = {
    "aux": 0.4,
    "main": 0.6,
    "parses": 0.5,
    "tests": 1.0,
    "collaboration": 0.5,
    "not_wrapper": 1.0,
    "ignored": -0.5,
}


@dataclass
class CodeProblemsOptions:
    """The options every coding task has: its data (see :class:`CodeProblems`) and the sandbox."""

    name: str = ""
    source: str = option("humaneval", choices=tuple(sorted(CODE_SOURCES)), doc="coding data set")
    path: str = option("", doc="its file, for every source but humaneval (see docs/data.md)")
    num_problems: int = option(0, ge=0, doc="first N problems; 0 = all")
    wall_seconds: float = option(5.0, gt=0, doc="sandbox wall-clock limit per program")
    workers: int = option(0, ge=0, doc="parallel sandbox runs; 0 = one per CPU")


@dataclass
class CodeTeamOptions(CodeProblemsOptions):
    """The two-role coding tasks' options: :class:`CodeProblemsOptions` plus the held-out split.

    The default ``test_size`` (16, as ``code.solve``) holds out HumanEval/148..163 and keeps the
    first problems training ones, so a small ``num_problems`` (the tests' 1 or 2) picks the same
    problems as before the split existed."""

    num_problems: int = option(0, ge=0, doc="first N training problems (the held-out ones excluded); 0 = all of them")
    split: str = option(
        "train", choices=SPLITS, doc="train: all but the last test_size problems of the data set; test: those"
    )
    test_size: int = option(16, ge=0, doc="problems held out for evaluation: the last test_size of the data set")


@dataclass
class CodeHelperMainOptions(CodeTeamOptions):
    name: str = "code.helper_main"


def _function(tree: ast.Module | None, name: str) -> ast.FunctionDef | None:
    if tree is None:
        return None
    return next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _returns_value(fn: ast.FunctionDef | None) -> bool:
    return fn is not None and any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn))


def _parse(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError):
        return None


def _aux_calls(fn: ast.FunctionDef) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "aux"]


def _is_thin_wrapper(fn: ast.FunctionDef) -> bool:
    """The body (docstring aside) is one ``return aux(...)``."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return (len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Call)
            and isinstance(body[0].value.func, ast.Name) and body[0].value.func.id == "aux")


def _ignores_aux(fn: ast.FunctionDef) -> bool:
    return any(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Name)
               and s.value.func.id == "aux" for s in ast.walk(fn))


class CodeProblems:
    """What every coding task shares: problems from the data set its options name (``source``,
    ``path``, ``num_problems``) and a sandbox pool (``wall_seconds``, ``workers``) started on first use."""

    def __init__(self, opts) -> None:
        self.opts = opts
        if self.opts.source != "humaneval" and not self.opts.path:
            raise ConfigError(f"task.path: source {self.opts.source!r} needs the path of its file (see docs/data.md)")
        code = load_code_problems(self.opts.source, self.opts.path or None)
        self._problems = self.select([Problem(c.task_id, {"code": c}) for c in code])
        self._pool: SandboxPool | None = None

    def select(self, problems: list[Problem]) -> list[Problem]:
        """This task's problems of the whole data set ``problems``: the first ``num_problems`` (0: all)."""
        return problems[:self.opts.num_problems] if self.opts.num_problems else problems

    @property
    def pool(self) -> SandboxPool:
        """The sandbox pool, started on first use."""
        if self._pool is None:
            limits = SandboxLimits(wall_seconds=self.opts.wall_seconds, cpu_seconds=self.opts.wall_seconds)
            self._pool = SandboxPool(self.opts.workers or None, limits)
        return self._pool

    def problems(self) -> list[Problem]:
        return list(self._problems)


class CodeTeamTask(CodeProblems, TeamTask):
    """What the two-role coding tasks share: :class:`CodeProblems` with the held-out split of
    :class:`CodeTeamOptions`, and prompts of the form problem + the role's request (+ the
    previous attempt and feedback)."""

    def select(self, problems: list[Problem]) -> list[Problem]:
        """The split of the whole data set first (train: all but the last ``test_size``; test: the
        last ``test_size``), then, for train, its first ``num_problems``. Asking for more training
        problems than the split leaves is refused: they would be held-out ones."""
        what = f"{self.opts.name or self.name} (source {self.opts.source})"
        chosen = split_problems(problems, self.opts.split, self.opts.test_size, what)
        n, train = self.opts.num_problems, len(problems) - self.opts.test_size
        if n > train:
            raise ConfigError(f"task.num_problems={n}: more than the {train} training problems that task.test_size="
                              f"{self.opts.test_size} leaves of the {len(problems)} of {what}; lower one of them")
        return chosen[:n] if n and self.opts.split == "train" else chosen

    def request(self, code: CodeProblem, role: str) -> str:
        """What ``role`` is asked to write."""
        raise NotImplementedError

    def prompt(self, problem: Problem, role: str, turn: int = 0, history: Sequence[dict[str, str]] = (),
               feedback: str = "") -> list[dict[str, str]]:
        if role not in self.roles:
            raise KeyError(f"role {role!r}: {self.name} has roles {list(self.roles)}")
        c: CodeProblem = problem.data["code"]
        text = f"Problem:\n{c.prompt}\n\n{self.request(c, role)}"
        if history:
            previous = "\n\n".join(f"{r.capitalize()}:\n{history[-1].get(r, '')}" for r in self.roles)
            text += (
                f"\n\nPrevious attempt.\n{previous}\n\nFeedback: {feedback}\nWrite an improved version of your part."
            )
        return [{"role": "user", "content": text}]


class CodeHelperMain(CodeTeamTask):
    """Two coders: ``helper`` writes ``aux``, ``main`` writes the entry point that may call it."""

    name = "code.helper_main"
    roles = ("helper", "main")
    max_reward = sum(v for v in LEVELS.values() if v > 0)  # 4.0
    Options = CodeHelperMainOptions

    def __init__(self, opts: CodeHelperMainOptions | None = None) -> None:
        super().__init__(opts or CodeHelperMainOptions())
        self._runs: dict[tuple[str, str], ExecutionResult] = {}  # (task_id, program) -> result, for feedback

    def request(self, code: CodeProblem, role: str) -> str:
        if role == "helper":
            return (f"Write a helper function `aux` that will help your teammate implement `{code.entry_point}`. "
                    "Reply with Python code only, defining only `aux`.")
        return (f"Implement `{code.entry_point}`. Your teammate writes a helper function `aux` that you may call. "
                f"Reply with Python code only, defining only `{code.entry_point}`.")

    def program(self, problem: Problem, outputs: dict[str, str]) -> str:
        """The combined program: the prompt's imports, the helper's code, the main code."""
        c: CodeProblem = problem.data["code"]
        return (
            prompt_imports(c.prompt)
            + extract_code(outputs.get("helper", ""))
            + "\n\n"
            + extract_code(outputs.get("main", ""))
            + "\n"
        )

    def _static(self, problem: Problem, outputs: dict[str, str]) -> tuple[dict[str, float], str | None]:
        """Points of the levels that need no execution, and the program to run (None: a gate failed)."""
        c: CodeProblem = problem.data["code"]
        pts = {k: 0.0 for k in LEVELS}
        aux_tree = _parse(extract_code(outputs.get("helper", "")))
        main_tree = _parse(extract_code(outputs.get("main", "")))
        if _returns_value(_function(aux_tree, "aux")):
            pts["aux"] = LEVELS["aux"]
        main_fn = _function(main_tree, c.entry_point)
        if not _returns_value(main_fn):
            return pts, None
        pts["main"] = LEVELS["main"]
        program = self.program(problem, outputs)
        if _parse(program) is None:
            return pts, None
        pts["parses"] = LEVELS["parses"]
        if not _is_thin_wrapper(main_fn):
            pts["not_wrapper"] = LEVELS["not_wrapper"]
        if _aux_calls(main_fn) and _ignores_aux(main_fn):
            pts["ignored"] = LEVELS["ignored"]
        pts["_calls_aux"] = 1.0 if _aux_calls(main_fn) else 0.0
        return pts, program

    def reward_breakdown_many(self, problem: Problem, joint: Sequence[dict[str, str]]) -> list[dict[str, float]]:
        """Each level's points for every joint action (distinct programs run once, in parallel)."""
        c: CodeProblem = problem.data["code"]
        statics = [self._static(problem, o) for o in joint]
        todo = sorted({prog for _, prog in statics if prog is not None})
        futures = {prog: self.pool.submit(prog, c.tests) for prog in todo}
        results = {prog: f.result() for prog, f in futures.items()}
        for prog, res in results.items():
            self._runs[(problem.id, prog)] = res
        out = []
        for pts, prog in statics:
            calls_aux = pts.pop("_calls_aux", 0.0)
            if prog is not None:
                res = results[prog]
                pts["tests"] = LEVELS["tests"] * res.pass_fraction if res.tests_total else 0.0
                if calls_aux and res.tests_passed > 0:
                    pts["collaboration"] = LEVELS["collaboration"]
            out.append(pts)
        return out

    def reward(self, problem: Problem, outputs: dict[str, str]) -> float:
        return self.rewards(problem, [outputs])[0]

    def rewards(self, problem: Problem, joint: Sequence[dict[str, str]]) -> list[float]:
        return [sum(p.values()) for p in self.reward_breakdown_many(problem, joint)]

    def passed(self, problem: Problem, outputs: dict[str, str]) -> bool:
        """Every test passed (for pass@1)."""
        pts = self.reward_breakdown_many(problem, [outputs])[0]
        return pts["tests"] == LEVELS["tests"]

    def feedback(self, problem: Problem, outputs: dict[str, str], reward: float) -> str:
        """The first failing assertion and its error type, or which gate failed."""
        pts, prog = self._static(problem, outputs)
        c: CodeProblem = problem.data["code"]
        if not pts["main"]:
            return f"The main function `{c.entry_point}` is missing or returns nothing."
        if prog is None:
            return "The combined helper + main code does not parse (SyntaxError)."
        res = self._runs.get((problem.id, prog))
        if res is None:
            res = self.pool.submit(prog, c.tests).result()
        if res.status == "ok":
            return "All tests passed."
        return (f"{res.tests_passed}/{res.tests_total} tests passed; status {res.status}; "
                f"first failure: {res.first_failure}")

    def single_prompt(self, problem: Problem) -> list[dict[str, str]]:
        c: CodeProblem = problem.data["code"]
        return [{"role": "user", "content": f"Problem:\n{c.prompt}\n\nWrite a helper function `aux` and the function "
                                            f"`{c.entry_point}` that uses it. Reply with Python code only."}]

    def split_single(self, text: str) -> dict[str, str]:
        """The ``aux`` definition goes to the helper, everything else to main."""
        code = extract_code(text)
        tree = _parse(code)
        fn = _function(tree, "aux")
        if tree is None or fn is None:
            return {"helper": "", "main": code}
        lines = code.splitlines()
        start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
        helper = "\n".join(lines[start:fn.end_lineno])
        main = "\n".join(lines[:start] + lines[fn.end_lineno:])
        return {"helper": helper, "main": main}
