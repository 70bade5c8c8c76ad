"""Mutation testing of teamrl's training math with an explicit list of hand-written mutants.

Each mutant (see ``tools/mutants.py``) is one realistic one-line bug: the exact original snippet,
its replacement, and the test selectors that should catch it. For every mutant this tool copies
the project once into a temporary directory, writes the mutated file into the copy, runs the
mutant's tests there with a timeout, and restores the file in the copy. The working tree is never
written to, also not on Ctrl-C or a timeout, and the copy is removed at the end.

Why not mutmut or cosmic-ray (both on PyPI): they generate every operator mutation they can, several
per line (on the order of a thousand over these ~1,900 lines, an estimate; many in error messages),
and cannot tell which few tests cover a mutant without a coverage run of the suite first; at the
5-20 s that one mutant's small test selection takes here on 2 shared cores, that is hours. A list
of ~125 realistic mutants, each with its own small test selection, runs in 12-25 minutes and says
which behaviour a surviving mutant changes. Test runs fork from a server that has imported torch
and transformers once (:class:`ForkingRunner`), saving that import per mutant.

Outcomes per mutant: ``killed`` (a test failed, or the tests timed out), ``survived`` (all tests
passed), ``stale`` (the original snippet is not in the file exactly once: the code changed and the
mutant must be updated; never skipped silently), ``error`` (the tests did not run, e.g. a selector
that names no test). Mutants marked ``equivalent`` (with the reason) change no behaviour by
design; they are run and listed but not scored. The exit status is 0 only when there is no stale
mutant, no error, no unexplained survivor, and every module scores at least ``--min-score``.

Usage: ``python tools/mutate.py [--only SUBSTRING ...] [--check] [--list] [-v]``; ``make mutate``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
# Never copied into the mutation sandbox: environments, VCS data, caches and outputs.
COPY_IGNORE = (".git", ".venv", "venv", "runs", "__pycache__", ".pytest_cache", "*.egg-info", "build", "dist",
               ".hypothesis", "bench-venvs", ".venvs")
OUTCOMES = ("killed", "survived", "stale", "error")

# Runs in the test subprocess: import the mutated module first and refuse to test anything that is
# not the sandbox's copy (an editable install could otherwise win), then hand over to pytest.
_CHILD = """
import importlib, os, sys
root, module = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
if module:
    mod = importlib.import_module(module)
    where = os.path.realpath(mod.__file__)
    if not where.startswith(os.path.realpath(root) + os.sep):
        sys.stderr.write(f"mutate: {module} was imported from {where}, not from the sandbox {root}\\n")
        sys.exit(97)
import pytest
sys.exit(pytest.main(sys.argv[3:]))
"""


@dataclass(frozen=True)
class Mutant:
    """One hand-written bug: replace ``original`` (exactly one occurrence in ``file``) by ``replacement``.

    ``tests`` are pytest selectors (files or node ids) run against the mutant; ``equivalent`` is
    empty, or the reason why the mutant cannot change behaviour (it is then not scored).
    """

    id: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    description: str
    equivalent: str = ""


@dataclass
class Result:
    mutant: Mutant
    outcome: str  # one of OUTCOMES
    seconds: float = 0.0
    detail: str = ""  # why stale/error, or the tail of the test output


def module_name(file: str) -> str:
    """``teamrl/losses/advantages.py`` -> ``teamrl.losses.advantages``; ``teamrl/workflows/__init__.py`` ->
    ``teamrl.workflows`` (importing ``pkg.__init__`` would run the file a second time as a module of its own)."""
    return file[:-3].replace("/", ".").removesuffix(".__init__") if file.endswith(".py") else ""


def check_snippet(text: str, mutant: Mutant) -> str:
    """Empty when the mutant applies to ``text``, else why it is stale."""
    if mutant.original == mutant.replacement:
        return "original and replacement are identical"
    n = text.count(mutant.original)
    if n == 0:
        return f"original snippet not found in {mutant.file}: {mutant.original!r}"
    if n > 1:
        return f"original snippet occurs {n} times in {mutant.file} (must be exactly once): {mutant.original!r}"
    return ""


def _copy_project(root: Path, dest: Path) -> Path:
    sandbox = dest / "project"
    shutil.copytree(root, sandbox, ignore=shutil.ignore_patterns(*COPY_IGNORE), symlinks=True)
    return sandbox


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


def _pytest_args(mutant: Mutant) -> list[str]:
    return ["-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-W", "ignore::pytest.PytestAssertRewriteWarning",
            *mutant.tests]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class FreshProcessRunner:
    """Runs each mutant's tests in a new interpreter (simple; pays the torch/transformers import every time)."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, sandbox: Path, mutant: Mutant, timeout: float) -> tuple[int | None, str]:
        """(pytest's exit status, or None on timeout; the output's tail) for the mutant's tests in ``sandbox``."""
        cmd = [self.python, "-c", _CHILD, str(sandbox), module_name(mutant.file), *_pytest_args(mutant)]
        proc = subprocess.Popen(cmd, cwd=sandbox, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            return proc.returncode, out[-3000:]
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, _ = proc.communicate()
            return None, (out or "")[-3000:]
        except BaseException:  # Ctrl-C: end the test process group before the sandbox goes away
            _kill_group(proc.pid)
            proc.wait()
            raise


# The forking runner's server: import the heavy third-party modules once, then fork a fresh child per
# request (teamrl itself is never imported here, so every child imports the sandbox's mutated copy).
_SERVER = """
import json, os, sys, traceback
for name in sys.argv[1:]:
    __import__(name)
child = compile(CHILD, "<mutate-child>", "exec")
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        rc = 98
        try:
            os.setsid()
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(req["root"])
            sys.argv = [sys.argv[0], req["root"], req["module"], *req["args"]]
            exec(child, {"__name__": "__mutate_child__"})
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class ForkingRunner:
    """Runs each mutant's tests in a child forked from a server that has already imported ``preload``.

    Saves the ~2-3 s of importing torch and transformers per mutant. The child starts from the
    server's state before any teamrl import, so it is as isolated as a fresh interpreter for teamrl.
    """

    def __init__(self, python: str = sys.executable, preload: Sequence[str] = ("torch", "transformers", "pytest")) -> None:
        self.python = python
        self.preload = list(preload)
        self.proc: subprocess.Popen | None = None
        self._buf = b""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _start(self) -> None:
        code = _SERVER.replace("CHILD", repr(_CHILD))
        self.proc = subprocess.Popen([self.python, "-c", code, *self.preload], env=_child_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)

    def _read_line(self, deadline: float | None) -> dict | None:
        """The server's next JSON line, or None when ``deadline`` passes first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the mutation test server exited (status {self.proc.wait()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, sandbox: Path, mutant: Mutant, timeout: float) -> tuple[int | None, str]:
        if self.proc is None:
            self._start()
        log = sandbox.parent / "mutant-output.txt"
        req = {"root": str(sandbox), "module": module_name(mutant.file), "args": _pytest_args(mutant), "log": str(log)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._read_line(None)["pid"]
        try:
            reply = self._read_line(time.monotonic() + timeout)
            if reply is None:  # timeout: kill the child; the server then reports its status
                _kill_group(pid)
                self._read_line(None)
            rc = None if reply is None else reply["rc"]
        except BaseException:  # Ctrl-C: the child goes first, then the server (in __exit__)
            _kill_group(pid)
            raise
        return rc, log.read_text(errors="replace")[-3000:] if log.exists() else ""


def classify(rc: int | None) -> str:
    """pytest's exit status -> outcome: 0 survived; 1 (a test failed), 2 (collection error) or a timeout killed."""
    if rc is None or rc in (1, 2):
        return "killed"
    if rc == 0:
        return "survived"
    return "error"  # 3 internal error, 4 usage error (e.g. a selector naming no test), 5 no tests, 97 wrong module


def run_mutants(mutants: Sequence[Mutant], root: Path = ROOT, timeout: float = 180.0, runner=None,
                report: Callable[[int, int, Result], None] | None = None) -> list[Result]:
    """Apply each mutant to a sandbox copy of ``root`` in turn, run its tests, restore the copy; the results.

    ``root`` itself is only read. Stale mutants are reported without running anything. ``runner``
    (default: a :class:`ForkingRunner`) runs the tests; it is closed at the end.
    """
    results: list[Result] = []
    runner = runner if runner is not None else ForkingRunner()
    with tempfile.TemporaryDirectory(prefix="teamrl-mutate-") as tmp, runner:
        sandbox = _copy_project(root, Path(tmp))
        for i, m in enumerate(mutants, 1):
            target = sandbox / m.file
            original_text = target.read_text() if target.is_file() else None
            why = f"{m.file} does not exist" if original_text is None else check_snippet(original_text, m)
            if why:
                res = Result(m, "stale", detail=why)
            else:
                start = time.monotonic()
                try:
                    target.write_text(original_text.replace(m.original, m.replacement, 1))
                    rc, tail = runner.run(sandbox, m, timeout)
                finally:
                    target.write_text(original_text)
                outcome = classify(rc)
                detail = tail if outcome != "error" else f"tests did not run (exit status {rc}):\n{tail}"
                res = Result(m, outcome, time.monotonic() - start, ("timeout\n" if rc is None else "") + detail)
            results.append(res)
            if report:
                report(i, len(mutants), res)
    return results


def module_scores(results: Sequence[Result]) -> dict[str, tuple[int, int]]:
    """file -> (killed, scored) over the non-equivalent mutants that ran (killed or survived)."""
    scores: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in results:
        if r.mutant.equivalent or r.outcome not in ("killed", "survived"):
            continue
        scores[r.mutant.file][1] += 1
        scores[r.mutant.file][0] += r.outcome == "killed"
    return {f: (k, n) for f, (k, n) in sorted(scores.items())}


def summarise(results: Sequence[Result], min_score: float) -> tuple[str, bool]:
    """The closing report (counts, score per module, survivors, equivalent and stale mutants) and whether it passes."""
    lines = []
    by = defaultdict(list)
    for r in results:
        by[r.outcome].append(r)
    scored = [r for r in results if not r.mutant.equivalent and r.outcome in ("killed", "survived")]
    killed = sum(r.outcome == "killed" for r in scored)
    lines.append(f"mutants: {len(results)} ({len(scored)} scored, {sum(bool(r.mutant.equivalent) for r in results)} "
                 f"known equivalent, {len(by['stale'])} stale, {len(by['error'])} error)")
    if scored:
        lines.append(f"score: {killed}/{len(scored)} killed = {100 * killed / len(scored):.1f}%")
    ok = not by["stale"] and not by["error"]
    lines.append("score per module:")
    for file, (k, n) in module_scores(results).items():
        pct = 100 * k / n
        low = pct < min_score
        ok &= not low
        lines.append(f"  {file:40s} {k:3d}/{n:<3d} {pct:6.1f}%{'  < ' + str(min_score) + '%' if low else ''}")
    survivors = [r for r in by["survived"] if not r.mutant.equivalent]
    ok &= not survivors
    lines.append(f"survivors ({len(survivors)}):" if survivors else "survivors: none")
    for r in survivors:
        lines.append(f"  {r.mutant.id} [{r.mutant.file}]: {r.mutant.description}")
    equivalent = [r for r in results if r.mutant.equivalent]
    if equivalent:
        lines.append(f"known equivalent mutants ({len(equivalent)}, not scored):")
        for r in equivalent:
            note = f" [{r.outcome.upper()}: marked equivalent, but the tests noticed; check the reason]" \
                if r.outcome == "killed" else ("" if r.outcome == "survived" else f" [{r.outcome.upper()}]")
            lines.append(f"  {r.mutant.id} [{r.mutant.file}]: {r.mutant.description}. Equivalent: "
                         f"{r.mutant.equivalent}{note}")
    for kind in ("stale", "error"):
        if by[kind]:
            lines.append(f"{kind.upper()} ({len(by[kind])}): update tools/mutants.py")
            for r in by[kind]:
                lines.append(f"  {r.mutant.id} [{r.mutant.file}]: {r.detail.splitlines()[0] if r.detail else ''}")
    return "\n".join(lines), ok


def load_mutants(path: Path) -> list[Mutant]:
    """The ``MUTANTS`` list of a mutant file, checked for unique ids."""
    if str(ROOT) not in sys.path:  # the list imports Mutant from tools.mutate
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("teamrl_mutant_list", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mutants = list(mod.MUTANTS)
    seen = set()
    for m in mutants:
        if m.id in seen:
            raise ValueError(f"mutant id {m.id!r} appears twice in {path}")
        seen.add(m.id)
    return mutants


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", type=Path, default=ROOT / "tools" / "mutants.py", help="file defining MUTANTS")
    ap.add_argument("--only", nargs="+", default=[], help="run the mutants whose id or file contains one of these")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per mutant's tests (a timeout counts as killed)")
    ap.add_argument("--min-score", type=float, default=95.0, help="lowest passing score per module, in percent")
    ap.add_argument("--check", action="store_true", help="only check that every snippet applies (no tests run)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--fresh", action="store_true", help="a new interpreter per mutant instead of forked children")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the test output's tail of each mutant")
    args = ap.parse_args(argv)

    mutants = load_mutants(args.mutants)
    if args.only:
        mutants = [m for m in mutants if any(s in m.id or s in m.file for s in args.only)]
        if not mutants:
            print(f"no mutant id or file contains any of {args.only}", file=sys.stderr)
            return 2
    if args.list:
        for m in mutants:
            print(f"{m.id:45s} {m.file:38s} {m.description}{'  (equivalent)' if m.equivalent else ''}")
        return 0
    if args.check:
        stale = [(m, why) for m in mutants
                 if (why := (check_snippet((ROOT / m.file).read_text(), m) if (ROOT / m.file).is_file()
                             else f"{m.file} does not exist"))]
        for m, why in stale:
            print(f"STALE {m.id}: {why}")
        print(f"{len(mutants) - len(stale)}/{len(mutants)} mutants apply")
        return 1 if stale else 0

    def report(i: int, n: int, r: Result) -> None:
        tag = r.outcome.upper() + (" (equivalent)" if r.mutant.equivalent else "")
        print(f"[{i:3d}/{n}] {tag:24s} {r.seconds:5.1f}s  {r.mutant.id}  [{r.mutant.file}]", flush=True)
        if r.outcome in ("stale", "error") or args.verbose:
            print("        " + r.detail.strip().replace("\n", "\n        "), flush=True)

    start = time.monotonic()
    runner = FreshProcessRunner() if args.fresh else ForkingRunner()
    results = run_mutants(mutants, ROOT, timeout=args.timeout, runner=runner, report=report)
    text, ok = summarise(results, args.min_score)
    print(f"\n{text}\n({time.monotonic() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
