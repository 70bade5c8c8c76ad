import subprocess
import sys

import pytest

from teamrl.core.config import Config, ConfigError, load_config
from teamrl.core.schema_doc import describe_schema


def test_defaults_and_overrides_are_typed(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: x\ntrain: {steps: 3}\n")
    cfg = load_config(f, ["train.lr=1e-3", "policy.lora=null", "rollout.stop=['</a>']", "policy.mode=separate"])
    assert isinstance(cfg, Config)
    assert cfg.name == "x" and cfg.train.steps == 3
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.policy.lora is None and cfg.rollout.stop == ["</a>"]


@pytest.mark.parametrize("override, words", [
    ("train.lrr=1", ["train.lrr", "unknown key", "lr"]),
    ("train.lr=abc", ["train.lr", "number"]),
    ("rollout.top_p=2", ["rollout.top_p", "<= 1"]),
    ("policy.mode=team", ["policy.mode", "shared", "lora_per_role", "separate"]),
    ("policy.lora.r=0", ["policy.lora.r", ">= 1"]),
    ("rollout.group_size=1.5", ["rollout.group_size", "integer"]),
    ("train.loss.aggregation=sum", ["train.loss.aggregation", "token_mean", "dr_grpo"]),
    ("run.log_episodes=3", ["run.log_episodes", "true or false"]),
])
def test_bad_values_name_the_key_and_what_is_allowed(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="policy.lora"):
        load_config(None, ["policy.mode=lora_per_role", "policy.lora=null"])
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load_config(None, ["rollout.group_size=1"])
    assert load_config(None, ["rollout.group_size=1", "train.advantage=max"]).rollout.group_size == 1


def test_missing_file_and_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["train.lr"])


def test_cli_fails_fast_with_one_line_before_loading_a_model(tmp_path):
    # The default model is smollm2-135m; a config error must come before any load.
    r = subprocess.run([sys.executable, "-m", "teamrl.cli", "train", "train.steps=0", f"run.dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["teamrl: config error: train.steps: 0 is out of range; must be >= 1"]
    assert not list(tmp_path.iterdir())


def test_task_options_are_validated():
    from teamrl.tasks import make_task

    with pytest.raises(ConfigError, match="task.name"):
        make_task({"name": "nope"})
    with pytest.raises(ConfigError, match="task.num_problem"):
        make_task({"name": "word_count", "num_problem": 3})
    assert len(make_task({"name": "word_count", "num_problems": 5}).problems()) == 5


def test_schema_reference_lists_every_leaf():
    keys = [row[0] for row in describe_schema()]
    for k in ("train.loss.eps_high", "rollout.top_k", "policy.lora.r", "run.save_every", "model"):
        assert k in keys


def test_config_reference_lists_every_key():
    from pathlib import Path

    reference = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    missing = [k for k, *_ in describe_schema() if f"| `{k}` |" not in reference]
    assert not missing, f"docs/config.md lacks {missing}; regenerate with python tools/config_reference.py"
