"""One MAGRPO iteration: teamrl vs the same workload done the way the reference code does it.

Reference style (as in CoMLRL's trainer loop): one prompt at a time with ``model.generate``,
agents one after another, and the loss computed one sequence at a time. Both sides use the
same model (embedded SmolLM2-135M, one LoRA adapter per agent), the same task, prompts,
reward, G, batch size and token limit, and run in one process, side by side.

Usage: python bench/magrpo_bench.py [--tokens 32 64] [--steps 2] [--task writing.tldr]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def reference_iteration(trainer, problems) -> float:
    """The reference-style iteration on ``trainer``'s models; returns seconds."""
    from teamrl.losses import group_advantages
    from teamrl.policies.chat import encode_chat

    cfg, task, tok = trainer.cfg, trainer.task, trainer.tokenizer
    G, T = cfg.rollout.group_size, cfg.rollout.max_new_tokens
    t0 = time.perf_counter()
    for problem in problems:
        texts, seqs = {}, {}
        for role in task.roles:  # agents one after another
            pol = trainer.router.policy_for(role)
            ids = torch.tensor([encode_chat(tok, task.prompt(problem, role))])
            with pol.active() as model, torch.no_grad():
                model.eval()
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, max_new_tokens=T, num_return_sequences=G, pad_token_id=tok.pad_token_id)
            seqs[role] = (ids.shape[1], out)
            texts[role] = tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        rewards = torch.tensor(task.rewards(problem, [{r: texts[r][j] for r in task.roles} for j in range(G)]), dtype=torch.float32)
        adv = group_advantages(rewards, torch.zeros(G, dtype=torch.long), "group")
        for role in task.roles:
            pol = trainer.router.policy_for(role)
            plen, out = seqs[role]
            with pol.active() as model:
                model.train()
                pol.optimizer.zero_grad()
                for j in range(G):  # one sequence at a time
                    seq = out[j:j + 1]
                    logits = model(input_ids=seq).logits[:, plen - 1:-1].float()
                    lp = torch.log_softmax(logits, -1).gather(-1, seq[:, plen:].unsqueeze(-1)).squeeze(-1)
                    real = seq[:, plen:] != tok.pad_token_id
                    ratio = torch.exp(lp - lp.detach())
                    loss = -(ratio * adv[j] * real).sum() / real.sum().clamp(min=1) / G
                    loss.backward()
                pol.optimizer.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--steps", type=int, default=2, help="timed iterations per side (median)")
    ap.add_argument("--task", default="writing.tldr")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    args = ap.parse_args(argv)
    import tempfile

    from teamrl.core.config import load_config
    from teamrl.trainer.trainer import Trainer

    lines = ["| new tokens | teamrl s/iteration | reference-style s/iteration | speed-up |", "|---|---|---|---|"]
    for T in args.tokens:
        with tempfile.TemporaryDirectory() as d:
            cfg = load_config(None, [f"model={args.model}", "algorithm=magrpo", f"task.name={args.task}", "policy.mode=lora_per_role",
                                     "rollout.group_size=4", "rollout.batch_size=2", f"rollout.max_new_tokens={T}",
                                     "run.progress=false", "run.log_episodes=false", "run.tensorboard=false", f"run.dir={d}",
                                     "name=bench", "train.steps=1000", "train.micro_batch_size=16"])
            trainer = Trainer(cfg)
            trainer.train_step()  # warm-up
            ours = statistics.median([_timed(trainer.train_step) for _ in range(args.steps)])
            ref = statistics.median([reference_iteration(trainer, trainer._next_problems()) for _ in range(args.steps)])
        lines.append(f"| {T} | {ours:.1f} | {ref:.1f} | {ref / ours:.2f}x |")
        print(f"MAGRPO iteration, 2 agents, G=4, 2 problems, {T} new tokens: teamrl {ours:.1f} s, reference-style {ref:.1f} s, "
              f"{ref / ours:.2f}x", flush=True)
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n### MAGRPO iteration vs reference style ({args.model}, {args.task}, median of {args.steps})\n\n{table}\n")
    return 0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
