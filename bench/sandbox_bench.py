"""Sandbox executions/s for trivial programs: the pool vs one at a time, side by side; and,
with ``--before REV``, the per-call wall time of this sandbox next to the one at git
revision REV (loaded from ``git show`` into a temporary package), calls interleaved so that
both see the same machine load.

Usage: python bench/sandbox_bench.py [--n 64] [--workers N] [--before main]
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
_SANDBOX_FILES = ("__init__.py", "_harness.py", "judge.py", "limits.py", "pool.py", "result.py", "sandbox.py")


def load_sandbox_at(rev: str, into: Path):
    """``teamrl.sandbox`` as it was at git revision ``rev``, importable as its own package."""
    package = f"teamrl_sandbox_{rev.replace('/', '_').replace('-', '_').replace('.', '_')}"
    target = into / package
    target.mkdir()
    for name in _SANDBOX_FILES:
        shown = subprocess.run(["git", "show", f"{rev}:teamrl/sandbox/{name}"], cwd=REPO, capture_output=True, text=True)
        if shown.returncode == 0:
            (target / name).write_text(shown.stdout.replace("teamrl.sandbox", package))
        elif name not in ("judge.py",):
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=64, help="programs per side")
    ap.add_argument("--workers", type=int, default=0, help="pool size (0: one per CPU)")
    ap.add_argument("--before", default=None, help="a git revision whose sandbox to time next to this one (e.g. main)")
    ap.add_argument("--out", default=None, help="append the line to this markdown file")
    args = ap.parse_args(argv)
    from teamrl.sandbox import SandboxJob, SandboxPool, run_program

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
