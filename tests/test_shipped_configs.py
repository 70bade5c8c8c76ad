"""Every shipped config loads, builds its task and passes ``make_algorithm`` (no refusal), before any model loads.

tools/train_every_config.py trains each of them one step on the tiny model (docs/development.md has its table);
this is the seconds-long check. Examples are checked through ``teamrl config --plugin`` in a subprocess, so this
process never registers their names into the library's registries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from teamrl.algorithms import make_algorithm
from teamrl.core.config import load_config
from teamrl.tasks import make_task
from teamrl.trainer.study import cell_config, cells, load_study

ROOT = Path(__file__).resolve().parents[1]
TEAMRL = Path(sys.executable).parent / "teamrl"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
STUDIES = [p for p in CONFIGS if "base" in (yaml.safe_load(p.read_text()) or {})]
TRAINING = [p for p in CONFIGS if p not in STUDIES]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _small(task: dict) -> list[str]:
    """Fewer problems where the config sets the size (so the task has that option)."""
    return (["task.num_problems=8"] if "num_problems" in task else []) + (["task.test_size=2"] if "test_size" in task else [])


def _missing_imports(plugin: Path) -> list[str]:
    """The top-level packages a plugin file imports at its top level that are not installed."""
    import ast
    import importlib.util

    tree = ast.parse(plugin.read_text())
    names = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    return sorted({m.split(".")[0] for m in names} - {m for m in {n.split(".")[0] for n in names}
                                                        if importlib.util.find_spec(m) is not None})


def _builds(cfg) -> None:
    task = make_task(cfg.task)
    algorithm = make_algorithm(cfg, task)  # raises ConfigError on a refused (algorithm, workflow) pair
    assert algorithm is not None
    problems = task.problems() if hasattr(task, "problems") else None
    assert problems is None or len(problems) > 0, f"{cfg.name}: the task has no problems"


def test_every_config_is_covered():
    assert len(TRAINING) >= 18 and STUDIES and len(EXAMPLES) >= 2  # a glob that found nothing checks nothing


@pytest.mark.parametrize("path", TRAINING, ids=[p.stem for p in TRAINING])
def test_training_config_builds_its_task_and_algorithm(path):
    raw = yaml.safe_load(path.read_text())
    cfg = load_config(str(path), _small(raw.get("task") or {}))
    assert cfg.name == raw.get("name", cfg.name)
    _builds(cfg)


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_every_cell_of_a_study_builds_its_task_and_algorithm(path):
    study = load_study(path)
    grid = cells(study)
    assert grid
    for cell in grid:
        cfg = cell_config(study, cell)
        assert cfg.workflow.name == cell.workflow
        _builds(cfg)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_config_with_its_plugin_passes_teamrl_config(path):
    """``teamrl config`` loads the plugin, the config, builds the task and calls make_algorithm, as train does."""
    missing = _missing_imports(path.with_suffix(".py"))
    if missing:  # an agent framework's example: the `agents` extra
        pytest.skip(f"{path.name}: its plugin imports {missing}, not installed (pip install -e '.[agents]')")
    raw = yaml.safe_load(path.read_text())
    done = subprocess.run([str(TEAMRL), "config", str(path), "--plugin", str(path.with_suffix(".py")),
                           *_small(raw.get("task") or {})], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    shown = yaml.safe_load(done.stdout)
    assert shown["workflow"]["name"] == raw["workflow"]["name"] and shown["task"]["name"] == raw["task"]["name"]


def test_train_every_config_lists_every_config_and_trains_one(tmp_path):
    from tools.train_every_config import runs

    labels = [label for label, _ in runs(tmp_path)]
    for path in TRAINING + EXAMPLES:
        assert str(path.relative_to(ROOT)) in labels
    for path in STUDIES:
        assert sum(label.startswith(f"{path.relative_to(ROOT)} [") for label in labels) == len(cells(load_study(path)))
    done = subprocess.run([sys.executable, "tools/train_every_config.py", "--only", "grpo_word_count"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    (row,) = [line for line in done.stdout.splitlines() if "grpo_word_count" in line]
    assert row.split("|")[2].strip() == "ok" and float(row.split("|")[4]) >= 0, row
