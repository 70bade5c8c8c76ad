"""The benchmark harness's pure parts: results placement, FLOP counting, model paths, CLI dispatch (no timing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from teamrl.policies.models import ModelNotFound, load_model, local_model_path

REPO = Path(__file__).resolve().parents[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_write_results_puts_the_new_run_on_top_and_replaces_its_own_partial_section(tmp_path):
    anchors = _module("anchors")
    out = tmp_path / "RESULTS.md"
    out.write_text("# Benchmark results\n\nintro\n\n## old run\n\nold table\n")
    anchors.write_results("<!-- bench run 1 -->\n## run 1, part\n\nA\n", out, "<!-- bench run 1 -->")
    anchors.write_results("<!-- bench run 1 -->\n## run 1, whole\n\nB\n", out, "<!-- bench run 1 -->")
    text = out.read_text()
    assert "run 1, part" not in text and text.count("<!-- bench run 1 -->") == 1
    assert text.index("intro") < text.index("run 1, whole") < text.index("old run")
    assert "old table" in text


def test_train_step_flops_counts_lora_step_as_forward_plus_input_gradient():
    core = _module("core_bench")
    model, _ = load_model("tiny-random")
    flops, formula = core.train_step_flops(model, lora_r=4, sequences=2, seq_len=10, logit_positions=5)
    cfg = model.config
    lin = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    base = 4 * sum(m.in_features * m.out_features for m in lin) * 20
    head = 4 * cfg.vocab_size * cfg.hidden_size * 2 * 5
    assert flops > base + head  # LoRA and attention terms come on top
    assert flops < 1.2 * (base + head)
    assert "4 x (base linear params)" in formula


def test_local_model_path_accepts_folders_and_rejects_unknown_names(tmp_path):
    assert local_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(ModelNotFound):
        local_model_path(str(tmp_path / "missing"))


def test_cli_dispatches_bench_to_the_script(capsys):
    from teamrl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    assert "CoMLRL" in capsys.readouterr().out


def test_render_reads_the_two_agent_result_as_multi_adapter_bench_writes_it():
    """(e)'s row comes from ``bench/multi_adapter_bench.py --json`` as it is (a full bench run once crashed here)."""
    import argparse

    anchors = _module("anchors")
    two_agent = {"rows": 32, "tokens": 64, "threads": 2, "times": {"separate": [51.2, 60.0, 64.4], "joint": [51.2, 54.2, 56.2]},
                 "median": {"separate": 60.0, "joint": 54.2},
                 "separate/joint": {"median_ratio": 60.0 / 54.2, "pair_ratios": [1.0, 1.107, 1.145]}}
    args = argparse.Namespace(threads=2, steps=1, rounds=3, magrpo_tokens=[32], grpo_tokens=[64], only="e")
    table = anchors.render({"anchors": [], "two_agent": two_agent}, args)
    row = next(line for line in table.splitlines() if line.startswith("| (e)"))
    assert "54.2 s" in row and "60.0 s" in row and "1.11x (1.00-1.15x)" in row and "NOT met (target 1.8)" in row


def test_rollout_update_flops_counts_each_prompt_once_and_trains_only_kept_completions():
    core = _module("core_bench")
    model, _ = load_model("tiny-random")

    def fwd(n, ctx, logits):
        return core.matmul_flops(model, 4, n, ctx, logits, train=False)

    def train(n, ctx, logits):
        return core.matmul_flops(model, 4, n, ctx, logits, train=True)

    f = core.rollout_update_flops(model, 4, [(10, [5, 5], [True, False]), (6, [3], [False])])
    assert f["rollout"] == pytest.approx(fwd(10, 5, 1) + 2 * fwd(4, 12.5, 4) + fwd(6, 3, 1) + fwd(2, 7.5, 2))
    # the second group trains nothing (no prompt pass); the first trains its prompt once and one completion
    assert f["update"] == pytest.approx(train(10, 5, 1) + train(4, 12.5, 4))
    assert f["floor"] == f["update"] and f["total"] == pytest.approx(f["rollout"] + f["update"])
    # a train step's base and head matmuls are twice a forward's (the frozen base: input gradient only)
    n_lin, n_lora = core._linear_params(model, 4)
    assert n_lin > 0 and n_lora > 0
    assert train(7, 0, 3) - 6 * n_lora * 7 == pytest.approx(2 * (fwd(7, 0, 3) - 2 * n_lora * 7))


def test_prompt_groups_are_per_policy_and_prompt_and_mark_what_the_update_trains():
    from teamrl.core.sample import Sample

    anchors = _module("anchors")

    def mk(policy, prompt, n, adv, trainable=True):
        return Sample(role=policy, policy=policy, problem_id=0, prompt_ids=prompt, completion_ids=[1] * n,
                      sampling_logprobs=[], advantage=adv, trainable=trainable)

    groups = anchors.prompt_groups([mk("a", [1, 2, 3], 4, 0.5), mk("a", [1, 2, 3], 2, 0.0), mk("b", [1, 2, 3], 4, -1.0),
                                    mk("b", [1, 2, 3], 4, 1.0, trainable=False)])
    assert groups == [(3, [4, 2], [True, False]), (3, [4, 4], [True, False])]


def test_work_line_gives_the_share_of_peak_run_and_needed():
    anchors = _module("anchors")
    r = {"kind": "magrpo", "T": 32, "anchor": "comlrl", "teamrl_s": 50.0, "anchor_s": 150.0,
         "teamrl_flops": [{"total": 2e12, "rollout": 0.5e12, "update": 1.5e12, "floor": 1.5e12}] * 3,
         "teamrl_peak_gflops": [48.0, 50.0, 60.0], "teamrl_phases": [{"rollout_s": 20.0, "update_s": 30.0}] * 3}
    line = anchors.work_line(r, 5.0)
    # 2 TFLOP in 50 s = 40 GFLOP/s = 80% of 50; 5x 150 s = 30 s: 67 GFLOP/s = 133%, the update alone 50 = 100%
    assert "2.00 TFLOP (rollout 0.50, update 1.50)" in line and "40 GFLOP/s" in line and "80% of the peak (50 GFLOP/s)" in line
    assert "(30.0 s per iteration) would take 67 GFLOP/s, 133% of the peak" in line and "50 GFLOP/s, 100%." in line
    assert "the rollout 25 GFLOP/s in 20.0 s, 50%; the update 50 GFLOP/s in 30.0 s, 100%" in line


def test_render_reads_the_vllm_rollout_result_as_vllm_rollout_bench_writes_it():
    """(f)'s rows come from ``bench/vllm_rollout_bench.py --json`` as it is (a smoke run's output, 8 tokens)."""
    import argparse

    anchors = _module("anchors")
    workload = {"kind": "grpo", "policies": 1, "rows": 32, "tokens": 256, "shape": "4 x 8",
                "times": {"teamrl": [2.0, 2.5, 3.0], "vllm": [5.0, 6.0, 8.0]}, "median": {"teamrl": 2.5, "vllm": 6.0},
                "sanity": {"teamrl": "ok: 32 completions of 8 tokens", "vllm": "FAILED: 1 empty; 32 completions of 8 tokens"}}
    result = {"tokens": 8, "repeats": 3, "threads": 2, "vllm_bind": "auto", "cores": 2, "workloads": [workload],
              "vllm_start_s": 43.8, "vllm_version": "0.32.0", "vllm_exit": 0}
    args = argparse.Namespace(threads=2, steps=1, rounds=3, magrpo_tokens=[32], grpo_tokens=[64], only="f")
    table = anchors.render({"anchors": [], "vllm": result}, args)
    row = next(line for line in table.splitlines() if line.startswith("| (f)"))
    assert "vLLM 0.32.0" in row and "2.5 s (2.0-3.0 s, n=3; 102 tok/s)" in row and "6.0 s (5.0-8.0 s, n=3; 43 tok/s)" in row
    assert "2.40x (1.67-4.00x)" in row and row.endswith("| ok / FAILED |")
    assert "started in 44 s (not timed) and exited with status 0" in table
