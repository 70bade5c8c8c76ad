"""One source per setting (issue 45, item 5): each setting declared once, read through one named place."""

from __future__ import annotations

import dataclasses

import pytest

from teamrl.core.config import load_config
from teamrl.rollout.engine import SamplingParams


def test_sampling_params_come_from_the_rollout_section_field_by_field():
    cfg = load_config(None, ["rollout.max_new_tokens=7", "rollout.temperature=0.5", "rollout.top_p=0.9", "rollout.top_k=3",
                             "rollout.stop=[x, y]", "rollout.ignore_eos=true", "rollout.min_new_tokens=2"])
    p = SamplingParams.from_rollout(cfg.rollout)
    assert p == SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=3, stop=("x", "y"), ignore_eos=True,
                               min_new_tokens=2)
    # every sampling field has a rollout field of its name: a new one cannot be forgotten
    assert {f.name for f in dataclasses.fields(SamplingParams)} <= {f.name for f in dataclasses.fields(cfg.rollout)}
    assert SamplingParams.from_rollout(cfg.rollout, temperature=0.0).temperature == 0.0


@pytest.mark.parametrize("override, new", [
    ("workflow.num_generators=4", "workflow.options.num_generators"),
    ("workflow.max_iterations=2", "workflow.options.max_iterations"),
    ("workflow.max_subtasks=3", "workflow.options.max_subtasks"),
    ("m_grpo.ray_timeout_s=7", "policy.ray_timeout_s"),
    ("m_grpo.ray_address=auto", "policy.ray_address"),
    ("m_grpo.decoupled=ray", "policy.placement"),
])
def test_a_removed_legacy_key_fails_in_one_line_naming_the_new_key(override, new):
    from teamrl.core.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm=m_grpo", "task.name=research", override] if override.startswith("m_grpo")
                    else ["task.name=math.solve", "workflow.name=voting", override])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(override.split("=")[0] + " was moved: write ") and new in msg


@pytest.mark.parametrize("key, value", [("eps_low", 1.5), ("dual_clip", 0.5), ("aggregation", "dapo"),
                                        ("importance_cap", float("inf")), ("kl_coef", -1.0)])
def test_the_loss_section_and_policy_loss_share_one_declaration_and_one_check(key, value):
    from teamrl.core.config import ConfigError, LossConfig, TrainConfig
    from teamrl.losses import LossConfig as PolicyLossConfig

    assert PolicyLossConfig is LossConfig and TrainConfig().loss == LossConfig()
    with pytest.raises(ConfigError) as from_yaml:
        load_config(None, [f"train.loss.{key}={value}"])
    with pytest.raises(ConfigError) as from_python:
        LossConfig(**{key: value})
    assert str(from_yaml.value) == "train.loss." + str(from_python.value).removeprefix("LossConfig.")
    assert "\n" not in str(from_python.value)


def test_derived_loss_values_are_resolved_in_one_place_and_update_params_follow_train():
    from teamrl.core.config import TrainConfig
    from teamrl.trainer.update import UPDATE_FIELDS, UpdateParams, make_update_params

    cfg = load_config(None, ["train.loss.aggregation=dr_grpo", "rollout.max_new_tokens=9", "rollout.max_staleness=1",
                             "train.micro_batch_size=3", "train.role_grad_norms=true"])
    p = make_update_params(cfg, ("a",))
    assert (p.loss.importance_correction, p.loss.max_completion_length) == ("token", 9)
    assert (p.micro_batch_size, p.role_grad_norms, p.roles) == (3, True, ("a",))
    assert cfg.train.loss.importance_correction == "auto"  # the config keeps what was written
    train = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert {f.name: f.default for f in dataclasses.fields(UpdateParams) if f.name in UPDATE_FIELDS} == \
        {k: train[k] for k in UPDATE_FIELDS}
    assert load_config(None, []).train.loss.resolve(0, 48).importance_correction == "none"
