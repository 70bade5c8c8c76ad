"""Each algorithm's config section lives beside the algorithm; core/config.py names none (issue 14, item 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from teamrl.core.config import ConfigError, load_config


def test_loss_eps_low_out_of_range_is_refused_by_the_schema():
    # before: passed load_config and failed only in LossConfig, after the model loaded
    with pytest.raises(ConfigError, match=r"train.loss.eps_low: 1.5 is out of range; must be <= 1"):
        load_config(None, ["train.loss.eps_low=1.5"])


def test_algorithm_sections_are_registered_beside_their_algorithms():
    from teamrl.algorithms.at_grpo import ATGRPOConfig
    from teamrl.algorithms.m_grpo import MGRPOConfig
    from teamrl.algorithms.magrpo import MAGRPOConfig
    from teamrl.core.config import SECTIONS, config_to_dict
    from teamrl.core.schema_doc import describe_schema

    assert SECTIONS["magrpo"] is MAGRPOConfig and SECTIONS["at_grpo"] is ATGRPOConfig and SECTIONS["m_grpo"] is MGRPOConfig
    cfg = load_config(None, ["algorithm=magrpo", "magrpo.num_turns=2", "at_grpo.alpha=0.5"])
    assert cfg.section(MAGRPOConfig).num_turns == 2 and cfg.section(ATGRPOConfig).alpha == 0.5
    assert cfg.section(MGRPOConfig).d_max == 2
    assert config_to_dict(cfg)["magrpo"]["num_turns"] == 2  # the run directory's config.yaml keeps them
    assert "magrpo.num_turns" in [row[0] for row in describe_schema()]
    with pytest.raises(ConfigError, match=r"magrpo.joint_mode: 'both' is not allowed; choose one of \['aligned', 'cross'\]"):
        load_config(None, ["magrpo.joint_mode=both"])
    with pytest.raises(ConfigError, match=r"algorithm: 'ppo' is not allowed; choose one of \['at_grpo', 'grpo', 'm_grpo', 'magrpo'\]"):
        load_config(None, ["algorithm=ppo"])


def test_core_config_names_no_algorithm_section():
    source = (Path(__file__).parents[1] / "teamrl" / "core" / "config.py").read_text()
    for name in ("MAGRPOConfig", "ATGRPOConfig", "MGRPOConfig", '"magrpo"', '"at_grpo"', '"m_grpo"', "cfg.m_grpo", "cfg.magrpo"):
        assert name not in source, name


def test_an_algorithm_reads_its_section_plus_the_run_values_passed_explicitly():
    from teamrl.algorithms import ATGRPO, MAGRPO, MGRPO, ATGRPOConfig, MAGRPOConfig, MGRPOConfig, make_algorithm
    from teamrl.tasks import make_task

    cfg = load_config(None, ["algorithm=magrpo", "task.name=plan_path", "rollout.group_size=3", "magrpo.gamma=0.5"])
    algo = make_algorithm(cfg, make_task(cfg.task))
    assert isinstance(algo, MAGRPO) and algo.config is cfg.section(MAGRPOConfig) and algo.group_size == 3
    assert (ATGRPO(ATGRPOConfig(), k=5, seed=2).k, MGRPO(MGRPOConfig(), k=6, seed=1).seed) == (5, 1)
    with pytest.raises(KeyError, match="LoraConfig is not a registered config section"):
        from teamrl.core.config import LoraConfig

        cfg.section(LoraConfig)
    with pytest.raises(AttributeError):
        cfg.magrpo  # noqa: B018  (no untyped access: cfg.section(MAGRPOConfig))


def test_a_config_copied_with_dataclasses_replace_keeps_its_algorithm_sections():
    """Held-out evaluation copies the config with another task; the m_grpo section must come along
    (it was lost: an m_grpo.agents=single run was evaluated as a main + sub team)."""
    import dataclasses

    from teamrl.algorithms import MAGRPOConfig, MGRPOConfig
    from teamrl.core.config import config_to_dict, load_config

    cfg = load_config(None, ["algorithm=m_grpo", "task.name=research", "m_grpo.agents=single", "magrpo.gamma=0.5"])
    copy = dataclasses.replace(cfg, task={**cfg.task, "seed": 7})
    assert copy.section(MGRPOConfig).agents == "single" and copy.section(MAGRPOConfig).gamma == 0.5 and copy.task["seed"] == 7
    data = config_to_dict(copy)
    assert data["m_grpo"]["agents"] == "single" and "sections" not in data
    with pytest.raises(ConfigError, match="sections: unknown key"):
        load_config(None, ["sections={}"])
