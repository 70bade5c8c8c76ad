"""Sandbox executions/s for trivial programs: the pool vs one at a time, side by side.

Usage: python bench/sandbox_bench.py [--n 64] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=64, help="programs per side")
    ap.add_argument("--workers", type=int, default=0, help="pool size (0: one per CPU)")
    ap.add_argument("--out", default=None, help="append the line to this markdown file")
    args = ap.parse_args(argv)
    from teamrl.sandbox import SandboxJob, SandboxPool, run_program

    jobs = [SandboxJob(f"def f(x):\n    return x + {i}\n", (f"assert f(1) == {i + 1}",)) for i in range(args.n)]
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
    iso = serial[0].network_isolation
    line = (f"sandbox, {args.n} trivial programs ({iso}, {os.cpu_count()} CPUs): one at a time {args.n / t_serial:.1f} runs/s, "
            f"pool of {workers} {args.n / t_pool:.1f} runs/s, {t_serial / t_pool:.2f}x")
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n- {line}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
