"""Sandbox executions/s for trivial programs: the pool vs one at a time, side by side; and,
with ``--before REV``, the per-call wall time of this sandbox next to the one at git
revision REV (loaded from ``git show`` into a temporary package), calls interleaved so that
both see the same machine load. With ``--humaneval``, the canonical solution of every HumanEval
problem instead (all must pass), timed per call and summed apart for the problems whose tests
are all split into calls and those with a test the judge's process runs whole.

Usage: python bench/sandbox_bench.py [--n 64] [--workers N] [--before main] [--humaneval]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_SANDBOX_FILES = ("__init__.py", "_harness.py", "_harness_guards.py", "_judge_runtime.py", "_setup.py", "jail.py", "judge.py", "limits.py", "pool.py",
                  "records.py", "relay.py", "result.py", "sandbox.py", "users.py")
# files later revisions added (sandbox.py was split into jail, users, records and relay; _harness.py into _harness.py
# and _harness_guards.py)
_LATER_FILES = ("judge.py", "_judge_runtime.py", "_setup.py", "jail.py", "records.py", "relay.py", "users.py",
                "_harness_guards.py")


def load_sandbox_at(rev: str, into: Path):
    """``teamrl.sandbox`` as it was at git revision ``rev``, importable as its own package."""
    package = f"teamrl_sandbox_{rev.replace('/', '_').replace('-', '_').replace('.', '_')}"
    target = into / package
    target.mkdir()
    for name in _SANDBOX_FILES:
        shown = subprocess.run(["git", "show", f"{rev}:teamrl/sandbox/{name}"], cwd=REPO, capture_output=True, text=True)
        if shown.returncode == 0:
            (target / name).write_text(shown.stdout.replace("teamrl.sandbox", package))
        elif name not in _LATER_FILES:
            raise SystemExit(f"--before {rev}: git show could not read teamrl/sandbox/{name}: {shown.stderr.strip()}")
    sys.path.insert(0, str(into))
    return importlib.import_module(package)


def per_call(before_run, after_run, code: str, tests: tuple[str, ...], n: int) -> tuple[list[float], list[float]]:
    """Wall seconds of each call, before and after alternating."""
    before, after = [], []
    for _ in range(n):
        for run, times in ((before_run, before), (after_run, after)):
            t = time.perf_counter()
            result = run(code, tests)
            times.append(time.perf_counter() - t)
            assert result.ok, f"a trivial program failed in the sandbox: {result}"
    return before, after


def humaneval_per_call(runs: dict, repeat: int) -> list[str]:
    """Wall seconds per call of each side in ``runs`` (name -> a ``teamrl.sandbox`` package)
    on the canonical solution of every HumanEval problem, sides interleaved; every call must
    pass."""
    from teamrl.sandbox.judge import split_test
    from teamrl.tasks.code_data import load_humaneval

    limits = {name: package.SandboxLimits(wall_seconds=30.0, cpu_seconds=30.0) for name, package in runs.items()}
    problems = load_humaneval()
    whole = {p.task_id for p in problems if any(split_test(t) is None for t in p.tests)}
    times: dict[str, dict[str, list[float]]] = {name: {"split": [], "whole": []} for name in runs}
    failed: dict[str, list[str]] = {name: [] for name in runs}
    for _ in range(repeat):
        for p in problems:
            for name, package in runs.items():
                t = time.perf_counter()
                r = package.run_program(p.canonical_solution, p.tests, limits[name])
                times[name]["whole" if p.task_id in whole else "split"].append(time.perf_counter() - t)
                if not (r.ok and r.tests_passed == r.tests_total):
                    failed[name].append(f"{p.task_id} ({r.status}: {r.first_failure})")
    lines = []
    for name in runs:
        split, whole_t = times[name]["split"], times[name]["whole"]
        passed = repeat * len(problems) - len(failed[name])
        lines.append(f"HumanEval canonical solutions, {name}: {passed}/{repeat * len(problems)} pass; per call median "
                     f"{statistics.median(split) * 1e3:.1f} ms for the {len(problems) - len(whole)} problems judged by split "
                     f"calls, {statistics.median(whole_t) * 1e3:.1f} ms for the {len(whole)} with a test judged whole; "
                     f"all {repeat}x{len(problems)} calls {sum(split) + sum(whole_t):.1f} s"
                     + (f"; FAILED: {'; '.join(failed[name][:5])}" if failed[name] else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=64, help="programs per side")
    ap.add_argument("--workers", type=int, default=0, help="pool size (0: one per CPU)")
    ap.add_argument("--before", default=None, help="a git revision whose sandbox to time next to this one (e.g. main)")
    ap.add_argument("--out", default=None, help="append the line to this markdown file")
    ap.add_argument("--humaneval", action="store_true", help="time HumanEval's canonical solutions instead")
    ap.add_argument("--repeat", type=int, default=1, help="with --humaneval: passes over the 164 problems")
    args = ap.parse_args(argv)
    from teamrl.sandbox import SandboxJob, SandboxPool, run_program

    if args.humaneval:
        with tempfile.TemporaryDirectory(prefix="sandbox-bench-") as tmp:
            import teamrl.sandbox

            runs = {"this tree": teamrl.sandbox}
            if args.before:
                runs = {args.before: load_sandbox_at(args.before, Path(tmp)), **runs}
            lines = humaneval_per_call(runs, args.repeat)
        for line in lines:
            print(line)
        if args.out:
            with open(args.out, "a") as f:
                f.write("".join(f"\n- {line}\n" for line in lines))
        bad = [line for line in lines if "FAILED" in line]
        return 1 if bad else 0

    jobs = [SandboxJob(f"def f(x):\n    return x + {i}\n", (f"assert f(1) == {i + 1}",)) for i in range(args.n)]
    lines = []
    if args.before:
        with tempfile.TemporaryDirectory(prefix="sandbox-bench-") as tmp:
            old = load_sandbox_at(args.before, Path(tmp))
            old.run_program(jobs[0].code, jobs[0].tests)  # warm-up
            run_program(jobs[0].code, jobs[0].tests)
            before, after = per_call(old.run_program, run_program, jobs[0].code, jobs[0].tests, args.n)
        b, a = statistics.median(before) * 1e3, statistics.median(after) * 1e3
        lines.append(f"sandbox per call, trivial program, median of {args.n} interleaved calls: {args.before} {b:.1f} ms, "
                     f"this tree {a:.1f} ms, {a - b:+.1f} ms ({a / b:.2f}x)")
    run_program(jobs[0].code, jobs[0].tests)  # warm-up
    t = time.perf_counter()
    serial = [run_program(j.code, j.tests) for j in jobs]
    t_serial = time.perf_counter() - t
    with SandboxPool(args.workers or None) as pool:
        t = time.perf_counter()
        pooled = pool.map(jobs)
        t_pool = time.perf_counter() - t
        workers = pool.workers
    assert all(r.ok for r in serial + pooled), "a trivial program failed in the sandbox"
    iso = f"{serial[0].network_isolation}, {serial[0].filesystem_isolation}"
    lines.append(f"sandbox, {args.n} trivial programs ({iso}, {os.cpu_count()} CPUs): one at a time {args.n / t_serial:.1f} runs/s, "
                 f"pool of {workers} {args.n / t_pool:.1f} runs/s, {t_serial / t_pool:.2f}x")
    for line in lines:
        print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write("".join(f"\n- {line}\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
