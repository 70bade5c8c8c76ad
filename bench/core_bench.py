"""Core benchmark: rollout tokens/s of HFEngine vs plain ``model.generate``, and one train step.

Runs side by side in one process on the embedded SmolLM2-135M-Instruct:
1. rollout at batch 32 x 64 new tokens, GRPO-shaped (4 prompts x 8 samples, temperature 1),
   (a) to EOS, counting the tokens each row really generated (generate keeps computing rows
   that finished; the engine drops them), and (b) fixed length (EOS ignored), pure decode speed;
2. seconds of one LoRA train step (forward + backward + AdamW) on 16 sequences x 200 tokens,
   its achieved FLOP/s, and this machine's fp32 matmul peak (torch.mm 2048^3) measured in the
   same run with the same threads.

The engine and ``model.generate`` alternate (A, B, A, B, ...) and each reports its median, so
that load from other processes hits both sides alike.

Usage: python bench/core_bench.py [--repeats N] [--threads N] [--out FILE] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import sys
import time
from typing import Sequence

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


def _interleaved(fa, fb, repeats: int) -> tuple[tuple[float, object], tuple[float, object]]:
    """Medians (and last outputs) of ``fa`` and ``fb`` run alternately ``repeats`` times each."""
    ta, tb, oa, ob = [], [], None, None
    for _ in range(repeats):
        t = time.perf_counter()
        oa = fa()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        ob = fb()
        tb.append(time.perf_counter() - t)
    return (statistics.median(ta), oa), (statistics.median(tb), ob)


def matmul_peak(size: int = 2048, trials: int = 5, per_trial: int = 4) -> float:
    """Best fp32 torch.mm FLOP/s over ``trials`` (each ``per_trial`` products of size x size x size)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    c = torch.empty(size, size)
    torch.mm(a, b, out=c)  # warm-up
    best = 0.0
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(per_trial):
            torch.mm(a, b, out=c)
        best = max(best, 2 * size ** 3 * per_trial / (time.perf_counter() - t))
    return best


def _linear_params(model: torch.nn.Module, lora_r: int) -> tuple[int, int]:
    """Weights of the base's linear layers (not the output head) and of rank-``lora_r`` adapters on all of them."""
    lin = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n and not n.endswith("lm_head")]
    return sum(m.in_features * m.out_features for m in lin), sum(lora_r * (m.in_features + m.out_features) for m in lin)


def matmul_flops(model: torch.nn.Module, lora_r: int, tokens: float, context: float, logit_rows: float, train: bool) -> float:
    """Matmul FLOPs of running ``tokens`` tokens through ``model`` with rank-``lora_r`` adapters on every linear,
    each attending to ``context`` positions on average, with logits at ``logit_rows`` positions.

    A forward is 2 FLOPs per weight per token (base, adapters, output head) and 4 x layers x hidden
    per attended position (QK^T and AV); ``train`` adds the backward of a frozen base: its input
    gradient (2 per weight again, twice the attention) and the adapters' weight gradient (2 more).
    """
    cfg = model.config
    L, d, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    n_lin, n_lora = _linear_params(model, lora_r)
    if train:
        return 4 * n_lin * tokens + 4 * V * d * logit_rows + 6 * n_lora * tokens + 12 * L * d * context * tokens
    return 2 * n_lin * tokens + 2 * V * d * logit_rows + 2 * n_lora * tokens + 4 * L * d * context * tokens


def train_step_flops(model: torch.nn.Module, lora_r: int, sequences: int, seq_len: int, logit_positions: int) -> tuple[float, str]:
    """Matmul FLOPs of one LoRA train step (forward + input-gradient backward; frozen base weights get no weight gradient)."""
    flops = matmul_flops(model, lora_r, sequences * seq_len, seq_len / 2, sequences * logit_positions, train=True)
    formula = ("matmul FLOPs = 4 x (base linear params) x tokens + 4 x vocab x hidden x (logit positions) "
               "+ 6 x (LoRA params) x tokens + 12 x layers x hidden x (mean causal context) x tokens "
               "(forward 2 FLOPs per weight per token, input-gradient backward 2; the frozen base has no weight gradient)")
    return float(flops), formula


def rollout_update_flops(model: torch.nn.Module, lora_r: int,
                         groups: Sequence[tuple[int, Sequence[int], Sequence[bool]]]) -> dict[str, float]:
    """Matmul FLOPs of one GRPO-family iteration as teamrl runs it, per phase.

    ``groups``: one entry per distinct prompt of one policy: (prompt length, the lengths of the
    completions sampled from it, whether the update trains on each). The rollout prefills the
    prompt once (logits at its last position) and feeds each completion's tokens but the last;
    the update runs the prompt once and the trained completions over it, forward and backward
    (:func:`matmul_flops`). ``floor`` is the update's work alone: what an exact implementation
    that got its sampling forward for free would still do (every token once forward and once back).
    """
    rollout = update = 0.0
    for p, lens, trained in groups:
        rollout += matmul_flops(model, lora_r, p, p / 2, 1, train=False)
        rollout += sum(matmul_flops(model, lora_r, c - 1, p + c / 2, c - 1, train=False) for c in lens if c > 1)
        kept = [c for c, t in zip(lens, trained) if t]
        if kept:
            update += matmul_flops(model, lora_r, p, p / 2, 1, train=True)
            update += sum(matmul_flops(model, lora_r, c - 1, p + c / 2, c - 1, train=True) for c in kept if c > 1)
    return {"rollout": rollout, "update": update, "total": rollout + update, "floor": update}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="append the results table to this markdown file")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
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
    from teamrl.trainer.update import UpdateParams, update_policy

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
    data: dict = {"rollout": {}, "threads": torch.get_num_threads()}
    for label, fixed in (("to EOS", False), ("fixed 64", True)):
        (t_plain, n_plain), (t_ours, n_ours) = _interleaved(lambda: plain(fixed), lambda: ours(fixed), args.repeats)
        tps_plain, tps_ours = n_plain / t_plain, n_ours / t_ours
        data["rollout"]["fixed" if fixed else "eos"] = {"generate_tps": tps_plain, "teamrl_tps": tps_ours,
                                                        "generate_tokens": n_plain, "teamrl_tokens": n_ours}
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
    settings = UpdateParams(loss=LossConfig(), micro_batch_size=16)
    def step():
        return update_policy(pol, samples, settings, tok.pad_token_id, [eos])

    step()  # warm-up
    t_step, _ = _time(step, args.repeats)
    flops, formula = train_step_flops(pol.model, LoraConfig().r, 16, 200, 160)
    peak = matmul_peak()
    results.append(("train step, 16 x 200 tokens, LoRA r=16 (s)", "", f"{t_step:.2f}",
                    f"{flops / t_step / 1e9:.0f} GFLOP/s = {flops / t_step / peak:.0%} of the {peak / 1e9:.0f} GFLOP/s fp32 matmul peak"))
    print(f"train step 16 x 200 tokens: {t_step:.2f} s ({flops / t_step / 1e9:.0f} GFLOP/s; fp32 matmul peak {peak / 1e9:.0f} GFLOP/s)", flush=True)
    data["train"] = {"seconds": t_step, "gflops": flops / t_step / 1e9, "flops": flops, "sequences": 16, "tokens_per_sequence": 200,
                     "formula": formula}
    data["peak"] = {"gflops": peak / 1e9, "size": 2048}
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(data, f)

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
