"""``teamrl study``: the grid, resumability cell by cell, and the table."""

from __future__ import annotations

import json

import pytest
import yaml

from teamrl.core.config import ConfigError
from teamrl.trainer.study import cells, load_study, run_study


def _write(tmp_path, **extra):
    data = {"name": "t", "workflows": ["voting"], "policies": ["sp", "ip"], "models": ["tiny-random"], "seeds": [0],
            "tasks": [{"name": "math.solve", "num_problems": 8, "test_size": 2}],
            "overrides": [f"run.dir={tmp_path / 'runs'}", "rollout.group_size=2", "rollout.batch_size=1",
                          "rollout.max_new_tokens=4", "train.steps=2", "train.eval_every=1", "train.eval_problems=2",
                          "run.progress=false", "run.tensorboard=false", "run.log_episodes=false"], **extra}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_study_config_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="workflows"):
        load_study(_write(tmp_path, workflows=["single"]))
    with pytest.raises(ConfigError, match="policies"):
        load_study(_write(tmp_path, policies=["xp"]))
    with pytest.raises(ConfigError, match="unknown key"):
        load_study(_write(tmp_path, grid=1))
    study = load_study(_write(tmp_path, workflows=["voting", "eval_opt"], seeds=[0, 1]))
    grid = cells(study)
    assert len(grid) == 2 * (1 + 2 * 2)  # per seed: the single-agent baseline + 2 workflows x 2 policies
    assert [c.workflow for c in grid[:5]] == ["single", "voting", "voting", "eval_opt", "eval_opt"]


def test_study_runs_resumes_and_writes_the_table(tmp_path, monkeypatch):
    study = load_study(_write(tmp_path))
    path = run_study(study)
    table = path.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| math.solve")]
    assert [r.split("|")[3].strip() + "-" + r.split("|")[4].strip() for r in rows] == ["single-SP", "voting-SP", "voting-IP"]
    root = tmp_path / "runs" / "t"
    summary = json.loads((root / "math.solve-tiny-random-voting-ip-s0" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["final_step"] == 2 and 0.0 <= summary["peak"] <= 1.0
    assert (root / "accuracy.png").is_file() and (root / "math.solve-tiny-random-voting-sp-s0" / "report" / "report.md").is_file()

    # finished cells are skipped; a cell without its summary resumes from its checkpoint (nothing left to train)
    (root / "math.solve-tiny-random-voting-sp-s0" / "summary.json").unlink()
    from teamrl.trainer import trainer as trainer_mod

    steps = []
    real = trainer_mod.Trainer.train_step
    monkeypatch.setattr(trainer_mod.Trainer, "train_step", lambda self: steps.append(self.cfg.name) or real(self))
    run_study(study)
    assert steps == []
    assert (root / "math.solve-tiny-random-voting-sp-s0" / "summary.json").is_file()


def test_every_shipped_config_is_valid():
    from pathlib import Path

    from teamrl.core.config import load_config
    from teamrl.trainer.study import cell_config

    shipped = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert shipped
    for path in shipped:
        data = yaml.safe_load(path.read_text())
        if "workflows" in data:  # a study grid
            study = load_study(path)
            assert all(cell_config(study, c).workflow.name == c.workflow for c in cells(study)), path
        else:
            load_config(path)
