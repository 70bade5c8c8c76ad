"""Deciding a test outside the untrusted process.

A test snippet of a common data-set shape (HumanEval, MBPP, HumanEval+ asserts) is split
here into a *call* (a function name and literal arguments) and an *expectation* (a literal
and a comparison). Only the call goes to the sandboxed process; it sends back the call's
value as plain data (None, bool, int, float, complex, str, bytes and lists, tuples, dicts,
sets and frozensets of them; a subclass of these, say ``collections.Counter``, is sent as its
plain content, and an instance of any other class is a failure; for a bare ``assert f(...)``
only its truth value), and :meth:`CallTest.judge` compares it here. The sandboxed process never
sees the expected value, so neither an object whose ``__eq__`` always returns True nor a
program that reaches the harness's reporting function can turn a wrong answer into a pass.

Shapes split (``f`` a name, every argument a literal, ``L`` a literal)::

    assert f(...) == L        (also !=, <, <=, >, >=; L == f(...); is / is not None/True/False)
    assert f(...)             assert not f(...)
    assert abs(f(...) - L) < L        assert math.isclose(f(...), L[, rel_tol=L, abs_tol=L])

at module level, or as the single assert of ``def check(candidate): ...`` followed by
``check(f)``, with only imports and literal assignments (METADATA) around it.

A HumanEval+ input chunk (written by :func:`reference_check_source`) has no expected value
in it, only inputs and a reference solution: it becomes a :class:`ReferenceTest`. The
sandboxed process calls the candidate on each input and sends back the list of outputs; the
reference solution runs on the same inputs in a second, separate sandbox run (it never
enters the candidate's process), and :meth:`ReferenceTest.judge` compares the two here with
evalplus's rules (an output over 4,000 characters encoded travels as its sha256, a
:class:`LargeValue`, on both sides).

Any other test (a ``check`` with loops, helpers, random inputs...) runs whole in a second,
separate sandbox process, the *judge*, that never holds the program: each name the test takes
from the program (:func:`program_names`) is a proxy there, whose calls the caller relays to the
program's process, and only plain values come back, so every assert is evaluated where the
program cannot reach. A test that needs more of the program than calls (an attribute of its
function, a non-plain argument) is reported as one that cannot be judged, never passed.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

# CPython 3.11 keeps one AST recursion counter per interpreter: two threads (the sandbox pool's)
# converting ASTs at once can fail with 'SystemError: AST constructor recursion depth mismatch'.
_AST_LOCK = threading.Lock()

__all__ = [
    "CallTest",
    "ReferenceTest",
    "RefusedValue",
    "decode_plain",
    "evalplus_same",
    "program_names",
    "reference_check_source",
    "split_test",
]

# Bigger values than this (as sent) are refused rather than parsed.
MAX_VALUE_CHARS = 1 << 20
# A set, frozenset or dict with more elements (keys) of one hash than this is refused: building
# it costs the square of their number (ints k * (2**61 - 1) all hash alike), paid by the caller.
MAX_SAME_HASH = 64


class RefusedValue(ValueError):
    """A well-formed value the caller will not rebuild (too costly): a wrong answer."""

_COMPARISONS: dict[type, tuple[Callable[[Any, Any], Any], str]] = {
    ast.Eq: (operator.eq, "=="),
    ast.NotEq: (operator.ne, "!="),
    ast.Lt: (operator.lt, "<"),
    ast.LtE: (operator.le, "<="),
    ast.Gt: (operator.gt, ">"),
    ast.GtE: (operator.ge, ">="),
    ast.Is: (operator.is_, "is"),
    ast.IsNot: (operator.is_not, "is not"),
}
_MIRRORED = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE}


@dataclass(frozen=True, eq=False)
class CallTest:
    """A test split into the call run in the sandbox and the check made here."""

    name: str
    args: tuple
    kwargs: dict
    call_source: str
    check: Callable[[Any], bool] = field(repr=False)
    expected: str = ""
    assert_source: str = ""
    wants: str = "value"  # "truth": the sandbox sends bool(value) (bare and negated asserts)

    def judge(self, got: Any) -> tuple[bool, str]:
        """(passed, what was expected) for the plain value ``got``."""
        try:
            return bool(self.check(got)), self.expected
        except Exception as exc:  # noqa: BLE001 - e.g. None < 1: a failed test, as the assert would be
            return False, f"{self.expected} ({type(exc).__name__}: {exc})"


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _call(node: ast.AST, source: str, candidate: str | None) -> tuple[str, tuple, dict, str] | None:
    """``f(<literals>)`` -> (name, args, kwargs, source); else None. ``candidate``: inside
    ``check(candidate)``, the name the call must use, and the function it stands for."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return None
    if candidate is not None and node.func.id != "candidate":
        return None
    args = []
    for arg in node.args:
        ok, value = _literal(arg)
        if not ok or isinstance(arg, ast.Starred):
            return None
        args.append(value)
    kwargs = {}
    for kw in node.keywords:
        ok, value = _literal(kw.value)
        if kw.arg is None or not ok:
            return None
        kwargs[kw.arg] = value
    text = ast.get_source_segment(source, node)
    if text is None:
        return None
    name = candidate if candidate is not None else node.func.id
    return name, tuple(args), kwargs, text


def _expectation(test: ast.AST, source: str, candidate: str | None):
    """(call, check, expected text) for an assert's test expression, or None."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        call = _call(test.operand, source, candidate)
        return (call, lambda got: got is False, "a false value") if call else None
    call = _call(test, source, candidate)
    if call:
        return call, lambda got: got is True, "a true value"
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, type(test.ops[0]), test.comparators[0]
        if op not in _COMPARISONS:
            return None
        call = _call(left, source, candidate)
        ok, expected = _literal(right)
        if not (call and ok):  # L op f(...): mirror it
            call = _call(right, source, candidate)
            ok, expected = _literal(left)
            op = _MIRRORED.get(op, op)
            if not (call and ok):
                return _tolerance(test, source, candidate)
        if op in (ast.Is, ast.IsNot) and expected not in (None, True, False):
            return None
        compare, symbol = _COMPARISONS[op]
        return call, lambda got: compare(got, expected), f"{symbol} {expected!r}"
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr == "isclose":
        if not (isinstance(test.func.value, ast.Name) and test.func.value.id == "math") or len(test.args) != 2:
            return None
        call = _call(test.args[0], source, candidate)
        ok, expected = _literal(test.args[1])
        if not (call and ok):
            call = _call(test.args[1], source, candidate)
            ok, expected = _literal(test.args[0])
        options = {}
        for kw in test.keywords:
            kw_ok, value = _literal(kw.value)
            if kw.arg not in ("rel_tol", "abs_tol") or not kw_ok:
                return None
            options[kw.arg] = value
        if not (call and ok):
            return None
        return (
            call,
            lambda got: math.isclose(got, expected, **options),
            f"close to {expected!r} ({options or 'rel_tol=1e-09'})",
        )
    return None


def _tolerance(test: ast.Compare, source: str, candidate: str | None):
    """``abs(f(...) - L) < L`` (or ``abs(L - f(...)) <= L``)."""
    inner, op, bound_node = test.left, type(test.ops[0]), test.comparators[0]
    if op not in (ast.Lt, ast.LtE) or not (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name)):
        return None
    if inner.func.id != "abs" or len(inner.args) != 1 or inner.keywords:
        return None
    diff = inner.args[0]
    ok_bound, bound = _literal(bound_node)
    if not (isinstance(diff, ast.BinOp) and isinstance(diff.op, ast.Sub) and ok_bound):
        return None
    call = _call(diff.left, source, candidate)
    ok, target = _literal(diff.right)
    if not (call and ok):
        call = _call(diff.right, source, candidate)
        ok, target = _literal(diff.left)
    if not (call and ok):
        return None
    compare = operator.lt if op is ast.Lt else operator.le
    return call, lambda got: compare(abs(got - target), bound), f"within {bound!r} of {target!r}"


def _ignorable(node: ast.stmt) -> bool:
    """Module lines around the assert that cannot change its call: imports, literal assignments."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    return (
        isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets) and _literal(node.value)[0]
    )


# ---------------------------------------------------------------------------------------
# HumanEval+ input chunks: outputs compared with a reference solution's
# ---------------------------------------------------------------------------------------

REFERENCE_CHECK = "_teamrl_reference_check"


def short_repr(value: Any, limit: int = 200) -> str:
    """repr() cut to ``limit`` characters; an int too long for decimal is shown by its size."""
    try:
        text = repr(value)
    except ValueError:  # Python's 4300-digit limit on int -> str (inside a container, too)
        return f"<a value with an int of about {value.bit_length() if isinstance(value, int) else '?'} bits>"
    return text if len(text) <= limit else text[:limit] + "..."


def evalplus_same(got: Any, expected: Any, atol: float) -> bool:
    """evalplus's comparison: exact, else for float outputs (a float, or a non-empty list or
    tuple of floats) ``|got - expected| <= atol + 1e-7 * |expected|`` element-wise, of the same
    type; ``atol`` 0 means 1e-6 for float outputs (np.allclose without numpy)."""
    if got == expected:
        return True

    def floats(x: Any) -> bool:
        return isinstance(x, float) or (
            isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(i, float) for i in x)
        )

    if atol == 0 and floats(expected):
        atol = 1e-6
    if atol == 0 or type(got) is not type(expected):
        return False
    if isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(abs(g - e) <= atol + 1e-7 * abs(e) for g, e in zip(got, expected))
    return abs(got - expected) <= atol + 1e-7 * abs(expected)


@dataclass(frozen=True, eq=False)
class ReferenceTest:
    """Inputs whose expected outputs are a reference solution's (a HumanEval+ chunk).

    The sandbox calls ``name`` on each of ``args`` (argument lists) and sends back the list
    of outputs; the caller runs ``reference`` on the same inputs in a second sandbox run and
    calls :meth:`judge`. For ``find_zero`` the check is evalplus's: ``|poly(*input, got)| <=
    atol``, poly being the reference's, also run in a second sandbox run.
    """

    name: str
    args: tuple
    reference: str
    atol: float
    first: int
    label: str
    find_zero: bool
    kwargs: dict = field(default_factory=dict)
    wants: str = "each"  # the sandbox sends [name(*a) for a in args]

    @property
    def call_source(self) -> str:
        last = self.first + len(self.args) - 1
        return f"{self.name}(*input) for {self.label} inputs #{self.first}-#{last}"

    @property
    def assert_source(self) -> str:
        return f"{self.label} inputs #{self.first}-#{self.first + len(self.args) - 1} against the reference solution"

    def reference_call(self, got: list) -> CallTest:
        """The call the reference's sandbox run makes: its outputs on the same inputs, or for
        find_zero, poly at each candidate output."""
        if self.find_zero:
            args = tuple([*a, g] for a, g in zip(self.args, got))
            return CallTest(
                "poly", args, {}, f"poly(*input, got) for {self.label} inputs", lambda _: True, wants="each"
            )
        return CallTest(
            self.name, self.args, {}, f"{self.name}(*input) for {self.label} inputs", lambda _: True, wants="each"
        )

    def judge(self, got: list, reference_values: list) -> tuple[bool, str | None]:
        """(passed, why not) for the candidate's outputs ``got`` given the reference run's
        values (its outputs, or poly at ``got`` for find_zero)."""
        for k, (args, output, value) in enumerate(zip(self.args, got, reference_values)):
            expected = "a zero of poly" if self.find_zero else short_repr(value)
            try:
                ok = abs(value) <= self.atol if self.find_zero else evalplus_same(output, value, self.atol)
            except Exception as exc:  # noqa: BLE001 - e.g. abs(None): not a pass
                ok, expected = False, f"{expected} ({type(exc).__name__}: {exc})"
            if not ok:
                return (
                    False,
                    f"{self.label} input #{self.first + k}: {short_repr(args)} -> {short_repr(output)}, "
                    f"expected {expected}",
                )
        return True, None


def reference_check_source(entry_point: str, reference: str, inputs: list, atol: float = 0.0, *,
                           first: int = 0, label: str = "plus") -> str:
    """A test that :func:`split_test` turns into a :class:`ReferenceTest`: ``entry_point`` on
    each of ``inputs`` (JSON-like argument lists), compared with what ``reference`` (a complete
    program) returns. Run as a plain snippet it fails (the name it calls is not defined), so a
    test the judge cannot read never passes."""
    spec = {"entry_point": entry_point, "reference": reference, "inputs": [list(a) for a in inputs],
            "atol": float(atol), "first": first, "label": label}
    return f"{REFERENCE_CHECK}({json.dumps(spec)!r})\n"


def _reference_test(tree: ast.Module) -> ReferenceTest | None:
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    call = tree.body[0].value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == REFERENCE_CHECK):
        return None
    if (
        len(call.args) != 1
        or call.keywords
        or not isinstance(call.args[0], ast.Constant)
        or not isinstance(call.args[0].value, str)
    ):
        return None
    try:
        spec = json.loads(call.args[0].value)
        entry, reference, inputs = spec["entry_point"], spec["reference"], spec["inputs"]
        atol, first, label = float(spec["atol"]), int(spec["first"]), str(spec["label"])
    except (ValueError, KeyError, TypeError):
        return None
    if not (isinstance(entry, str) and isinstance(reference, str) and isinstance(inputs, list)
            and all(isinstance(a, list) for a in inputs)):
        return None
    return ReferenceTest(name=entry, args=tuple(inputs), reference=reference, atol=atol, first=first,
                         label=label, find_zero=entry == "find_zero")


def split_test(source: str) -> CallTest | ReferenceTest | None:
    """The test ``source`` as a :class:`CallTest` or :class:`ReferenceTest`, or None when it
    has another shape."""
    try:
        with _AST_LOCK:
            tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    reference_test = _reference_test(tree)
    if reference_test is not None:
        return reference_test
    body = [n for n in tree.body if not _ignorable(n)]
    candidate = None
    if len(body) == 1 and isinstance(body[0], ast.Assert):
        assertion = body[0]
    elif (
        len(body) == 2
        and isinstance(body[0], ast.FunctionDef)
        and body[0].name == "check"
        and [a.arg for a in body[0].args.args] == ["candidate"]
        and not (body[0].decorator_list or body[0].args.vararg or body[0].args.kwarg or body[0].args.kwonlyargs)
        and isinstance(body[1], ast.Expr)
        and isinstance(body[1].value, ast.Call)
        and isinstance(body[1].value.func, ast.Name)
        and body[1].value.func.id == "check"
        and len(body[1].value.args) == 1
        and not body[1].value.keywords
        and isinstance(body[1].value.args[0], ast.Name)
    ):
        statements = list(body[0].body)
        if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
            statements = statements[1:]  # a docstring
        statements = [s for s in statements if not isinstance(s, (ast.Import, ast.ImportFrom))]
        if len(statements) != 1 or not isinstance(statements[0], ast.Assert):
            return None
        assertion = statements[0]
        candidate = body[1].value.args[0].id
    else:
        return None
    found = _expectation(assertion.test, source, candidate)
    if found is None:
        return None
    (name, args, kwargs, text), check, expected = found
    assert_source = ast.get_source_segment(source, assertion) or ""
    wants = "truth" if expected in ("a true value", "a false value") else "value"
    return CallTest(name=name, args=args, kwargs=kwargs, call_source=text, check=check, expected=expected,
                    assert_source=assert_source, wants=wants)


# ---------------------------------------------------------------------------------------
# tests judged whole in the judge's process: the names they take from the program
# ---------------------------------------------------------------------------------------

# Module-level names every namespace has: never the program's.
_MODULE_DUNDERS = frozenset({"__name__", "__doc__", "__builtins__", "__spec__", "__loader__", "__package__"})


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name ``tree`` binds anywhere (any scope): assignments, loop and comprehension
    targets, definitions, parameters, imports, ``except ... as``, match captures."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
    return bound


def program_names(test: str, setup: str = "") -> tuple[str, ...]:
    """The names ``test`` uses but neither binds itself nor finds in ``setup`` or the
    builtins: in the judge's process each becomes a proxy for the program's object of that
    name. A test that does not parse gets none (the judge reports its SyntaxError)."""
    import builtins

    try:
        with _AST_LOCK:
            tree = ast.parse(test)
            setup_tree = ast.parse(setup) if setup else None
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return ()
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    known = _bound_names(tree) | set(vars(builtins)) | _MODULE_DUNDERS
    if setup_tree is not None:
        known |= _bound_names(setup_tree)
    return tuple(sorted(loaded - known))


# ---------------------------------------------------------------------------------------
# plain values, as the harness sends them: JSON of a tree of [tag, payload] lists (str and
# bytes as hex, bool as 0 or 1)
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LargeValue:
    """An output of a reference test too large to send (over 4,000 characters encoded): the
    sha256 of its encoding (sets and dicts in a canonical order). Two are equal when their
    digests are, so a large output matches only an identically encoded one (``[1, 2]`` does
    not match ``[1.0, 2.0]``, unlike Python's ``==``)."""

    sha256: str


def _few_alike(items: list) -> list:
    """``items``, once no more than :data:`MAX_SAME_HASH` of them hash alike; RefusedValue
    otherwise. Counting is linear: distinct hashes are ints whose own hashes differ."""
    counts: dict[int, int] = {}
    for item in items:
        h = hash(item)  # TypeError for an unhashable element: the caller's "malformed"
        counts[h] = counts.get(h, 0) + 1
        if counts[h] > MAX_SAME_HASH:
            raise RefusedValue(f"a set or dict with more than {MAX_SAME_HASH} elements that hash alike (refused: "
                               "rebuilding it would cost the square of their number)")
    return items


def _build(node: Any, depth: int) -> Any:
    if depth > 200:
        raise ValueError("a value nested too deeply")
    if type(node) is not list or not node or type(node[0]) is not str:
        raise ValueError("a malformed value")
    tag = node[0]
    if tag == "n" and len(node) == 1:
        return None
    if len(node) != 2:
        raise ValueError("a malformed value")
    payload = node[1]
    if tag == "i" and type(payload) is int:
        return payload
    if tag == "b" and type(payload) is int and payload in (0, 1):
        return payload == 1
    if tag in ("s", "y", "h", "#", "f") and type(payload) is str:
        try:
            if tag == "s":
                return bytes.fromhex(payload).decode("utf-8", "surrogatepass")
            if tag == "y":
                return bytes.fromhex(payload)
            if tag == "h":  # an int too long for decimal
                return int(payload, 16)
            if tag == "f":
                return float.fromhex(payload)
        except ValueError:  # not hex, not UTF-8
            raise ValueError("a malformed value") from None
        if len(payload) == 64:
            return LargeValue(payload)
        raise ValueError("a malformed value")
    if tag == "c" and type(payload) is list and len(payload) == 2 and all(type(p) is str for p in payload):
        try:
            return complex(float.fromhex(payload[0]), float.fromhex(payload[1]))
        except ValueError:
            raise ValueError("a malformed value") from None
    if type(payload) is not list:
        raise ValueError("a malformed value")
    if tag == "l":
        return [_build(x, depth + 1) for x in payload]
    if tag == "t":
        return tuple(_build(x, depth + 1) for x in payload)
    try:
        if tag == "S":
            return set(_few_alike([_build(x, depth + 1) for x in payload]))
        if tag == "F":
            return frozenset(_few_alike([_build(x, depth + 1) for x in payload]))
        if tag == "d":
            pairs = [x for x in payload if type(x) is list and len(x) == 2]
            if len(pairs) != len(payload):
                raise ValueError("a malformed value")
            keys = _few_alike([_build(k, depth + 1) for k, _ in pairs])
            return dict(zip(keys, [_build(v, depth + 1) for _, v in pairs]))
    except TypeError as exc:  # an unhashable key
        raise ValueError(f"a malformed value ({exc})") from None
    raise ValueError("a malformed value")


def _no_constant(name: str) -> Any:
    raise ValueError(f"a malformed value ({name})")


def decode_plain(text: str) -> Any:
    """The plain value the harness encoded as ``text``; ValueError for anything else (a
    program may write what it likes, so nothing here trusts the text). JSON, not Python
    literals: ``ast.literal_eval`` took 1.5 s a megabyte of the caller's time, json 10 ms."""
    if len(text) > MAX_VALUE_CHARS:
        raise ValueError(f"a value over {MAX_VALUE_CHARS} characters")
    if text.startswith("!"):
        raise ValueError(text[1:301])  # the harness's own refusal: "a <type>, not plain data"
    try:
        tree = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"a malformed value ({type(exc).__name__})") from None
    return _build(tree, 0)
