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
