"""``math``: a reasoner and a tool agent solve a math word problem and must agree (AT-GRPO).

Two roles act each turn, in parallel (both observe the same state; the environment applies
the reasoner's answer first, then the tool's):

- ``reasoner`` answers in natural language, ending with ``Answer: <value>`` (or
  ``\\boxed{<value>}``);
- ``tool`` writes a Python program; it runs in the sandbox (never in this process) and the
  last line it prints is its answer.

Both see the problem and, from turn 2 on, each other's previous answers (the reasoner's
answer and the tail of its reasoning; the tool's program output or failure). The episode ends
as soon as a role's answer agrees (:func:`answers_equal`) with the other role's latest answer,
or after ``max_turns`` turns (a turn ends when the tool acts).

Rewards (documented constants below):

reasoner (local)
    ``REASONER_CORRECT``  1.0  its answer equals the ground truth
    ``REASONER_WRONG``    0.0  a wrong answer, or none (no ``Answer:`` line or ``\\boxed{}``)
tool (local, the constants of :mod:`teamrl.tasks.tool_planner`)
    ``TOOL_SOLVED``       1.0  the program ran and its printed answer equals the truth
    ``TOOL_RAN``          0.2  it ran and printed something else
    ``TOOL_FAILED``       0.0  error, timeout, no program, or nothing printed
team
    ``TEAM_CORRECT`` (1.0) when the agreed answer equals the truth, else 0; ``success`` is
    team reward 1. With ``final: reasoner`` (not the default) a state without agreement is
    scored by the reasoner's latest answer instead, so a reasoner playing alone (the
    single-agent baseline) can succeed.

Answers are compared by :func:`answers_equal`: normalised strings first (``1,000``,
``\\boxed{}``, ``$``, ``\\text{}`` units, ``^\\circ``, ``\\%``), then sympy on a whitelisted
grammar (digits, letters, ``+-*/^()``, ``\\frac``, ``\\sqrt``, ``\\pi``), numerically to a
relative ``REL_TOL``, comma lists element-wise. Sympy's parser ``eval``s its input, so only
strings of that grammar reach it, with no builtins, capped in length and in the size of
powers; model text is never executed here.

Data: GSM8K (``load_gsm8k``), MATH-500 / AIME / AMC JSONL (``load_math``), a seeded
arithmetic word-problem generator (source ``generated``, the default: no files needed) and,
when installed, ``reasoning-gym`` datasets (source ``reasoning_gym:<dataset>``).
"""

from __future__ import annotations

import ast
import keyword
import math
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from teamrl.core.config import ConfigError, InputError, option
from teamrl.sandbox import SandboxLimits, run_program
from teamrl.tasks.code_data import extract_code
from teamrl.tasks.environment import Environment
from teamrl.tasks.jsonl import read_jsonl
from teamrl.tasks.task import Problem
from teamrl.tasks.tool_planner import TOOL_FAILED, TOOL_RAN, TOOL_SOLVED, TurnState, describe_result, truncate

REASONER_CORRECT = 1.0
REASONER_WRONG = 0.0
TEAM_CORRECT = 1.0
REL_TOL = 1e-6  # numeric answers agree within this relative tolerance (absolute below 1)
MAX_ANSWER_CHARS = 200  # longer answers are compared as strings only
MAX_EXPONENT = 1000  # a power with a larger (or non-numeric) exponent is not evaluated
MAX_DIGITS = 100  # an integer literal with more digits is not evaluated
REASONING_SHOWN = 600  # characters of the reasoner's answer shown to the tool
GENERATED_DEFAULT = 64  # problems made by a generator when num_problems is 0
SOURCES = ("generated", "generated_easy", "gsm8k", "math", "reasoning_gym:<dataset>")


@dataclass
class MathOptions:
    name: str = "math"
    source: str = option("generated", doc="generated (seeded arithmetic word problems), generated_easy (one "
                                          "operation on numbers up to 20, for small models), gsm8k, math "
                                          "(MATH-500 / AIME / AMC JSONL) or reasoning_gym:<dataset>")
    path: str = option("", doc="the JSONL file, for gsm8k and math (e.g. math500.jsonl; see docs/data.md)")
    num_problems: int = option(0, ge=0, doc="first N problems of a file (0 = all); generators make N (0 = 64)")
    max_turns: int = option(2, ge=1, doc="turns (reasoner and tool) per episode")
    seed: int = option(0, doc="seed of the generators")
    wall_seconds: float = option(5.0, gt=0, doc="sandbox wall-clock (and CPU) limit per tool program")
    final: str = option("agreed", choices=("agreed", "reasoner"),
                        doc="team reward without agreement: agreed = 0; reasoner = the reasoner's latest answer decides")


# --- answers -------------------------------------------------------------------------------------


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """(content, end index) of the ``{...}`` group opening at ``text[start]``, None if unbalanced."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, None if there is none."""
    found = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*(?=\{)", text):
        got = _braced(text, m.end())
        if got is not None:
            found = got[0]
    return found


_ANSWER_LINE = re.compile(r"(?im)(?:^|[\s.,;:])[*_#>\- \t]*(?:the[^\S\n]+)?(?:final[^\S\n]+)?answer[^\S\n]*[*_]*[^\S\n]*(?:is\b|[:=])[*_]*[^\S\n]*(.*)$")


def extract_answer(text: str) -> str | None:
    """The answer in a reasoner's text: the last ``\\boxed{...}``, else what follows the last
    ``Answer:`` label (at the start of a line or after text on it; markdown emphasis allowed),
    stripped of a final period; None if none."""
    if not isinstance(text, str):
        return None
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    lines = [m.group(1).strip() for m in _ANSWER_LINE.finditer(text) if m.group(1).strip(" *_.$")]
    if not lines:
        return None
    answer = lines[-1].strip().strip("*_").strip()
    return answer.rstrip(".").strip() or None


def printed_answer(stdout: str) -> str | None:
    """The answer a tool program printed: its last non-empty line, after any ``Answer:`` label."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        return None
    return extract_answer(lines[-1]) or lines[-1]


_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")
_UNIT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\s*\{([^{}]*)\}")


def normalize_answer(answer: Any) -> str:
    """A canonical string for ``answer``: no ``\\boxed``/``$``/spacing macros/degree or percent
    signs/thousands separators, ``\\dfrac`` as ``\\frac``, an integral float as an int."""
    if isinstance(answer, bool) or answer is None:
        return ""
    if isinstance(answer, (int, float)):
        if isinstance(answer, float) and answer.is_integer():
            return str(int(answer))
        return str(answer)
    s = str(answer).strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", " ")
    s = re.sub(r"\\(?:left|right)\b", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|\\circ|°", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"^[a-zA-Z]\s*=\s*(?=\S)", "", s)  # "x = 5"
    s = _UNIT.sub(lambda m: m.group(1), s).strip()
    # a number followed by a unit word ("18 dollars", "5 cm"): the number
    unit = re.match(r"^([-+]?[\d,]*\.?\d+)\s+[a-zA-Z]+\.?$", s)
    if unit:
        s = unit.group(1)
    s = s.rstrip(".").strip()
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if re.match(r"^[-+]?\.\d", s):
        s = s.replace(".", "0.", 1)
    return s


def _latex_to_expr(s: str) -> str:
    """Simple LaTeX as a Python-syntax expression: \\frac{a}{b}, \\sqrt{a}, \\sqrt[n]{a}, \\pi,
    \\cdot, \\times, ``^{...}``, braces as parentheses."""
    for _ in range(20):  # nested fracs, innermost last
        m = re.search(r"\\frac\s*(?=\{)", s)
        if not m:
            break
        a = _braced(s, m.end())
        b = _braced(s, a[1]) if a else None
        if not a or not b:
            # \frac12 style
            m2 = re.match(r"\\frac\s*(\d)(\d)", s[m.start():])
            if not m2:
                return ""
            s = s[:m.start()] + f"(({m2.group(1)})/({m2.group(2)}))" + s[m.start() + m2.end():]
            continue
        s = s[:m.start()] + f"(({a[0]})/({b[0]}))" + s[b[1]:]
    s = re.sub(r"\\frac\s*(\d)(\d)", r"((\1)/(\2))", s)
    s = re.sub(r"\\sqrt\s*\[([^\]]+)\]\s*\{([^{}]*)\}", r"((\2)^(1/(\1)))", s)
    s = re.sub(r"\\sqrt\s*(\d+|[a-zA-Z])", r"sqrt(\1)", s)
    s = s.replace("\\sqrt", "sqrt")
    s = s.replace("\\pi", " pi ").replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
    s = s.replace("{", "(").replace("}", ")")
    return s


_SAFE = re.compile(r"^[0-9a-zA-Z+\-*/^().\s]*$")
_sympy: Any = None


def _sympy_parse(s: str) -> Any:
    """A sympy expression for ``s`` of the whitelisted grammar, or None.

    ``parse_expr`` calls ``eval``: the input may hold only digits, letters, ``+-*/^().`` and
    spaces, a dot only inside a number, no Python keyword, no builtins in scope, and after an
    unevaluated parse no power with a large or symbolic exponent and no huge integer.
    """
    global _sympy
    if len(s) > MAX_ANSWER_CHARS or not s.strip() or not _SAFE.match(s):
        return None
    if re.search(r"(?<![0-9])\.|\.(?![0-9])", s):
        return None
    if any(keyword.iskeyword(w) for w in re.findall(r"[A-Za-z]+", s)):
        return None
    if any(len(d) > MAX_DIGITS for d in re.findall(r"\d+", s)):
        return None
    if _sympy is None:
        import sympy
        from sympy.parsing import sympy_parser

        _sympy = (sympy, sympy_parser)
    sympy, sp = _sympy
    names = {"Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational, "Symbol": sympy.Symbol,
             "sqrt": sympy.sqrt, "pi": sympy.pi, "e": sympy.E, "i": sympy.I, "__builtins__": {},
             "Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow}  # the last three: evaluate=False writes them
    transformations = sp.standard_transformations + (sp.implicit_multiplication, sp.convert_xor)
    try:
        raw = sp.parse_expr(s, local_dict={}, global_dict=dict(names), transformations=transformations, evaluate=False)
        if not isinstance(raw, sympy.Basic):
            return None
        if not _small_powers(raw, 1.0, sympy):
            return None
        return sp.parse_expr(s, local_dict={}, global_dict=dict(names), transformations=transformations)
    except Exception:  # a parse error of any kind: not comparable symbolically
        return None


def _small_powers(expr: Any, scale: float, sympy: Any) -> bool:
    """Every power has a numeric exponent, and the product of the exponents from the top down
    to it (``(a^m)^n`` is ``a^(m n)``) stays within ``MAX_EXPONENT``: no huge evaluation."""
    if isinstance(expr, sympy.Pow):
        exp = expr.exp
        if exp.free_symbols or not _small_powers(exp, 1.0, sympy):
            return False
        try:
            value = abs(float(exp))
        except (TypeError, ValueError, OverflowError):
            return False
        scale *= max(1.0, value)
        if not math.isfinite(scale) or scale > MAX_EXPONENT:
            return False
        return _small_powers(expr.base, scale, sympy)
    return all(_small_powers(a, scale, sympy) for a in expr.args)


def _expr_equal(a: str, b: str) -> bool:
    ea, eb = _sympy_parse(_latex_to_expr(a)), _sympy_parse(_latex_to_expr(b))
    if ea is None or eb is None:
        return False
    sympy = _sympy[0]
    try:
        if ea == eb:
            return True
        if not ea.free_symbols and not eb.free_symbols:
            va, vb = complex(sympy.N(ea, 30)), complex(sympy.N(eb, 30))
            return abs(va - vb) <= REL_TOL * max(1.0, abs(vb))
        diff = ea - eb
        if sympy.count_ops(diff) > 60:
            return False
        return sympy.simplify(diff) == 0
    except Exception:  # overflow, NaN, zoo, a comparison sympy cannot make
        return False


def _split_top(s: str) -> list[str]:
    """``s`` split on commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s).lower()


def answers_equal(a: Any, b: Any) -> bool:
    """Whether answers ``a`` and ``b`` are the same value; never raises.

    Equal normalised strings (case and spacing aside) are equal; else a comma list (bare: in
    any order; in parentheses: in order) is compared element-wise; else both are parsed by
    sympy (simple LaTeX included) and compared numerically (``REL_TOL``) or by simplifying
    their difference. Empty or missing answers equal nothing.
    """
    try:
        na, nb = normalize_answer(a), normalize_answer(b)
        if not na or not nb:
            return False
        if _squash(na) == _squash(nb):
            return True
        pa, pb = _split_top(na), _split_top(nb)
        if len(pa) > 1 or len(pb) > 1:
            if len(pa) != len(pb):
                return False
            return _unordered_equal(pa, pb)  # "-2, 1": a bare list of solutions, in any order
        wrapped = re.match(r"^\((.*)\)$", na), re.match(r"^\((.*)\)$", nb)
        if all(wrapped) and "," in na and "," in nb:
            xa, xb = _split_top(wrapped[0].group(1)), _split_top(wrapped[1].group(1))
            return len(xa) == len(xb) and all(answers_equal(x, y) for x, y in zip(xa, xb))
        return _expr_equal(na, nb)
    except Exception:  # answers are model text: never let a comparison crash a rollout
        return False


def _unordered_equal(pa: list[str], pb: list[str]) -> bool:
    rest = list(pb)
    for x in pa:
        hit = next((i for i, y in enumerate(rest) if answers_equal(x, y)), None)
        if hit is None:
            return False
        rest.pop(hit)
    return True


# --- data ----------------------------------------------------------------------------------------


def load_gsm8k(path: str | Path, limit: int | None = None) -> list[Problem]:
    """GSM8K JSONL (``question``, ``answer`` with the final answer after ``####``)."""
    rows = read_jsonl(path, "GSM8K", "see docs/data.md")
    stem = Path(path).stem
    problems = []
    for i, row in enumerate(rows[:limit] if limit else rows):
        if "question" not in row or "answer" not in row or "####" not in str(row["answer"]):
            raise InputError(f"{path}: line {i + 1} needs `question` and an `answer` with `#### <final>`; found {sorted(row)}")
        final = normalize_answer(str(row["answer"]).rsplit("####", 1)[1].strip())
        problems.append(Problem(f"gsm8k/{stem}/{i}", {"question": row["question"], "answer": final, "source": "gsm8k"}))
    return problems


def load_math(path: str | Path, limit: int | None = None) -> list[Problem]:
    """MATH-style JSONL (``problem``, ``answer``: MATH-500, AIME, AMC; numeric answers become strings)."""
    rows = read_jsonl(path, "MATH", "see docs/data.md")
    stem = Path(path).stem
    problems = []
    for i, row in enumerate(rows[:limit] if limit else rows):
        if "problem" not in row or "answer" not in row:
            raise InputError(f"{path}: line {i + 1} needs `problem` and `answer`; found {sorted(row)}")
        problems.append(Problem(f"math/{stem}/{row.get('unique_id', row.get('id', i))}",
                                {"question": row["problem"], "answer": normalize_answer(row["answer"]), "source": "math"}))
    return problems


_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kemi", "Liam", "Mira", "Noah")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards")


def _template(rng: random.Random) -> tuple[str, str]:
    """(question, Python expression of its answer) with small integers; the answer is an int >= 0."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randint(5, 60), rng.randint(2, 40)
        c = rng.randint(1, a + b)
        return (f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to a friend. "
                f"How many {item} does {name} have now?", f"{a} + {b} - {c}")
    if kind == 1:
        a, b = rng.randint(2, 25), rng.randint(2, 15)
        return f"A box holds {a} {item}. How many {item} are in {b} boxes?", f"{a} * {b}"
    if kind == 2:
        a, b = rng.randint(2, 20), rng.randint(2, 12)
        return (f"{name} shares {a * b} {item} equally among {b} friends. How many {item} does each friend get?",
                f"{a * b} // {b}")
    if kind == 3:
        a, b, c = rng.randint(8, 30), rng.randint(2, 9), rng.randint(2, 6)
        return (f"{name} earns ${a} per hour, works {b} hours a day, and works {c} days. "
                f"How many dollars does {name} earn in total?", f"{a} * {b} * {c}")
    if kind == 4:
        a, b = rng.randint(2, 15), rng.randint(2, 9)
        c = rng.choice([20, 50, 100, 200])
        while a * b > c:
            b -= 1
        return (f"{item.capitalize()} cost ${a} each. {name} buys {b} of them and pays with a ${c} bill. "
                f"How many dollars of change does {name} get?", f"{c} - {a} * {b}")
    a, b, c = rng.randint(10, 90), rng.randint(2, 9), rng.randint(1, 9)
    return (f"{name} has {a} {item}, and a friend has {b} times as many minus {c}. "
            f"How many {item} do they have together?", f"{a} + ({b} * {a} - {c})")


def _eval_int(expression: str) -> int:
    """The value of a generator's expression of int literals and ``+ - * //`` (no eval)."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp):
            ops = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y,
                   ast.FloorDiv: lambda x, y: x // y}
            return ops[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unexpected {ast.dump(node)}")
    return ev(ast.parse(expression, mode="eval"))


def _easy_template(rng: random.Random) -> tuple[str, str]:
    """(question, expression): one addition, subtraction or multiplication of numbers up to 20."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    kind = rng.randrange(3)
    if kind == 0:
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", f"{a} + {b}"
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", f"{a} - {b}"
    a, b = min(a, 9), min(b, 9)
    return f"There are {a} bags with {b} {item} in each. How many {item} are there?", f"{a} * {b}"


def generate_arithmetic(n: int, seed: int = 0, easy: bool = False) -> list[Problem]:
    """``n`` seeded arithmetic word problems (problem i depends only on ``seed`` and i); ``easy``:
    one operation on numbers up to 20 (source ``generated_easy``)."""
    source = "generated_easy" if easy else "generated"
    problems = []
    for i in range(n):
        rng = random.Random(f"math:{source}:{seed}:{i}")
        question, expression = (_easy_template if easy else _template)(rng)
        problems.append(Problem(f"math/{source}/{seed}/{i}", {"question": question, "answer": str(_eval_int(expression)),
                                                             "expression": expression, "source": source}))
    return problems


def load_reasoning_gym(dataset: str, n: int, seed: int = 0) -> list[Problem]:
    """``n`` problems of the ``reasoning-gym`` dataset ``dataset`` (imported only here)."""
    try:
        import reasoning_gym  # type: ignore[import-not-found]
    except ImportError:
        raise ImportError(f"task.source 'reasoning_gym:{dataset}' needs the optional package reasoning-gym "
                          "(pip install reasoning-gym==0.1.25)") from None
    data = reasoning_gym.create_dataset(dataset, size=n, seed=seed)
    return [Problem(f"math/reasoning_gym/{dataset}/{seed}/{i}",
                    {"question": e["question"], "answer": normalize_answer(e["answer"]), "source": f"reasoning_gym:{dataset}"})
            for i, e in enumerate(data)]


def load_math_problems(opts: MathOptions) -> list[Problem]:
    """The problems ``opts`` names (see :class:`MathOptions`)."""
    src, n = opts.source, opts.num_problems
    if src in ("generated", "generated_easy"):
        return generate_arithmetic(n or GENERATED_DEFAULT, opts.seed, easy=src == "generated_easy")
    if src.startswith("reasoning_gym:") and src.split(":", 1)[1]:
        return load_reasoning_gym(src.split(":", 1)[1], n or GENERATED_DEFAULT, opts.seed)
    if src in ("gsm8k", "math"):
        if not opts.path:
            raise ConfigError(f"task.path: source {src!r} needs its JSONL file (see docs/data.md)")
        return (load_gsm8k if src == "gsm8k" else load_math)(opts.path, n or None)
    raise ConfigError(f"task.source={src!r}: choose one of {list(SOURCES)}")


# --- the environment -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MathState(TurnState):
    """The problem, its truth, and each role's latest answer (``None``: none yet or unreadable).

    ``*_turn`` is the turn of that answer (-1: none yet); ``reasoner_text`` is what the tool is
    shown of the reasoner's latest answer, ``tool_output`` what the reasoner is shown of the
    tool's latest run. ``agreed`` is the answer both gave (the episode is then over).
    """

    question: str
    truth: str
    reasoner_answer: str | None = None
    reasoner_text: str = ""
    reasoner_turn: int = -1
    tool_answer: str | None = None
    tool_turn: int = -1
    agreed: str | None = None


_INTRO = {
    "reasoner": "You are the reasoning agent of a two-agent team solving a math problem with a tool agent who writes "
                "Python. The episode ends when your answers agree.",
    "tool": "You are the tool agent of a two-agent team solving a math problem with a reasoning agent. You write a "
            "Python program; it runs, and the last line it prints is your answer. The episode ends when your answers agree.",
}
_ASK = {
    "reasoner": "Reason step by step, then end with one line `Answer: <value>` (a number or a simplified expression).",
    "tool": "Write a Python program that computes the answer and prints it (only the answer, on the last line). "
            "Reply with the program in a ```python block.",
}


class MathEnv(Environment):
    """Math with a reasoner and a sandboxed tool agent; see the module docstring for the rewards."""

    name: ClassVar[str] = "math"
    roles: ClassVar[tuple[str, ...]] = ("reasoner", "tool")
    parallel: ClassVar[bool] = True
    max_reward: ClassVar[float] = TEAM_CORRECT
    Options = MathOptions

    def __init__(self, opts: MathOptions | None = None) -> None:
        self.opts = opts or MathOptions()
        if isinstance(self.opts.max_turns, bool) or not isinstance(self.opts.max_turns, int) or self.opts.max_turns < 1:
            raise ConfigError(f"task.max_turns={self.opts.max_turns!r}: must be an int >= 1")
        if self.opts.final not in ("agreed", "reasoner"):
            raise ConfigError(f"task.final={self.opts.final!r}: choose agreed or reasoner")
        self.max_turns = self.opts.max_turns
        self.limits = SandboxLimits(wall_seconds=float(self.opts.wall_seconds), cpu_seconds=float(self.opts.wall_seconds))
        self._problems = load_math_problems(self.opts)

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def reset(self, problem: Problem) -> MathState:
        return MathState(question=str(problem.data["question"]), truth=str(problem.data["answer"]))

    def _check_role(self, role: str) -> None:
        if role not in self.roles:
            raise ValueError(f"role {role!r}: {self.name} has roles {list(self.roles)}")

    def observe(self, state: MathState, role: str) -> list[dict[str, str]]:
        self._check_role(role)
        parts = [_INTRO[role], f"Problem:\n{state.question}", f"Turn {min(state.turn + 1, self.max_turns)} of {self.max_turns}."]
        if role == "tool" and state.reasoner_turn >= 0:
            said = state.reasoner_answer if state.reasoner_answer is not None else "(no readable answer)"
            parts.append(f"The reasoning agent's previous answer: {said}\nIts reasoning (may be wrong):\n{state.reasoner_text}")
        if role == "reasoner" and state.tool_turn >= 0:
            said = state.tool_answer if state.tool_answer is not None else "(no answer)"
            parts.append(f"The tool agent's previous answer: {said}\nIts program's output (may be wrong):\n{state.tool_output}")
        parts.append(_ASK[role])
        return [{"role": "user", "content": "\n\n".join(parts)}]

    def apply(self, state: MathState, role: str, text: str) -> tuple[MathState, float]:
        """(new state, local reward); a no-op with reward 0 once the episode is over. The tool's
        answer ends the turn. ``state`` is frozen and never changed."""
        self._check_role(role)
        if not isinstance(text, str):
            raise ValueError(f"math.apply: text must be a str, got {type(text).__name__}")
        if self.done(state):
            return self.clone(state), 0.0
        if role == "reasoner":
            answer = extract_answer(text)
            new = replace(state, reasoner_answer=answer, reasoner_text=truncate(text.strip(), REASONING_SHOWN),
                          reasoner_turn=state.turn)
            reward = REASONER_CORRECT if answer is not None and answers_equal(answer, state.truth) else REASONER_WRONG
            other = state.tool_answer
        else:
            answer, output, reward = self.run_tool(state, text)
            new = replace(state, tool_answer=answer, tool_output=output, tool_turn=state.turn, turn=state.turn + 1)
            other = state.reasoner_answer
        if answer is not None and other is not None and answers_equal(answer, other):
            new = replace(new, agreed=answer)
        return new, float(reward)

    def run_tool(self, state: MathState, text: str) -> tuple[str | None, str, float]:
        """(answer, what the reasoner will see, tool reward) for the tool's answer ``text``: its
        code runs in the sandbox; never raises because of what the code does."""
        code = extract_code(text)
        if not code:
            return None, "(the tool agent wrote no program)", TOOL_FAILED
        result = run_program(code, limits=self.limits)
        shown = describe_result(result)
        answer = printed_answer(result.stdout) if result.status == "ok" else None
        if answer is None:
            return None, shown, TOOL_FAILED
        return answer, shown, TOOL_SOLVED if answers_equal(answer, state.truth) else TOOL_RAN

    def final_answer(self, state: MathState) -> str | None:
        """The team's answer: the agreed one; without agreement, the reasoner's latest when
        ``final: reasoner``, else None."""
        if state.agreed is not None:
            return state.agreed
        return state.reasoner_answer if self.opts.final == "reasoner" else None

    def team_reward(self, state: MathState) -> float:
        final = self.final_answer(state)
        return TEAM_CORRECT if final is not None and answers_equal(final, state.truth) else 0.0

    def done(self, state: MathState) -> bool:
        return state.agreed is not None or state.turn >= self.max_turns

    def clone(self, state: MathState) -> MathState:
        return replace(state)  # every field is immutable
