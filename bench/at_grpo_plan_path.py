"""The AT-GRPO CPU experiment on small Plan-Path grids (issue [at-grpo], part 5).

Same model (embedded SmolLM2-135M), seeds, grids, steps and sample budget (K samples per
agent step) for every trained variant; held-out grids (generator seed 1) for evaluation with
greedy decoding. Variants: untrained MAS (prompt-only team), single-agent GRPO (the planner
alone, K independent episodes), AT-GRPO with trajectory grouping, AT-GRPO tree with a shared
policy and with one LoRA adapter per role.

Usage: python bench/at_grpo_plan_path.py [--steps 4] [--eval 16] [--out bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--eval", type=int, default=16, help="held-out grids")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from pathlib import Path

    from teamrl.core.config import load_config
    from teamrl.trainer.evaluate import evaluate
    from teamrl.trainer.trainer import Trainer

    common = ["model=smollm2-135m", "algorithm=at_grpo", "task.name=plan_path", "task.min_size=4", "task.max_size=4",
              "task.max_turns=2", "task.num_problems=32", "rollout.group_size=4", "rollout.batch_size=2",
              f"rollout.max_new_tokens={args.tokens}", f"train.steps={args.steps}", "train.lr=0.0005", "seed=0",
              "run.progress=false", "run.tensorboard=false", f"run.save_every={args.steps}"]
    variants = [
        ("single-agent GRPO (planner alone)", ["task.agents=planner", "at_grpo.grouping=trajectory", "policy.mode=shared"]),
        ("AT-GRPO, trajectory grouping, shared", ["at_grpo.grouping=trajectory", "policy.mode=shared"]),
        ("AT-GRPO tree, shared", ["at_grpo.grouping=tree", "policy.mode=shared"]),
        ("AT-GRPO tree, per-role LoRA", ["at_grpo.grouping=tree", "policy.mode=lora_per_role"]),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        base = load_config(None, common + [f"run.dir={d}", "name=untrained"])
        t = time.perf_counter()
        (r,) = evaluate(load_config(None, common + [f"run.dir={d}", "name=untrained", "task.seed=1"]), ["untrained"],
                        limit=args.eval, progress=False)
        rows.append(("untrained MAS (prompt-only team)", 0, "-", "-", "-", "-", r.mean, r.pass_at_1, time.perf_counter() - t))
        del base
        for i, (label, extra) in enumerate(variants):
            name = f"v{i}"
            cfg = load_config(None, common + extra + [f"run.dir={d}", f"name={name}"])
            t = time.perf_counter()
            metrics = Trainer(cfg).train()
            wall = time.perf_counter() - t
            first = metrics[0]["success_rate"]
            last = sum(m["success_rate"] for m in metrics[-2:]) / len(metrics[-2:])
            rw_first = metrics[0]["reward_mean"]
            rw_last = sum(m["reward_mean"] for m in metrics[-2:]) / len(metrics[-2:])
            ev = load_config(None, common + extra + [f"run.dir={d}", f"name={name}", "task.seed=1"])
            (r,) = evaluate(ev, ["team"], checkpoint=Path(d) / name, limit=args.eval, progress=False)
            rows.append((label, args.steps, f"{rw_first:.3f}", f"{rw_last:.3f}", f"{first:.2f}", f"{last:.2f}", r.mean,
                         r.pass_at_1, wall))
            print(f"{label}: train reward step 1 {rw_first:.3f}, last 2 steps {rw_last:.3f}; train success {first:.2f} -> "
                  f"{last:.2f}; held-out team reward {r.mean:.3f}, success {r.pass_at_1:.3f}; {wall:.0f} s", flush=True)
    lines = ["| variant | steps | train reward, step 1 | train reward, last 2 | train success, step 1 | train success, last 2 "
             "| held-out team reward (greedy) | held-out success | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} | {f} | {g:.3f} | {h:.3f} | {w:.0f} |" for a, b, c, d, e, f, g, h, w in rows]
    table = "\n".join(lines)
    head = (f"\n### AT-GRPO on Plan-Path 4x4, 2 turns, K=4, 2 grids/step, {args.tokens} new tokens, seed 0; "
            f"held-out: {args.eval} grids of generator seed 1\n\n")
    print(head + table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(head + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
