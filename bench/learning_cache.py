"""The learning benchmark's cache of finished runs (``bench/learning.py``): one JSON cell per (comparison, arm,
seed), keyed by a fingerprint of everything that decides its result."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

from learning_grid import PER_SEED, WARM_LR, ArmResult, Comparison, Level, _overrides, _policy_overrides, _slug


def cell_path(cells: Path, comp: Comparison, index: int, seed: int) -> Path:
    """Where the (comparison, arm, seed) run's result is cached (an arm evaluated once: one cell for every seed)."""
    arm = comp.arms[index]
    return cells / comp.key / (f"{_slug(arm.label)}-every-seed.json" if arm.seed_free else f"{_slug(arm.label)}-seed{seed}.json")


def for_seeds(one: ArmResult, seeds: list[int]) -> list[ArmResult]:
    """An arm evaluated once (``Arm.seed_free``): its one result as each seed's, so it pairs with every seed's runs."""
    return [dataclasses.replace(one, **{**{f: list(getattr(one, f)) for f in PER_SEED}, "seeds": [s]}) for s in seeds]


# Settings that change only how much memory a run takes: a cell run with them is the cell run without them
MEMORY_SETTINGS = ("train.micro_batch_size=",)


def cell_fingerprint(comp: Comparison, index: int, eval_problems: int, quick: bool, level: Level | None) -> str:
    """A digest of everything that decides a run's result: another setting, level, warm start or held-out
    count is another cell (an old cell is then run again, not reused)."""
    arm = comp.arms[index]
    # memory knobs (the same gradient in smaller passes, like the thread count) are not part of what decides it
    overrides = [o for o in _overrides(comp, arm, quick, False, level) if not o.startswith(MEMORY_SETTINGS)]
    what = {"config": comp.config, "overrides": overrides, "eval": eval_problems,
            "rl": arm.rl, "warm": [arm.warm_start, list(comp.warm_roles), comp.warm_problems, comp.warm_epochs, WARM_LR]
            if arm.warm_start else None}
    if arm.method:  # only where set: the cells cached before these fields keep their fingerprints
        what["method"] = arm.method
    if arm.seed_free:
        what["seed_free"] = True
    policy = _policy_overrides(arm)
    if arm.warm_start and policy:  # a warm start of its own policy mode, not the comparison's
        what["warm_policy"] = list(policy)
    if arm.also_eval:
        what["also_eval"] = list(arm.also_eval)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def read_cell(path: Path, fingerprint: str) -> ArmResult | None:
    """The cached one-seed result at ``path`` if it is there and of these settings, else None."""
    try:
        cell = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if cell.get("fingerprint") != fingerprint:
        return None
    names = {f.name for f in dataclasses.fields(ArmResult)}
    one = ArmResult(**{k: v for k, v in cell["result"].items() if k in names})
    for late, empty in LATE_FIELDS.items():  # a cell written before these were recorded: one empty entry per seed
        if not getattr(one, late) and one.seeds:
            setattr(one, late, [empty() for _ in one.seeds])
    return one


# per-seed fields added after cells were committed, and the empty entry of one seed
LATE_FIELDS = {"grad_norms": list, "eval_curves": list, "role_local_rewards": dict, "held_out_own_rewards": dict}


def write_cell(path: Path, fingerprint: str, comp: Comparison, level: Level | None, one: ArmResult) -> None:
    """Cache one finished run (written whole, then renamed: a stopped run never leaves half a cell)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cell = {"comparison": comp.key, "arm": one.label, "seed": one.seeds[0],
            **({"for_every_seed": True} if path.name.endswith("-every-seed.json") else {}), "level": level.label if level else None,
            "fingerprint": fingerprint, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "result": dataclasses.asdict(one)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cell, indent=1) + "\n")
    tmp.replace(path)
