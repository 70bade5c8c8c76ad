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
