"""GPU check: 3 MAGRPO iterations on CUDA with random-initialised models of real shapes.

For a machine with a GPU, PyTorch and transformers but no network and no model files: the
models are built from their configs with random weights (speed does not depend on the
weights) and the byte-level tokenizer of ``tiny-random`` (no files); completions have a fixed
length (``ignore_eos``). The task is ``writing.tldr`` (two agents) on a few synthetic papers
written to a temporary JSONL file. Prints tokens/s and seconds per iteration for each shape.

Shapes: ``random:smollm2-135m`` (the embedded model's: Llama, hidden 576, 30 layers) and
``random:qwen3-1.7b`` (Qwen3, hidden 2048, 28 layers, vocab 151936). With peft installed the
agents are two LoRA adapters on one base (``lora_per_role``); without it, two full-weight
models (``separate``), and the output says so.

Usage (from the repository root):
  bash bench/gpu_check.sh                          # both shapes on CUDA, under 5 minutes
  PYTHONPATH=. python bench/gpu_check.py --device cpu --tiny   # the same code path on the CPU, tiny model
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

SHAPES = ("random:smollm2-135m", "random:qwen3-1.7b")


def _papers(path: Path, n: int) -> None:
    """Write ``n`` synthetic papers in writing.tldr's JSONL format (the machine has no data sets)."""
    words = ("model", "agents", "training", "reward", "policy", "language", "team", "results", "method", "data")
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(words[(i + k) % len(words)] for k in range(60)) + "."
            f.write(json.dumps({"id": f"p{i}", "title": f"Paper {i}", "abstract": text, "introduction": text, "conclusion": text,
                                "summaries": {"challenge": text[:80], "approach": text[:80], "outcome": text[:80]}}) + "\n")


def run_shape(model: str, device: str, iterations: int, tokens: int, group_size: int, batch_size: int, lora: bool,
              workdir: Path, threads: int = 0) -> dict:
    """Build a trainer for ``model`` and time ``iterations`` MAGRPO iterations; return the numbers."""
    import torch

    from teamrl.core.config import load_config
    from teamrl.trainer.trainer import Trainer

    data = workdir / "papers.jsonl"
    if not data.exists():
        _papers(data, 16)
    mode = ["policy.mode=lora_per_role", "policy.lora.r=16"] if lora else ["policy.mode=separate", "policy.lora=null"]
    cfg = load_config(None, [
        f"model={model}", f"name={model.replace(':', '_')}", f"run.dir={workdir}", f"policy.device={device}",
        "algorithm=magrpo", "task.name=writing.tldr", f"task.source={data}", "task.max_source_words=40",
        f"rollout.group_size={group_size}", f"rollout.batch_size={batch_size}", f"rollout.max_new_tokens={tokens}",
        "rollout.ignore_eos=true", "train.steps=1000", "run.save_every=1000", "run.progress=false",
        "run.tensorboard=false", "run.log_episodes=false", f"threads={threads}", f"train.micro_batch_size={group_size * batch_size}", *mode])
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - t0
    models = {id(p.model): p.model for p in trainer.router.policies.values()}.values()
    params = sum(p.numel() for m in models for n, p in m.named_parameters() if "lora_" not in n)  # base weights only
    rows = []
    for _ in range(iterations):
        t = time.perf_counter()
        rec = trainer.train_step()
        if trainer.router.device.type == "cuda":
            torch.cuda.synchronize()
        rows.append({"s": time.perf_counter() - t, "rollout_s": rec["rollout_s"], "update_s": rec["update_s"],
                     "tok_s": rec["rollout_tokens_per_s"], "completion_len": rec["completion_len"]})
    mem = torch.cuda.max_memory_allocated() / 2**30 if trainer.router.device.type == "cuda" else None
    return {"model": model, "device": str(trainer.router.device), "dtype": str(trainer.router.dtype).removeprefix("torch."),
            "params": params, "build_s": build_s, "iterations": rows, "max_mem_gib": mem}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default; fails fast without a GPU) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny-random model and a small workload (for the CPU)")
    ap.add_argument("--models", nargs="+", default=None, help=f"model aliases (default {' '.join(SHAPES)})")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=None, help="fixed completion length (default 128; 16 with --tiny)")
    ap.add_argument("--group-size", type=int, default=None, help="G (default 8; 2 with --tiny)")
    ap.add_argument("--batch-size", type=int, default=None, help="problems per iteration (default 4; 2 with --tiny)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 with --tiny)")
    args = ap.parse_args(argv)

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
              "run this on a GPU machine, or pass --device cpu --tiny to exercise the code path on the CPU", file=sys.stderr)
        return 2
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        print(f"gpu_check: --device {args.device!r}: choose cuda, cuda:N or cpu", file=sys.stderr)
        return 2
    models = args.models or (["tiny-random"] if args.tiny else list(SHAPES))
    tokens = args.tokens or (16 if args.tiny else 128)
    G = args.group_size or (2 if args.tiny else 8)
    B = args.batch_size or (2 if args.tiny else 4)
    lora = importlib.util.find_spec("peft") is not None
    import transformers

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"gpu_check: {gpu}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {'yes: agents are LoRA adapters (lora_per_role)' if lora else 'not installed: agents are full-weight models (separate)'}")
    print(f"workload: MAGRPO, writing.tldr (2 agents), G={G}, {B} problems/iteration, {tokens} new tokens (ignore_eos), "
          f"{args.iterations} iterations")
    results = []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for model in models:
            threads = args.threads if args.threads is not None else (1 if args.tiny else 0)
            r = run_shape(model, args.device, args.iterations, tokens, G, B, lora, Path(d), threads)
            results.append(r)
            for i, it in enumerate(r["iterations"], 1):
                print(f"  {model} iteration {i}: {it['s']:.2f} s (rollout {it['rollout_s']:.2f} s at {it['tok_s']:.0f} tokens/s, "
                      f"update {it['update_s']:.2f} s)")
            rest = r["iterations"][1:] or r["iterations"]  # the first iteration includes warm-up
            mean_s = sum(x["s"] for x in rest) / len(rest)
            mean_tok = sum(x["tok_s"] for x in rest) / len(rest)
            mem = f", peak GPU memory {r['max_mem_gib']:.1f} GiB" if r["max_mem_gib"] is not None else ""
            print(f"{model}: {r['params'] / 1e6:.1f}M base parameters on {r['device']} ({r['dtype']}), built in {r['build_s']:.1f} s; "
                  f"{mean_s:.2f} s/iteration, rollout {mean_tok:.0f} tokens/s (mean of iterations {2 if len(r['iterations']) > 1 else 1}-"
                  f"{len(r['iterations'])}){mem}")
            if r["device"].startswith("cuda"):
                torch.cuda.empty_cache()
    print(f"gpu_check: done in {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
