"""Workflow-study diagnostics: per-role gradients, role capture, accuracy cliffs, SP vs IP training."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from teamrl.core.sample import Sample
from teamrl.losses import LossConfig
from teamrl.policies.policy import Policy
from teamrl.trainer.diagnostics import CliffDetector, role_capture
from teamrl.trainer.update import UpdateParams, update_policy


def _samples(tok, role: str, advs: list[float], offset: int = 0) -> list[Sample]:
    eos = tok.eos_token_id
    return [Sample(role=role, policy="p", problem_id=0, prompt_ids=[256, 40 + offset, 41 + i % 2],
                   completion_ids=[60 + offset + i] * (2 + i % 3) + [eos], sampling_logprobs=[], advantage=a)
            for i, a in enumerate(advs)]


def _run(model, tok, samples, role_stats: bool, mb: int = 16) -> dict[str, float]:
    pol = Policy("p", copy.deepcopy(model), None, lr=1e-3, weight_decay=0.0)
    return update_policy(pol, samples, UpdateParams(loss=LossConfig(), micro_batch_size=mb, max_grad_norm=1e9, role_grad_norms=role_stats),
                         tok.pad_token_id, [tok.eos_token_id])


def test_role_gradients_are_the_parts_of_the_joint_gradient(tiny):
    model, tok = tiny
    gen = _samples(tok, "generator0", [1.0, -1.0, 0.5]) + _samples(tok, "generator1", [0.3, -0.2], offset=3)
    agg = _samples(tok, "aggregator", [-0.7, 1.2, 0.4], offset=7)
    joint = gen + agg
    off = _run(model, tok, joint, role_stats=False)
    for mb in (16, 2):
        on = _run(model, tok, joint, role_stats=True, mb=mb)
        # measuring per role changes nothing about the update
        assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-5)
        assert on["loss@generator"] + on["loss@aggregator"] == pytest.approx(on["loss"], abs=1e-6)
        assert on["grad_norm@generator"] + on["grad_norm@aggregator"] >= on["grad_norm"] * (1 - 1e-6)
        # each role's part is its own gradient weighted by its share of the tokens
        for role, own in (("generator", gen), ("aggregator", agg)):
            alone = _run(model, tok, own, role_stats=False)
            share = on[f"tokens@{role}"] / on["tokens"]
            assert on[f"grad_norm@{role}"] == pytest.approx(alone["grad_norm"] * share, rel=1e-4)
            assert 0 < on[f"entropy@{role}"]


def test_identical_roles_sum_to_the_joint_norm(tiny):
    model, tok = tiny
    a = _samples(tok, "evaluator", [1.0, -1.0, 0.5, -0.5])
    b = [dataclasses.replace(s, role="generator", tags={}) for s in a]
    on = _run(model, tok, a + b, role_stats=True)
    # equal parts point the same way: the norms add up exactly
    assert on["grad_norm@evaluator"] == pytest.approx(on["grad_norm@generator"], rel=1e-5)
    assert on["grad_norm@evaluator"] + on["grad_norm@generator"] == pytest.approx(on["grad_norm"], rel=1e-5)


def test_role_capture():
    assert role_capture({"generator": 3.0, "aggregator": 1.0}) == {"generator": 0.75, "aggregator": 0.25}
    assert role_capture({"a": 0.0, "b": 0.0}) == {"a": 0.0, "b": 0.0}
    with pytest.raises(ValueError, match="finite"):
        role_capture({"a": -1.0})
    with pytest.raises(ValueError, match="finite"):
        role_capture({"a": float("nan")})


def test_cliff_detection_on_a_series():
    det = CliffDetector(drop_points=10)
    kinds = [det.update(step, acc).kind for step, acc in enumerate([0.2, 0.4, 0.5, 0.45, 0.38, 0.6, 0.49])]
    assert kinds == ["peak", "peak", "peak", None, "cliff", "peak", "cliff"]
    assert det.cliffs == [4, 6] and det.peak == 0.6 and det.peak_step == 5
    ev = CliffDetector(5).update(0, 0.3)
    assert ev.kind == "peak" and ev.drop_points == 0
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        det.update(7, 1.5)
    with pytest.raises(ValueError, match="drop_points"):
        CliffDetector(0)


def _cfg(tmp_path, *extra):
    from teamrl.core.config import load_config

    return load_config(None, ["name=wf", f"run.dir={tmp_path}", "model=tiny-random", "task.name=math.solve",
                              "task.num_problems=12", "task.test_size=3", "workflow.name=voting", "rollout.group_size=2",
                              "rollout.batch_size=1", "rollout.max_new_tokens=4", "train.steps=2", "run.progress=false",
                              "run.tensorboard=false", *extra])


def test_sp_and_ip_policies_and_equalised_steps(tmp_path, monkeypatch):
    import itertools

    from teamrl.tasks.solve import MathSolve
    from teamrl.trainer.trainer import Trainer

    sp = Trainer(_cfg(tmp_path / "sp", "policy.mode=shared", "train.role_grad_norms=true"))
    assert list(sp.router.policies) == ["shared"]
    rec = sp.train_step()  # a random model is never right: no advantage, no gradient, no capture
    assert rec["role_grad_norm/generator"] == 0.0 and not any(k.startswith("role_capture/") for k in rec)
    flip = itertools.cycle([True, False, False])
    monkeypatch.setattr(MathSolve, "correct_many", lambda self, problem, answers: [next(flip) for _ in answers])
    rec = sp.train_step()
    assert rec["optimizer_steps/shared"] == 1
    assert {"role_grad_norm/generator", "role_grad_norm/aggregator", "role_entropy/aggregator",
            "completion_len/generator", "voting/oracle_accuracy"} <= set(rec)
    assert rec["role_capture/generator"] + rec["role_capture/aggregator"] == pytest.approx(1.0)
    assert rec["role_grad_norm/generator"] > 0
    ip = Trainer(_cfg(tmp_path / "ip", "policy.mode=lora_per_role", "policy.equalize_steps=false"))
    assert sorted(ip.router.policies) == ["aggregator", "generator"]
    rec = ip.train_step()
    # one step per generator instance, one for the aggregator: taken, or skipped for want of signal (issue 55)
    steps = {p: rec[f"optimizer_steps/{p}"] + rec[f"skipped_no_signal/{p}"] for p in ("generator", "aggregator")}
    assert steps == {"generator": 3, "aggregator": 1}
    assert "role_grad_norm/generator" in rec  # under IP a policy's norm is its role's
    eq = Trainer(_cfg(tmp_path / "eq", "policy.mode=lora_per_role"))
    rec = eq.train_step()
    assert rec["optimizer_steps/generator"] + rec["skipped_no_signal/generator"] == 1


def test_role_grad_norm_is_the_mean_over_the_roles_optimizer_steps_whatever_the_flags(tmp_path, monkeypatch):
    """One definition (the workflow study's): a role's gradient norm is the mean of its norms over the optimizer steps
    that trained it, with ``train.role_grad_norms`` on or off (issue 43.4: IP generator, equalize_steps false, 3 steps:
    the sum 2.948 with the flag, the last step's 1.176 without it, the mean 0.983)."""
    import itertools

    import teamrl.trainer.learner as workers
    from teamrl.tasks.solve import MathSolve
    from teamrl.trainer.trainer import Trainer

    real, steps = workers.update_policy_steps, []

    def recording(policy, parts, *a, **k):
        out = real(policy, parts, *a, **k)
        steps.append((policy.name, [s["grad_norm"] for s in out if "grad_norm" in s]))
        return out

    monkeypatch.setattr(workers, "update_policy_steps", recording)
    recs = []
    for flag in ("true", "false"):
        flip = itertools.cycle([True, False, False])
        monkeypatch.setattr(MathSolve, "correct_many", lambda self, problem, answers: [next(flip) for _ in answers])
        steps.clear()
        tr = Trainer(_cfg(tmp_path / flag, "policy.mode=lora_per_role", "policy.equalize_steps=false", "rollout.batch_size=2",
                          f"train.role_grad_norms={flag}"))
        rec = tr.train_step()
        norms = dict(steps)["generator"]
        assert rec["optimizer_steps/generator"] == 3 and len(norms) == 3 and len(set(norms)) == 3, norms
        assert rec["role_grad_norm/generator"] == pytest.approx(sum(norms) / 3, rel=1e-5), (flag, norms, rec)
        assert rec["grad_norm/generator"] == pytest.approx(sum(norms) / 3, rel=1e-5), (flag, norms, rec)
        recs.append(rec)
    assert recs[0]["role_grad_norm/generator"] == pytest.approx(recs[1]["role_grad_norm/generator"], rel=1e-5)
    assert recs[0]["role_capture/generator"] == pytest.approx(recs[1]["role_capture/generator"], rel=1e-5)


def test_cliff_warns_keeps_the_best_checkpoint_and_stops(tmp_path, monkeypatch, capsys):
    from teamrl.core.metrics import read_metrics
    from teamrl.trainer.checkpoint import list_checkpoints
    from teamrl.trainer.trainer import Trainer

    series = iter([0.5, 0.7, 0.4, 0.9])
    monkeypatch.setattr(Trainer, "evaluate_accuracy", lambda self: {"eval/accuracy": next(series)})
    tr = Trainer(_cfg(tmp_path, "train.steps=5", "train.eval_every=1", "train.cliff_points=10", "train.cliff_stop=true"))
    tr.train()
    assert tr.step == 2  # stopped at the cliff
    assert "accuracy cliff at step 2" in capsys.readouterr().err
    best = list_checkpoints(tmp_path / "wf" / "best")
    assert [p.name for p in best] == ["step_000001"]
    assert torch.load(best[0] / "trainer_state.pt", weights_only=False)["eval_accuracy"] == 0.7
    assert [p.name for p in list_checkpoints(tmp_path / "wf" / "checkpoints")][-1] == "step_000002"
    recs = read_metrics(tmp_path / "wf" / "metrics.jsonl")
    assert [(r["step"], r["eval/accuracy"], r.get("eval/cliff")) for r in recs] == [(0, 0.5, None), (1, 0.7, None), (2, 0.4, 1)]
