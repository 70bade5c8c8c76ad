"""Synchronous vs asynchronous training loop (``rollout.max_staleness`` 0 vs 1), side by side.

The demo task (``configs/magrpo_writing_tldr.yaml``: MAGRPO, two LoRA adapters on the embedded
SmolLM2-135M) trained ``--steps`` steps (default 3) four ways, one after another in this process:
with the in-process engine (``rollout.engine=hf``) and through the vLLM server teamrl starts
(``rollout.engine=vllm``; only where ``.venv-vllm`` exists, ``make setup-vllm``), each with
``max_staleness`` 0 (rollout, update, sync one after another) and 1 (the next step's rollout sampled
while a step trains). Each row: seconds per step (the wall time of ``Trainer.train_step``) as the
median and min..max of steps 2..N (step 1 holds the start-up: the first rollout, and with k=1 the
producer's start), and the medians over the same steps of ``rollout_s`` (with k=1: the producer's
rollout, which overlaps the update), ``update_s``, the trainer's wait for a rollout
(``async/trainer_wait_s``) and the producer's wait for weights (``async/weights_wait_s``); plus the
largest staleness trained on and the mean reward (sanity: the runs train).

``--quick``: the tiny random model, 2 steps, 16 new tokens, in-process engine only unless
``--engines`` says otherwise (a smoke test of this script: seconds).

Usage: python bench/async_bench.py [--steps 3] [--engines hf,vllm] [--threads N] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "magrpo_writing_tldr.yaml"
QUICK = ["model=tiny-random", "rollout.max_new_tokens=16", "policy.lora.r=4"]


def run(engine: str, k: int, steps: int, run_dir: Path, threads: int, extra: list[str]) -> dict[str, Any]:
    """Train the demo config ``steps`` steps with ``engine`` and ``max_staleness`` k; per-step figures."""
    from teamrl.core.config import load_config
    from teamrl.trainer.trainer import Trainer

    overrides = [f"run.dir={run_dir}", f"name=async_{engine}_k{k}", f"train.steps={steps}", f"rollout.max_staleness={k}",
                 f"rollout.engine={engine}", "run.progress=false", "run.tensorboard=false", "run.log_episodes=false",
                 f"run.save_every={steps + 1}", *([f"threads={threads}"] if threads else []), *extra]
    trainer = Trainer(load_config(str(CONFIG), overrides))
    seconds, records = [], []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            records.append(trainer.train_step())
            seconds.append(time.perf_counter() - t0)
    finally:
        trainer.shutdown()
    behind = [int(key.rsplit("/", 1)[1]) for r in records for key, v in r.items() if key.startswith("async/staleness/") and v]
    return {"engine": engine, "k": k, "step_s": seconds, "records": records, "max_staleness_seen": max(behind, default=0),
            "reward_mean": statistics.mean(r["reward_mean"] for r in records)}


def row(result: dict[str, Any]) -> str:
    """One line of the table (figures over steps 2..N)."""
    later = result["step_s"][1:] or result["step_s"]
    recs = result["records"][1:] or result["records"]

    def med(key: str) -> str:
        values = [r[key] for r in recs if key in r]
        return f"{statistics.median(values):8.2f}" if values else f"{'-':>8}"

    return (f"{result['engine']:<6} {result['k']:>2} {statistics.median(later):8.2f} {min(later):7.2f}..{max(later):<7.2f} "
            f"{med('rollout_s')} {med('update_s')} {med('async/trainer_wait_s')} {med('async/weights_wait_s')} "
            f"{result['max_staleness_seen']:>6} {result['reward_mean']:8.3f}")


HEADER = (f"{'engine':<6} {'k':>2} {'s/step':>8} {'min..max':>16} {'rollout':>8} {'update':>8} {'t_wait':>8} {'w_wait':>8} "
          f"{'behind':>6} {'reward':>8}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 3; --quick: 2)")
    ap.add_argument("--engines", default=None, help="comma-separated: hf, vllm (default hf,vllm; --quick: hf)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="tiny random model, 2 steps, 16 new tokens (smoke test)")
    ap.add_argument("--json", default="", help="also write every figure to this file")
    args = ap.parse_args(argv)
    steps = args.steps or (2 if args.quick else 3)
    engines = (args.engines or ("hf" if args.quick else "hf,vllm")).split(",")
    bad = [e for e in engines if e not in ("hf", "vllm")]
    if bad or steps < 1:
        print(f"async_bench: --engines {args.engines!r} / --steps {steps}: choose engines from hf, vllm and steps >= 1",
              file=sys.stderr)
        return 2
    extra = QUICK if args.quick else []
    results, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="teamrl_async_bench_") as tmp:
        for engine in engines:
            if engine == "vllm" and not (REPO / ".venv-vllm" / "bin" / "python").exists():
                skipped.append("vllm: no .venv-vllm (make setup-vllm)")
                continue
            for k in (0, 1):
                t0 = time.perf_counter()
                result = run(engine, k, steps, Path(tmp), args.threads, extra)
                result["wall_s"] = time.perf_counter() - t0
                results.append(result)
                print(f"done: {engine} k={k} in {result['wall_s']:.1f} s", file=sys.stderr, flush=True)
    print(f"{CONFIG.name}{' --quick' if args.quick else ''}: {steps} steps per run; figures are medians over steps 2..{steps} "
          "(seconds); t_wait: trainer waiting for a rollout, w_wait: producer waiting for weights; behind: largest staleness trained on")
    print(HEADER)
    for r in results:
        print(row(r))
    for line in skipped:
        print(f"skipped: {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
