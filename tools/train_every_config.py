"""Train every shipped config one step on the tiny random model, one after another, and print a Markdown table.

Each config is trained by ``teamrl train`` in its own subprocess (examples with their ``--plugin``), with tiny
sizes: ``model=tiny-random``, ``rollout.group_size=2``, ``rollout.batch_size=1``, ``rollout.max_new_tokens=8``,
``train.steps=1``, ``threads=1``, the run directory in a temporary folder, and ``task.num_problems`` (and
``task.test_size``) made small where the config sets them. A study config (``configs/study_*.yaml`` with a ``base``)
trains each of its cells' configs as ``teamrl study`` builds them (workflow x policy, and its single-agent cell).
This checks that every shipped
config still trains; the numbers of a random model are not results.

    python tools/train_every_config.py            # every config (about 10 minutes on 2 busy cores)
    python tools/train_every_config.py --only research,sudoku
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TEAMRL = Path(sys.executable).parent / "teamrl"
TINY = ["model=tiny-random", "rollout.group_size=2", "rollout.batch_size=1", "rollout.max_new_tokens=8",
        "train.steps=1", "threads=1", "policy.device=cpu", "run.progress=false", "run.tensorboard=false",
        "train.eval_every=0", "train.final_eval_problems=0"]
TIMEOUT_S = 600


def _small_task(task: dict) -> list[str]:
    """Overrides that shrink the task where the config names its size (so the option exists)."""
    out = []
    if "num_problems" in task:
        out.append("task.num_problems=8")
    if "test_size" in task:
        out.append("task.test_size=2")
    return out


def runs(workdir: Path) -> list[tuple[str, list[str]]]:
    """(label, ``teamrl train`` arguments before the tiny overrides) for every shipped config; a study's cell
    configs are written to ``workdir``."""
    from teamrl.core.config import config_to_dict
    from teamrl.trainer.study import cell_config, cells, load_study

    out: list[tuple[str, list[str]]] = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        rel = str(path.relative_to(ROOT))
        if "base" in raw:  # a study: each cell is a training config (its base plus the cell's overrides)
            study = load_study(path)
            for cell in cells(study):
                cell_yaml = workdir / f"{path.stem}-{cell.name}.yaml"
                cell_yaml.write_text(yaml.safe_dump(config_to_dict(cell_config(study, cell)), sort_keys=False))
                out.append((f"{rel} [{cell.name}]", [str(cell_yaml), *_small_task(cell.task)]))
        else:
            out.append((rel, [rel, *_small_task(raw.get("task") or {})]))
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        rel = str(path.relative_to(ROOT))
        out.append((rel, [rel, "--plugin", str(path.with_suffix(".py").relative_to(ROOT)),
                          *_small_task(raw.get("task") or {})]))
    return out


def train_one(args: list[str], run_dir: Path) -> tuple[bool, float, float | None, str]:
    """(ok, seconds, reward_mean of the last step, the last line of stderr when it failed)."""
    start = time.monotonic()
    try:
        done = subprocess.run([str(TEAMRL), "train", *args, *TINY, f"run.dir={run_dir}", "name=run"], cwd=ROOT,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - start, None, f"timed out after {TIMEOUT_S} s"
    seconds = time.monotonic() - start
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return False, seconds, None, lines[-1] if lines else f"exit status {done.returncode}"
    metrics = run_dir / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
    return True, seconds, (rewards[-1] if rewards else None), ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated substrings of the config labels to train")
    ns = parser.parse_args(argv)
    wanted = [s for s in ns.only.split(",") if s]
    failed = 0
    print("| config | result | seconds | reward_mean |")
    print("|---|---|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="teamrl-every-config-") as workdir:
        for label, args in runs(Path(workdir)):
            if wanted and not any(w in label for w in wanted):
                continue
            with tempfile.TemporaryDirectory(prefix="teamrl-every-config-run-") as tmp:
                ok, seconds, reward, why = train_one(args, Path(tmp))
            failed += not ok
            reward_text = "" if reward is None else f"{reward:.3f}"
            print(f"| {label} | {'ok' if ok else 'failed: ' + why.replace('|', '/')} | {seconds:.0f} | {reward_text} |",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
