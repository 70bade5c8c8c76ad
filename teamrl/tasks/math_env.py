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

teamrl reads the final answer out of a reply (:func:`extract_answer`: the last ``\\boxed{}``,
else the last ``Answer:`` line; a tool's last printed line); HF's math-verify decides whether
it is right (:func:`grade_answer`: its ``parse`` + ``verify``, the truth as gold) and whether two
roles agree (:func:`answers_equal`: either way round). math-verify parses LaTeX with an ANTLR
grammar (its plain-expression path, which ``eval``s, is not used). Its ``signal.alarm``
timeouts work on the main thread only, so they are on there and off elsewhere; on every thread
an answer longer than ``MAX_ANSWER_CHARS``, or whose parse could take unbounded time (huge
powers, factorials or integers; sums, integrals, limits), is compared as text only
(:func:`_bounded`), so a grade does not depend on the thread.

Data: GSM8K (``load_gsm8k``), MATH-500 / AIME / AMC JSONL (``load_math``), a seeded
arithmetic word-problem generator (source ``generated``, the default: no files needed) and,
when installed, ``reasoning-gym`` datasets (source ``reasoning_gym:<dataset>``).
"""

from __future__ import annotations

import ast
import functools
import logging
import math
import random
import re
import threading
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
MAX_ANSWER_CHARS = 200  # a longer answer is compared as text only (never parsed)
MAX_EXPONENT = 1000  # an answer whose numeric exponents multiply past this is compared as text only
MAX_DIGITS = 100  # so is an integer literal with more digits
MAX_FACTORIAL = 1000  # and a factorial or binomial of a larger number
GRADE_TIMEOUT_S = 5  # math-verify's own limit per parse and per comparison, on the main thread only
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
    max_operand: int = option(
        20,
        ge=2,
        le=1000,
        doc="generated_easy: the largest operand of a sum or difference (a "
        "difficulty knob; a product's factors go up to 9 * max_operand // 20, at least 2)",
    )
    wall_seconds: float = option(5.0, gt=0, doc="sandbox wall-clock (and CPU) limit per tool program")
    final: str = option(
        "agreed",
        choices=("agreed", "reasoner"),
        doc="team reward without agreement: agreed = 0; reasoner = the reasoner's latest answer decides",
    )


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


# "answer is" may be followed by its own colon or equals sign ("The final answer is: 42", "**answer is**: 42"),
# which is punctuation, not part of the answer
_ANSWER_LINE = re.compile(
    r"(?im)(?:^|[\s.,;:])[*_#>\- \t]*(?:the[^\S\n]+)?(?:final[^\S\n]+)?answer[^\S\n]*[*_]*[^\S\n]*"
    r"(?:is\b[*_]*[^\S\n]*[:=]?|[:=])[*_]*[^\S\n]*(.*)$"
)


def extract_answer(text: str) -> str | None:
    """The answer in a reasoner's text: the last ``\\boxed{...}``, else what follows the last
    ``Answer:`` label, ``answer is`` or ``answer is:`` (at the start of a line or after text on it;
    markdown emphasis allowed),
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


_NUMBER_AND_WORD = re.compile(r"^([-+]?[\d,]*\.?\d+)\s+[a-zA-Z]+\.?$")  # "18 dollars", "5 cm"
# LaTeX that latex2sympy evaluates while parsing (\binom{10^6}{500000} would run for minutes)
_EAGER = re.compile(r"\\(?:[dt]?binom|choose|gcd|lcm)\b|\\operatorname\s*\{\s*(?:gcd|lcm)")
_CALCULUS = frozenset({"Sum", "Product", "Integral", "Limit", "Derivative"})
_FACTORIALS = frozenset(
    {"factorial", "factorial2", "subfactorial", "binomial", "gamma", "RisingFactorial", "FallingFactorial"}
)


def answer_text(value: Any) -> str:
    """A data set's answer as text for :func:`grade_answer`: a str stripped, an integral float as
    an int (``27.0`` -> ``"27"``), ``""`` for None or a bool."""
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _verify_input(answer: Any) -> str:
    """The text handed to math-verify for ``answer``: a number followed by one word ("18 dollars")
    is the number (math-verify's unit list lacks most words)."""
    s = answer_text(answer)
    unit = _NUMBER_AND_WORD.match(s)
    return unit.group(1) if unit else s


def _bounded(expr: Any, scale: float = 1.0) -> bool:
    """Whether verifying ``expr`` (math-verify's parse, not evaluated) stays cheap: the product of
    the numeric exponents above a term stays within ``MAX_EXPONENT``, integer literals have at most ``MAX_DIGITS``
    digits, factorials and binomials
    have arguments up to ``MAX_FACTORIAL``, and no sum, product, integral, limit or derivative is
    left to evaluate. math-verify bounds this work with ``signal.alarm``, which works only on the
    main thread, so teamrl refuses such expressions on every thread (same grades everywhere)."""
    import sympy

    if isinstance(expr, sympy.Integer):
        return abs(int(expr)).bit_length() <= MAX_DIGITS * 3.33  # log2(10) bits a digit; no str() of a huge int
    name = type(expr).__name__
    if name in _CALCULUS:
        return False
    args = expr.args if isinstance(expr, sympy.Basic) else list(expr) if isinstance(expr, sympy.MatrixBase) else ()
    if isinstance(expr, sympy.Pow):
        exp = expr.exp
        if not _bounded(exp):
            return False
        if not exp.free_symbols:  # a symbolic exponent (2^n) is never expanded into digits
            try:
                scale *= max(1.0, abs(float(exp)))
            except (TypeError, ValueError, OverflowError):
                return False
        return math.isfinite(scale) and scale <= MAX_EXPONENT and _bounded(expr.base, scale)
    if name in _FACTORIALS:
        for a in args:
            if not _bounded(a):
                return False
            if not a.free_symbols:
                try:
                    if abs(float(a)) > MAX_FACTORIAL:
                        return False
                except (TypeError, ValueError, OverflowError):
                    return False
    return all(_bounded(a, scale) for a in args)


_math_verify: Any = None


def _load_math_verify() -> Any:
    """math-verify, imported on first use (it loads sympy and an ANTLR parser); its one-time
    "Timeout is disabled" warning (off the main thread) is dropped: teamrl bounds the work
    itself there (:func:`_bounded`)."""
    global _math_verify
    if _math_verify is None:
        import math_verify

        class _NoTimeoutWarning(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                return not str(record.msg).startswith("Timeout is disabled")

        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_NoTimeoutWarning())
        _math_verify = math_verify
    return _math_verify


def _timeout() -> int | None:
    """math-verify's timeout for this thread: ``GRADE_TIMEOUT_S`` on the main thread, where its
    ``signal.alarm`` works; None (off) elsewhere, where that raises (:func:`_bounded` and the
    length cap bound the work there)."""
    return GRADE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> tuple[Any, ...]:
    """math-verify's parse of one extracted answer (given as ``\\boxed{text}``, LaTeX only: its
    plain-expression path ``eval``s text), keeping only the parts :func:`_bounded` allows; cached
    (a group's answers and a problem's truth repeat). Text with a command latex2sympy evaluates
    while parsing and a large number (a power, a factorial, four digits) is not parsed."""
    if _EAGER.search(text) and re.search(r"\^|!|\d{4}", text):
        return (text,)
    mv = _load_math_verify()
    got = mv.parse("\\boxed{" + text + "}", extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=_timeout())
    return tuple(x for x in got if isinstance(x, str) or _bounded(x))


def grade_answer(answer: Any, truth: Any) -> bool:
    """Whether the extracted ``answer`` is right for the reference ``truth``; never raises.

    math-verify compares them (``verify(gold=parse(truth), target=parse(answer))``: numbers to
    6 decimals, fractions, LaTeX, ``x = 3`` against ``3``, percentages, units, sets in any order,
    tuples and intervals in order, symbolic equality); equal text (spacing aside) is equal at once,
    and text over ``MAX_ANSWER_CHARS`` is compared only so. Empty or missing answers are wrong.
    """
    try:
        a, t = _verify_input(answer), _verify_input(truth)
        if not a or not t:
            return False
        if re.sub(r"\s+", "", a) == re.sub(r"\s+", "", t):
            return True
        if len(a) > MAX_ANSWER_CHARS or len(t) > MAX_ANSWER_CHARS:
            return False
        return bool(_load_math_verify().verify(list(_parsed(t)), list(_parsed(a)), timeout_seconds=_timeout()))
    except Exception:  # answers are model text: never let a comparison crash a rollout
        return False


def answers_equal(a: Any, b: Any) -> bool:
    """Whether two answers (neither the reference: e.g. the reasoner's and the tool's) are the same
    value: :func:`grade_answer` either way round (math-verify's comparison is not symmetric)."""
    return grade_answer(a, b) or grade_answer(b, a)


# --- data ----------------------------------------------------------------------------------------


def load_gsm8k(path: str | Path, limit: int | None = None) -> list[Problem]:
    """GSM8K JSONL (``question``, ``answer`` with the final answer after ``####``)."""
    rows = read_jsonl(path, "GSM8K", "see docs/data.md")
    stem = Path(path).stem
    problems = []
    for i, row in enumerate(rows[:limit] if limit else rows):
        if "question" not in row or "answer" not in row or "####" not in str(row["answer"]):
            raise InputError(
                f"{path}: line {i + 1} needs `question` and an `answer` with `#### <final>`; found {sorted(row)}"
            )
        final = answer_text(str(row["answer"]).rsplit("####", 1)[1])
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
                                {"question": row["problem"], "answer": answer_text(row["answer"]), "source": "math"}))
    return problems


_NAMES = (
    "Ava",
    "Ben",
    "Chloe",
    "Dev",
    "Emma",
    "Farid",
    "Grace",
    "Hugo",
    "Iris",
    "Jonas",
    "Kemi",
    "Liam",
    "Mira",
    "Noah",
)
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


def _easy_template(rng: random.Random, max_operand: int = 20) -> tuple[str, str]:
    """(question, expression): one addition, subtraction or multiplication of numbers up to ``max_operand``
    (factors of a product up to ``9 * max_operand // 20``: 9 at the default 20)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
    kind = rng.randrange(3)
    if kind == 0:
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", f"{a} + {b}"
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", f"{a} - {b}"
    cap = max(2, 9 * max_operand // 20)
    a, b = min(a, cap), min(b, cap)
    return f"There are {a} bags with {b} {item} in each. How many {item} are there?", f"{a} * {b}"


def generate_arithmetic(n: int, seed: int = 0, easy: bool = False, max_operand: int = 20) -> list[Problem]:
    """``n`` seeded arithmetic word problems (problem i depends only on ``seed`` and i); ``easy``:
    one operation on numbers up to ``max_operand`` (source ``generated_easy``)."""
    source = "generated_easy" if easy else "generated"
    # another operand range is another problem set: its ids say so (the default keeps the ids it always had)
    tag = source if not easy or max_operand == 20 else f"{source}-{max_operand}"
    problems = []
    for i in range(n):
        rng = random.Random(f"math:{source}:{seed}:{i}")
        question, expression = (_easy_template(rng, max_operand) if easy else _template(rng))
        problems.append(Problem(f"math/{tag}/{seed}/{i}", {"question": question, "answer": str(_eval_int(expression)),
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
    return [
        Problem(
            f"math/reasoning_gym/{dataset}/{seed}/{i}",
            {"question": e["question"], "answer": answer_text(e["answer"]), "source": f"reasoning_gym:{dataset}"},
        )
        for i, e in enumerate(data)
    ]


def load_math_problems(opts: MathOptions) -> list[Problem]:
    """The problems ``opts`` names (see :class:`MathOptions`)."""
    src, n = opts.source, opts.num_problems
    if src in ("generated", "generated_easy"):
        return generate_arithmetic(
            n or GENERATED_DEFAULT, opts.seed, easy=src == "generated_easy", max_operand=opts.max_operand
        )
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
        self.limits = SandboxLimits(
            wall_seconds=float(self.opts.wall_seconds), cpu_seconds=float(self.opts.wall_seconds)
        )
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
        parts = [
            _INTRO[role],
            f"Problem:\n{state.question}",
            f"Turn {min(state.turn + 1, self.max_turns)} of {self.max_turns}.",
        ]
        if role == "tool" and state.reasoner_turn >= 0:
            said = state.reasoner_answer if state.reasoner_answer is not None else "(no readable answer)"
            parts.append(
                f"The reasoning agent's previous answer: {said}\nIts reasoning (may be wrong):\n{state.reasoner_text}"
            )
        if role == "reasoner" and state.tool_turn >= 0:
            said = state.tool_answer if state.tool_answer is not None else "(no answer)"
            parts.append(
                f"The tool agent's previous answer: {said}\nIts program's output (may be wrong):\n{state.tool_output}"
            )
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
            reward = REASONER_CORRECT if answer is not None and grade_answer(answer, state.truth) else REASONER_WRONG
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
        return answer, shown, TOOL_SOLVED if grade_answer(answer, state.truth) else TOOL_RAN

    def final_answer(self, state: MathState) -> str | None:
        """The team's answer: the agreed one; without agreement, the reasoner's latest when
        ``final: reasoner``, else None."""
        if state.agreed is not None:
            return state.agreed
        return state.reasoner_answer if self.opts.final == "reasoner" else None

    def team_reward(self, state: MathState) -> float:
        final = self.final_answer(state)
        return TEAM_CORRECT if final is not None and grade_answer(final, state.truth) else 0.0

    def done(self, state: MathState) -> bool:
        return state.agreed is not None or state.turn >= self.max_turns

    def clone(self, state: MathState) -> MathState:
        return replace(state)  # every field is immutable
