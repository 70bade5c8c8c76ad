"""Two-agent rollout: both LoRA adapters in one batch through the shared base vs two separate decodes.

The MAGRPO rollout shape on the embedded SmolLM2-135M-Instruct: two agents (one LoRA adapter each,
``lora_per_role``), writing.tldr prompts, ``--problems`` problems x G samples per agent, a fixed
number of new tokens (EOS ignored), temperature 1. Side by side in one process, alternating:

- separate: each policy decoded on its own, from its merged copy of the base (the engine without
  ``row_models``: how teamrl sampled before one batch per base);
- one batch: both policies in one decode through the shared base, each row with its own adapter
  (``HFEngine(row_models=SharedBaseAdapters(...))``, what the trainer uses).

``--modes`` picks the modes alternated; a ``-copied`` suffix (``separate-copied``, ``joint-copied``)
runs the mode with each prompt's keys/values copied to every row that samples it (the engine
before shared-prompt decode attention), for an A/B of that change in one process.

``--rss MODE`` runs only one mode (in its own process) and reports the process's peak RSS, so the
memory of the two paths can be compared without one's peak hiding the other's.

Usage: python bench/multi_adapter_bench.py [--problems 4] [--group 4] [--tokens 64] [--repeats 3]
       [--threads 1] [--json FILE] [--rss separate|joint]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch


def build(problems: int, group: int, tokens: int):
    """(router, calls): the two policies and one flush's generation calls (policy, requests, seed)."""
    from teamrl.core.config import LoraConfig
    from teamrl.policies.chat import encode_chat
    from teamrl.policies.router import PolicyRouter
    from teamrl.rollout.engine import GenerationRequest, SamplingParams
    from teamrl.tasks import make_task

    task = make_task({"name": "writing.tldr"})
    router = PolicyRouter("lora_per_role", list(task.roles), "smollm2-135m",
                          LoraConfig(r=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                     "up_proj", "down_proj"]), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-looking adapters (PEFT starts lora_B at zero)
        for pol in router.policies.values():
            for p in pol.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)
    probs = task.problems()[:problems]
    calls = [(router.policy_name(role), [GenerationRequest(encode_chat(router.tokenizer, task.prompt(p, role)), params, n=group)
                                         for p in probs], 100 + i) for i, role in enumerate(task.roles)]
    return router, calls


def engines(router):
    from teamrl.policies.multi_lora import SharedBaseAdapters
    from teamrl.rollout.hf_engine import HFEngine

    models = lambda name: router.policies[name].generation_model()  # noqa: E731
    return HFEngine(models, router.tokenizer), HFEngine(models, router.tokenizer, row_models=SharedBaseAdapters(router.policies))


def run_mode(mode: str, separate, joint, calls) -> list:
    from teamrl.rollout import hf_engine

    base, _, variant = mode.partition("-")
    supports = hf_engine.supports_shared_prompts
    if variant == "copied":  # the prompt keys/values copied to each row, as before shared-prompt attention
        hf_engine.supports_shared_prompts = lambda model: False
    try:
        if base == "separate":
            return [separate.generate(policy, reqs, seed) for policy, reqs, seed in calls]
        return joint.generate_many(calls)
    finally:
        hf_engine.supports_shared_prompts = supports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="", help="write the figures as JSON to this file")
    ap.add_argument("--modes", default="separate,joint",
                    help="modes to alternate: separate, joint, separate-copied, joint-copied (comma-separated)")
    ap.add_argument("--rss", choices=["separate", "joint", "separate-copied", "joint-copied"],
                    help="run only this mode, once, and report peak RSS")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    router, calls = build(args.problems, args.group, args.tokens)
    separate, joint = engines(router)
    rows = sum(r.n for _, reqs, _ in calls for r in reqs)
    if args.rss:
        rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t = time.perf_counter()
        run_mode(args.rss, separate, joint, calls)
        out = {"mode": args.rss, "seconds": time.perf_counter() - t, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "peak_rss_mb_after_loading": rss_loaded}
    else:
        modes = args.modes.split(",")
        for mode in modes:  # warm-up of every path (and the merged copies)
            run_mode(mode, separate, joint, calls)
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode in modes:
                t = time.perf_counter()
                run_mode(mode, separate, joint, calls)
                times[mode].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        out = {"rows": rows, "tokens": args.tokens, "threads": args.threads, "times": times, "median": med}
        for a, b in (("separate", "joint"), ("joint-copied", "joint"), ("separate-copied", "separate"), ("separate-copied", "joint")):
            if a in times and b in times:
                out[f"{a}/{b}"] = {"median_ratio": med[a] / med[b], "pair_ratios": [x / y for x, y in zip(times[a], times[b])]}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
