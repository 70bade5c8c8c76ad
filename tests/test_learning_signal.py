"""Signal diagnostics (issue 31, item 2): every step logs the share of comparison groups with a non-zero
advantage (per role too) and of samples that reach the loss; ``teamrl train`` says when a run had none."""

from __future__ import annotations

import json

from teamrl.api import register_reward
from teamrl.cli import main
from teamrl.core.sample import Sample
from teamrl.trainer.diagnostics import learning_signal, signal_summary

TINY = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=6", "rollout.batch_size=2", "rollout.group_size=4",
        "run.progress=false", "run.tensorboard=false", "run.log_episodes=false", "train.steps=2", "policy.lora.r=4"]


@register_reward("signal_test_constant")  # every sample scores alike: every group's advantages are 0
def _constant(sample, outcome):
    return 0.5


@register_reward("signal_test_varies")  # differs between samples of a random model: groups vary
def _varies(sample, outcome):
    return (sum(sample.completion_ids) % 7) / 6


def _train(capsys, tmp_path, reward: str) -> tuple[list[dict], str]:
    rc = main(["train", *TINY, f"run.dir={tmp_path}", f"name={reward}", f"workflow.reward={reward}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    records = [json.loads(line) for line in (tmp_path / reward / "metrics.jsonl").read_text().splitlines()]
    return records, out


def test_a_constant_reward_logs_no_signal_and_the_summary_says_so(capsys, tmp_path):
    records, out = _train(capsys, tmp_path, "signal_test_constant")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:  # 2 problems per step, one group each
        assert r["signal/groups"] == 2 and r["signal/groups_with_signal"] == 0
        assert r["signal/groups_varied"] == 0 and r["signal/groups_varied/agent"] == 0
        assert r["signal/samples_in_loss"] == 0
    assert "no learning signal: 0 of 4 groups varied over 2 steps" in out


def test_a_varying_reward_logs_signal(capsys, tmp_path):
    records, out = _train(capsys, tmp_path, "signal_test_varies")
    assert all(r["signal/groups_varied"] > 0 and r["signal/samples_in_loss"] > 0 for r in records)
    k = sum(int(r["signal/groups_with_signal"]) for r in records)
    assert f"learning signal: {k} of 4 groups varied" in out and "no learning signal" not in out
    # the report draws it: one chart of the shares (the HTML page and report.md's PNG)
    from teamrl.trainer.report import write_report

    index = write_report(tmp_path / "signal_test_varies")
    assert "learning signal: share of groups with a non-zero advantage" in index.read_text()
    assert (index.parent / "signal.png").read_bytes()[:4] == b"\x89PNG"


def _sample(role: str, group: str, advantage: float) -> Sample:
    return Sample(role=role, policy="shared", problem_id=group, prompt_ids=[1], completion_ids=[2], sampling_logprobs=[0.0],
                  group=group, advantage=advantage)


def test_signal_per_declared_role_and_the_update_rule_for_the_loss():
    samples = [_sample("generator0", "g1", 0.5), _sample("generator1", "g1", -0.5),  # one varied group of generators
               _sample("generator0", "g2", 0.0), _sample("generator1", "g2", 0.0),
               _sample("aggregator", "g3", 0.0), _sample("aggregator", "g3", 0.0)]
    out = learning_signal(samples, ["generator", "aggregator"])
    assert out["signal/groups"] == 3 and out["signal/groups_with_signal"] == 1
    assert abs(out["signal/groups_varied"] - 1 / 3) < 1e-9
    assert out["signal/groups_varied/generator"] == 0.5 and out["signal/groups_varied/aggregator"] == 0
    assert abs(out["signal/samples_in_loss"] - 2 / 6) < 1e-9
    # with a KL term every sample reaches the loss (the update's rule, passed in)
    assert learning_signal(samples, ["generator", "aggregator"], contributes=lambda s: True)["signal/samples_in_loss"] == 1
    assert signal_summary([{"step": 1}]) is None  # a run from before the diagnostics: nothing said
    assert signal_summary([{"signal/groups": 40, "signal/groups_with_signal": 1, "signal/samples_in_loss": 0.01}]).startswith(
        "little learning signal: 1 of 40 groups varied (2%)")
