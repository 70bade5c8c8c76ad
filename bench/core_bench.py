"""Core benchmark: rollout tokens/s of HFEngine vs plain ``model.generate``, and one train step.

Runs side by side in one process on the embedded SmolLM2-135M-Instruct:
1. rollout at batch 32 x 64 new tokens, GRPO-shaped (4 prompts x 8 samples, temperature 1),
   (a) to EOS, counting the tokens each row really generated (generate keeps computing rows
   that finished; the engine drops them), and (b) fixed length (EOS ignored), pure decode speed;
2. seconds of one LoRA train step (forward + backward + AdamW) on 16 sequences x 200 tokens.

Usage: python bench/core_bench.py [--repeats N] [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import sys
import time

import torch


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="append the results table to this markdown file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from teamrl.core.config import LoraConfig
    from teamrl.core.sample import Sample
    from teamrl.losses import LossConfig
    from teamrl.policies.chat import encode_chat
    from teamrl.policies.models import load_model
    from teamrl.policies.router import PolicyRouter
    from teamrl.rollout.engine import GenerationRequest, SamplingParams
    from teamrl.rollout.hf_engine import HFEngine
    from teamrl.trainer.update import UpdateSettings, update_policy

    model, tok = load_model(args.model)
    model.eval()
    engine = HFEngine(lambda p: contextlib.nullcontext(model), tok)
    questions = ["Describe the sea in one sentence.", "What is a good name for a cat?",
                 "Give me a tip for learning to cook.", "Explain why the sky is blue, briefly."]
    prompts = [encode_chat(tok, q) for q in questions]
    G, N = 8, 64
    rows = [p for p in prompts for _ in range(G)]
    P = max(len(p) for p in rows)
    ids = torch.full((len(rows), P), tok.pad_token_id)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, P - len(p):] = torch.tensor(p)
        attn[i, P - len(p):] = 1
    eos = tok.eos_token_id

    def plain(fixed: bool) -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=N, do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, min_new_tokens=N if fixed else 0, pad_token_id=tok.pad_token_id)
        gen = out[:, P:]
        if fixed:
            return gen.numel()
        # real tokens: up to and including the first EOS
        is_eos = gen == eos
        after = (is_eos.cumsum(1) - is_eos.long()) > 0
        return int((~after).sum())

    def ours(fixed: bool) -> int:
        params = SamplingParams(max_new_tokens=N, temperature=1.0, ignore_eos=fixed)
        out = engine.generate("p", [GenerationRequest(p, params, n=G) for p in prompts], seed=0)
        return sum(len(c.token_ids) for r in out for c in r)

    results: list[tuple[str, str, str, str]] = []
    print(f"teamrl core bench: {args.model}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, {_cpu_name()}", flush=True)
    _ = plain(False), ours(False)  # warm-up
    for label, fixed in (("to EOS", False), ("fixed 64", True)):
        t_plain, n_plain = _time(lambda: plain(fixed), args.repeats)
        t_ours, n_ours = _time(lambda: ours(fixed), args.repeats)
        tps_plain, tps_ours = n_plain / t_plain, n_ours / t_ours
        results.append((f"rollout tokens/s, batch 32 x 64, {label}", f"{tps_plain:.0f}", f"{tps_ours:.0f}", f"{tps_ours / tps_plain:.2f}x"))
        print(f"rollout {label:9s}  model.generate {tps_plain:7.0f} tok/s ({n_plain} tokens in {t_plain:.2f} s)   "
              f"HFEngine {tps_ours:7.0f} tok/s ({n_ours} tokens in {t_ours:.2f} s)   ratio {tps_ours / tps_plain:.2f}x", flush=True)

    # One train step: 16 sequences x 200 tokens (40 prompt + 160 completion), LoRA r=16 on all linears.
    router = PolicyRouter("shared", ["agent"], args.model, LoraConfig(), lr=1e-5)
    pol = router.policies["shared"]
    g = torch.Generator().manual_seed(0)
    samples = [Sample(role="agent", policy="shared", problem_id=i // 8,
                      prompt_ids=torch.randint(100, 40000, (40,), generator=g).tolist(),
                      completion_ids=torch.randint(100, 40000, (160,), generator=g).tolist(),
                      sampling_logprobs=[], advantage=float(torch.randn(1, generator=g))) for i in range(16)]
    settings = UpdateSettings(loss=LossConfig(), micro_batch_size=16)
    step = lambda: update_policy(pol, samples, settings, tok.pad_token_id, [eos])
    step()  # warm-up
    t_step, _ = _time(step, args.repeats)
    # forward+backward of a LoRA model: ~2 x forward matmuls (no base weight gradients) -> 4 * params * tokens
    n_params = sum(p.numel() for n, p in pol.model.named_parameters() if "lora_" not in n)
    flops = 4 * n_params * 16 * 200
    results.append(("train step, 16 x 200 tokens, LoRA r=16 (s)", "", f"{t_step:.2f}", f"~{flops / t_step / 1e9:.0f} GFLOP/s"))
    print(f"train step 16 x 200 tokens: {t_step:.2f} s (~{flops / t_step / 1e9:.0f} GFLOP/s at 4 x params x tokens)", flush=True)

    table = ["| measure | model.generate | teamrl | ratio / note |", "|---|---|---|---|"] + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in results]
    header = (f"\n## {datetime.date.today().isoformat()}: {args.model}, {_cpu_name()}, {torch.get_num_threads()} threads, "
              f"torch {torch.__version__}, transformers {transformers.__version__}, median of {args.repeats}\n\n")
    print(header + "\n".join(table))
    if args.out:
        with open(args.out, "a") as f:
            f.write(header + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
