"""Non-finite numbers never reach the weights: a NaN/inf reward is an error naming where it came
from (or, as asked, its group is dropped and counted); a non-finite loss or gradient skips the
step and leaves the weights untouched; no checkpoint holds a NaN; config numbers are finite."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from teamrl.core.config import ConfigError, load_config
from teamrl.core.sample import Sample
from teamrl.losses import LossConfig
from teamrl.policies.policy import Policy
from teamrl.trainer.trainer import Trainer
from teamrl.trainer.update import UpdateParams, update_policy

TINY = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=6", "rollout.batch_size=2", "rollout.group_size=3",
        "run.progress=false", "run.tensorboard=false", "train.lr=1e-2", "policy.lora.r=4"]


def _trainer(tmp_path, *extra) -> Trainer:
    return Trainer(load_config(None, [*TINY, f"run.dir={tmp_path}", "name=nf", *extra]))


def _weights(tr: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for pol in tr.router.policies.values() for p in pol.parameters()]


def _poison_one_reward(monkeypatch, value: float = float("nan")) -> None:
    rollout = Trainer._rollout

    def poisoned(self, problems, make_ctx, scheduler):
        samples = rollout(self, problems, make_ctx, scheduler)
        samples[-1].reward = value
        return samples

    monkeypatch.setattr(Trainer, "_rollout", poisoned)


@pytest.mark.parametrize("override", ["train.lr=.inf", "train.lr=-.inf", "train.advantage_eps=.inf", "train.loss.kl_coef=.inf",
                                      "train.loss.eps_high=.inf", "train.max_grad_norm=.inf", "rollout.temperature=.nan",
                                      "train.loss.eps_low=.nan"])
def test_config_numbers_must_be_finite(override: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(override.split("=")[0] + ":") and "finite" in msg


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_reward_is_an_error_naming_task_problem_and_role(tmp_path, monkeypatch, value: float) -> None:
    _poison_one_reward(monkeypatch, value)
    tr = _trainer(tmp_path)
    before = _weights(tr)
    with pytest.raises(ValueError) as err:
        tr.train_step()
    msg = str(err.value)
    assert "\n" not in msg and "word_count" in msg and "problem" in msg and "'agent'" in msg and "nonfinite_reward" in msg
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(tr)))


def test_drop_group_option_drops_and_counts_the_group(tmp_path, monkeypatch) -> None:
    _poison_one_reward(monkeypatch)
    tr = _trainer(tmp_path, "train.nonfinite_reward=drop_group", "train.steps=1")
    rec = tr.train_step()
    assert rec["nonfinite_groups_dropped"] == 1
    assert rec["skipped_steps/shared"] == 0
    assert all(math.isfinite(v) for v in rec.values() if isinstance(v, float))
    assert all(torch.isfinite(w).all() for w in _weights(tr))
    assert rec["tokens/shared"] > 0  # the other group trained


def _sample(i: int, tok, adv: float) -> Sample:
    return Sample(role="a", policy="p", problem_id=0, prompt_ids=[256, 30 + i], completion_ids=[40 + i, 41, tok.eos_token_id],
                  sampling_logprobs=[], advantage=adv)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_skips_the_step_and_leaves_the_weights(tiny, capsys, bad: float) -> None:
    model, tok = tiny
    pol = Policy("p", copy.deepcopy(model), None, lr=1e-2, weight_decay=0.0)
    before = [p.detach().clone() for p in pol.parameters()]
    stats = update_policy(pol, [_sample(0, tok, 1.0), _sample(1, tok, bad)], UpdateParams(loss=LossConfig()),
                          tok.pad_token_id, [tok.eos_token_id])
    assert stats["skipped_steps"] == 1.0
    assert all(math.isfinite(v) for v in stats.values())
    assert all(torch.equal(a, b) for a, b in zip(before, pol.parameters()))
    assert not pol.optimizer.state  # the optimizer's moments were not touched either
    assert "'p'" in capsys.readouterr().err
    ok = update_policy(pol, [_sample(0, tok, 1.0), _sample(1, tok, -1.0)], UpdateParams(loss=LossConfig()),
                       tok.pad_token_id, [tok.eos_token_id])
    assert ok["skipped_steps"] == 0.0 and not all(torch.equal(a, b) for a, b in zip(before, pol.parameters()))


def test_no_checkpoint_holds_a_nan(tmp_path) -> None:
    from teamrl.trainer.checkpoint import list_checkpoints, save_checkpoint

    tr = _trainer(tmp_path)
    save_checkpoint(tr.ckpt_dir, 1, tr.router, {"data_position": 0})
    with torch.no_grad():
        next(iter(tr.router.policies["shared"].parameters()))[0].fill_(float("nan"))
    with pytest.raises(ValueError) as err:
        save_checkpoint(tr.ckpt_dir, 2, tr.router, {"data_position": 0})
    assert "\n" not in str(err.value) and "'shared'" in str(err.value)
    assert [p.name for p in list_checkpoints(tr.ckpt_dir)] == ["step_000001"]
    assert sorted(p.name for p in tr.ckpt_dir.iterdir()) == ["step_000001"]  # no half-written folder left


def test_cli_reports_a_non_finite_reward_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    from teamrl.cli import main

    _poison_one_reward(monkeypatch)
    rc = main(["train", *TINY, f"run.dir={tmp_path}", "name=cli", "train.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("teamrl: task 'word_count': reward nan for problem")
    assert not any("Traceback" in line for line in err)


def test_decoupled_placement_checks_rewards_too(tmp_path, monkeypatch) -> None:
    from pathlib import Path

    from teamrl.trainer.trainer import make_trainer

    rollout = Trainer._rollout

    def poisoned(self, problems, make_ctx, scheduler):
        samples = rollout(self, problems, make_ctx, scheduler)
        next(s for s in samples if s.role == "main").reward = float("nan")
        return samples

    monkeypatch.setattr(Trainer, "_rollout", poisoned)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "m_grpo_research.yaml")
    common = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=6", "rollout.batch_size=2", "rollout.group_size=2",
              "run.progress=false", "run.tensorboard=false", "run.log_episodes=false", "policy.lora.r=4",
              "policy.mode=separate", "policy.placement=local", f"run.dir={tmp_path}"]
    with pytest.raises(ValueError, match="task 'research': reward nan for problem .*role 'main'"):
        make_trainer(load_config(config, [*common, "name=err"])).train_step()
    tr = make_trainer(load_config(config, [*common, "name=drop", "train.nonfinite_reward=drop_group"]))
    rec = tr.train_step()
    assert rec["nonfinite_groups_dropped"] == 1  # one trainer counts the dropped groups of every policy
    assert all(torch.isfinite(v).all() for a in tr.router.policies for v in tr.learner.state(a)[0].values())


def test_trainer_logs_a_skipped_step_and_saves_finite_weights(tmp_path, monkeypatch) -> None:
    assign = Trainer._assign_advantages

    def nan_advantage(self, samples):  # past the reward check, e.g. a loss that overflows
        train = assign(self, samples)
        train[0].advantage = float("nan")
        return train

    monkeypatch.setattr(Trainer, "_assign_advantages", nan_advantage)
    tr = _trainer(tmp_path, "train.steps=1", "run.save_every=1")
    before = _weights(tr)
    rec = tr.train_step()
    assert rec["skipped_steps/shared"] == 1 and rec["optimizer_steps/shared"] == 0
    assert "loss/shared" not in rec and "grad_norm/shared" not in rec  # no NaN in the metrics
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(tr)))
    ckpt = torch.load(tr.ckpt_dir / "step_000001" / "policy_shared.pt")
    assert all(torch.isfinite(v).all() for v in ckpt.values())


def test_drop_group_in_a_magrpo_tree_whose_root_groups_are_dropped(tmp_path, monkeypatch) -> None:
    """A NaN return reaches the root joint actions: turn 0 is dropped, the later turn still trains."""
    from pathlib import Path

    rollout = Trainer._rollout

    def poisoned(self, problems, make_ctx, scheduler):
        samples = rollout(self, problems, make_ctx, scheduler)
        for s in samples:
            if s.turn == 0:
                s.reward = float("nan")
        return samples

    monkeypatch.setattr(Trainer, "_rollout", poisoned)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "magrpo_writing_expand.yaml")
    tr = Trainer(load_config(config, ["model=tiny-random", "threads=1", "rollout.max_new_tokens=4", "rollout.batch_size=1",
                                      "rollout.group_size=2", "magrpo.num_turns=2", "run.progress=false", "run.tensorboard=false",
                                      f"run.dir={tmp_path}", "train.nonfinite_reward=drop_group", "policy.lora.r=4"]))
    rec = tr.train_step()
    assert rec["nonfinite_groups_dropped"] == len(tr.roles)  # one turn-0 group per agent
    assert "normalised_return" not in rec and math.isfinite(rec["normalised_return_last_turn"])
