"""The Sample fields that steer training are typed (``trainable``, ``baseline``, ``role_reward``,
``trajectory``): a misspelt one is an error, not a silently ignored tag; ``tags`` stays for
free-form diagnostics and refuses the old steering keys."""

from __future__ import annotations

import dataclasses
import pickle
from types import SimpleNamespace

import pytest

from teamrl.core.sample import Sample
from teamrl.losses import trajectory_ids
from teamrl.trainer.trainer import Trainer
from teamrl.workflows import REWARDS
from teamrl.workflows.outcome import EpisodeOutcome


def _sample(**kw) -> Sample:
    return Sample("agent", "shared", "q", [1], [2], [0.0], **kw)


def test_a_misspelt_steering_field_is_an_error_not_a_silent_attribute():
    s = _sample()
    with pytest.raises(AttributeError):
        s.trainabel = False  # type: ignore[attr-defined]
    s.trainable = False
    assert not s.trainable


@pytest.mark.parametrize("key,field", [("no_update", "trainable"), ("baseline", "baseline"),
                                       ("role_reward", "role_reward"), ("trajectory", "trajectory")])
def test_an_old_steering_tag_is_refused_naming_its_field(key, field):
    with pytest.raises(ValueError, match=rf"tags\[{key!r}\] steers training.*Sample\.{field}"):
        _sample(tags={key: True})


def test_defaults_train_the_sample_alone_on_the_episode_outcome():
    s = _sample(tags={"solved": True})
    assert (s.trainable, s.baseline, s.role_reward, s.trajectory) == (True, False, None, None)
    copy = pickle.loads(pickle.dumps(dataclasses.replace(s, trainable=False, trajectory=(0, 1))))
    assert (copy.trainable, copy.trajectory, copy.tags) == (False, (0, 1), {"solved": True})


def test_the_record_shows_the_steering_fields():
    rec = _sample(trainable=False, baseline=True, role_reward=0.5, trajectory=(2, 0)).to_record()
    assert (rec["trainable"], rec["baseline"], rec["role_reward"], rec["trajectory"]) == (False, True, 0.5, "(2, 0)")
    assert "tags" not in rec


def test_per_role_reward_reads_the_typed_field():
    outcome = EpisodeOutcome(final_text="4", answer="4", correct=True)
    assert REWARDS["per_role"](_sample(role_reward=0.0), outcome) == 0.0
    assert REWARDS["per_role"](_sample(), outcome) == 1.0


def test_trajectory_ids_count_samples_of_one_trajectory_once():
    assert trajectory_ids([(0, 1), None, (0, 1), None]).tolist() == [0, 1, 0, 2]


def test_a_steering_tag_written_after_construction_stops_the_trainer():
    late = _sample()
    late.tags["no_update"] = True  # ignored silently if nothing looked
    with pytest.raises(ValueError, match=r"tags\['no_update'\].*Sample\.trainable"):
        Trainer._assign_advantages(SimpleNamespace(), [_sample(), late])
