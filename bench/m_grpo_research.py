"""M-GRPO vs its two baselines on the research environment (issue [m-grpo], closing note).

Same model, seed, questions, steps and K for every variant:

- M-GRPO: main + sub-agent, both trained (one LoRA adapter each), sub-trajectories aligned to d_max;
- frozen sub-agent: the same team, only the main agent learns;
- single-agent GRPO: one agent with the tools (search / open / python) answers alone;
- with ``--decoupled``: M-GRPO again with one worker per agent, in-process and on Ray (a local
  Ray is started), to compare seconds per step.

Prints a Markdown table: success rate, main reward, sub-agent format validity and calls per
rollout (means over the training rollouts of the first step and of the last two steps), and
seconds per step. Optionally appends it to a results file.

Usage: python bench/m_grpo_research.py [--model smollm2-135m] [--steps 2] [--tokens 48] [--decoupled] [--out bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48, help="max_new_tokens per reply")
    ap.add_argument("--group-size", type=int, default=4, help="K rollouts per question")
    ap.add_argument("--batch-size", type=int, default=2, help="questions per step")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--decoupled", action="store_true", help="also run M-GRPO with decoupled workers, in-process and on Ray")
    ap.add_argument("--out", default=None, help="append the table to this Markdown file")
    args = ap.parse_args(argv)

    from teamrl.core.config import load_config
    from teamrl.trainer.trainer import make_trainer

    common = [f"model={args.model}", "algorithm=m_grpo", "task.name=research", "task.num_problems=32", "task.max_sub_calls=2",
              "task.max_sub_turns=2", f"rollout.group_size={args.group_size}", f"rollout.batch_size={args.batch_size}",
              f"rollout.max_new_tokens={args.tokens}", f"train.steps={args.steps}", "train.lr=0.0005", "seed=0",
              f"threads={args.threads}", "m_grpo.d_max=2", "run.progress=false", "run.tensorboard=false", f"run.save_every={args.steps}"]
    variants = [
        ("M-GRPO (main + sub, both trained)", ["policy.mode=lora_per_role"]),
        ("main trained, sub-agent frozen", ["policy.mode=lora_per_role", "m_grpo.sub_agent=frozen"]),
        ("single-agent GRPO (one agent with the tools)", ["policy.mode=shared", "m_grpo.agents=single"]),
    ]
    if args.decoupled:
        variants += [("M-GRPO, decoupled workers in-process", ["policy.mode=separate", "policy.placement=local"]),
                     ("M-GRPO, decoupled workers on Ray", ["policy.mode=separate", "policy.placement=ray"])]
    head = ("| variant | steps | success, step 1 | success, last 2 | main reward, step 1 | main reward, last 2 "
            "| sub format valid (all steps) | sub calls / rollout | s / step |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    with tempfile.TemporaryDirectory() as d:
        for i, (label, extra) in enumerate(variants):
            cfg = load_config(None, common + extra + [f"run.dir={d}", f"name=v{i}"])
            trainer = make_trainer(cfg)  # model loading and Ray start-up are not counted in s / step
            t = time.perf_counter()
            metrics = trainer.train()
            per_step = (time.perf_counter() - t) / len(metrics)
            last = metrics[-2:]
            sub_valid = [m["sub_format_valid"] for m in metrics if "sub_format_valid" in m]
            sub_valid_s = f"{_mean(sub_valid):.2f}" if sub_valid else "-"
            lines.append(f"| {label} | {len(metrics)} | {metrics[0]['success_rate']:.2f} | {_mean([m['success_rate'] for m in last]):.2f} "
                         f"| {metrics[0]['main_reward']:.3f} | {_mean([m['main_reward'] for m in last]):.3f} | {sub_valid_s} "
                         f"| {_mean([m['sub_calls_per_rollout'] for m in metrics]):.2f} | {per_step:.1f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    if args.decoupled:
        import ray

        ray.shutdown()
    title = (f"### M-GRPO on the research env ({args.model}, K={args.group_size}, {args.batch_size} questions/step, "
             f"{args.tokens} new tokens, max 2 sub calls x 2 turns, d_max=2, seed 0)")
    table = "\n".join([title, "", *lines])
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
