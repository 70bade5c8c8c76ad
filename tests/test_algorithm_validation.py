"""Settings an algorithm cannot run are refused when the config is validated, in one line."""

import pytest

from teamrl.cli import main as cli_main
from teamrl.core.config import ConfigError, load_config

TASK = {"magrpo": "writing.tldr", "at_grpo": "plan_path", "m_grpo": "research"}


@pytest.mark.parametrize("algorithm", sorted(TASK))
def test_greedy_baseline_advantage_is_refused_for_the_team_algorithms(algorithm, capsys):
    with pytest.raises(ConfigError, match=rf"train.advantage: max .* algorithm grpo, not '{algorithm}'; choose one of "
                                          r"\['group', 'mean', 'batch', 'none', 'rloo'\]"):
        load_config(None, [f"algorithm={algorithm}", f"task.name={TASK[algorithm]}", "train.advantage=max"])
    rc = cli_main(["config", f"algorithm={algorithm}", f"task.name={TASK[algorithm]}", "train.advantage=max"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "train.advantage: max" in err
    load_config(None, ["algorithm=grpo", "task.name=word_count", "train.advantage=max"])  # GRPO runs it
