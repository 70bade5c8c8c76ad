"""Memory per rank of a sharded full-weight policy (issue 46): SmolLM2-135M (the embedded model), full weights,
AdamW, trained by 1 rank and by 2 ranks (``policy.ranks``, gloo, Ray actors), one update of the same 8 samples.

Prints, per rank, the bytes it holds of the parameters, of the trainable parameters (the gradients take as much
during an update) and of the optimizer state (tensor bytes, exact), and its peak resident memory (the allocator's
view: libraries included), then writes the table into bench/RESULTS.md between its markers.

    .venv/bin/python bench/shard_memory.py            # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

# freed tensors go back to the OS, so that the peak resident memory tells the ranks apart (glibc keeps small freed
# blocks otherwise); inherited by the Ray actors this process starts
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from teamrl.core.config import load_config  # noqa: E402
from teamrl.core.sample import Sample  # noqa: E402
from teamrl.losses import LossConfig  # noqa: E402
from teamrl.trainer.learner import LearnBatch, make_router  # noqa: E402
from teamrl.trainer.sharded_learner import ShardedLearner  # noqa: E402
from teamrl.trainer.update import UpdateParams  # noqa: E402

BEGIN, END = "<!-- shard_memory: begin -->", "<!-- shard_memory: end -->"
MB = 1e6


def batch(tok) -> LearnBatch:
    g = torch.Generator().manual_seed(0)
    samples = [Sample(role="agent", policy="shared", problem_id=i // 4, prompt_ids=[1, 504, 3158, 314 + i // 4],
                      completion_ids=[int(x) for x in torch.randint(200, 2000, (24,), generator=g)],
                      sampling_logprobs=[-3.0] * 24, advantage=float(torch.randn(1, generator=g)))
               for i in range(8)]
    params = UpdateParams(loss=LossConfig(), micro_batch_size=4, max_grad_norm=1.0)
    return LearnBatch({"shared": [samples]}, params, tok.pad_token_id, (tok.eos_token_id,))


def measure(ranks: int) -> tuple[list[dict[str, float]], float]:
    import ray

    cfg = load_config(None, ["model=smollm2-135m", "policy.lora=null", "policy.placement=ray", "threads=1",
                             f"policy.ranks={{shared: {ranks}}}", "policy.ray_timeout_s=600"])
    router = make_router(cfg, ["agent"])
    learner = ShardedLearner(cfg, router, ["agent"])
    try:
        t0 = time.perf_counter()
        learner.update(batch(router.tokenizer))
        seconds = time.perf_counter() - t0
        return learner.memory()["shared"], seconds
    finally:
        learner.shutdown()
        ray.shutdown()


def main() -> None:
    rows = []
    for ranks in (1, 2):
        per_rank, seconds = measure(ranks)
        for r, m in enumerate(per_rank):
            rows.append(f"| {ranks} | {r} | {m['parameters'] / MB:.1f} | {m['trainable'] / MB:.1f} | "
                        f"{m['optimizer'] / MB:.1f} | {(m['parameters'] + m['trainable'] + m['optimizer']) / MB:.1f} | "
                        f"{m['peak_rss'] / 1e9:.2f} | {seconds:.1f} |")
        print(f"{ranks} rank(s): {per_rank}; update {seconds:.1f} s", flush=True)
    table = "\n".join([
        BEGIN,
        "## Memory per rank of a sharded full-weight policy (`bench/shard_memory.py`)",
        "",
        f"SmolLM2-135M, full weights, float32, AdamW, one update of 8 samples (24 tokens each), gloo on CPU, "
        f"{time.strftime('%Y-%m-%d')}. Tensor bytes are exact (this rank's shards); gradients take as many bytes as "
        "the trainable parameters during an update (freed after it). Peak RSS is the process's, libraries included "
        "(`MALLOC_MMAP_THRESHOLD_=131072`).",
        "",
        "| ranks | rank | parameters MB | gradients MB (= trainable) | AdamW state MB | params + grads + state MB | "
        "peak RSS GB | update s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        END,
    ])
    print(table)
    results = ROOT / "bench" / "RESULTS.md"
    text = results.read_text()
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: table, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + table + "\n"
    results.write_text(text)


if __name__ == "__main__":
    main()
