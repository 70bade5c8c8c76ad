"""The golden of the synchronous training loop: GRPO and MAGRPO, 3 steps each on the tiny model.

``tests/fixtures/sync_golden.json`` holds every numeric metric of every step (exact floats; the
wall-clock keys left out) and a digest of the final weights of every policy (each tensor's exact
float64 sum and a sha256 of all the bytes). It was written from the committed code, before the
asynchronous loop existed (``rollout.max_staleness``, issue 32), commit 76f255e, at one torch thread
(``threads=1``; 2 threads gave the same bytes)::

    mkdir -p /tmp/head && git archive 76f255e | tar -x -C /tmp/head
    cd /tmp && PYTHONPATH=/tmp/head /work/main/.venv/bin/python /work/main/tests/make_sync_golden.py --write \
        --commit 76f255e722069a327edccd4582eac520e1142766

(from ``/tmp``, so that ``PYTHONPATH`` is what imports ``teamrl``: ``"code"`` in the file says which file it was).
Without ``--write`` it prints the figures of the code it imports.

``tests/test_async_rollout.py`` checks that the loop (``max_staleness=0``) still gives these within
``GOLDEN_REL_TOL``/``GOLDEN_ABS_TOL`` (the floats are another machine's: float32 reduction order differs between
CPUs), and that the pipeline forced on at ``max_staleness=0`` gives the plain loop's metrics and weights exactly,
both computed in the same test session. This file imports nothing from ``tests`` so that
it runs against any checkout of teamrl on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "sync_golden.json"

COMMON = ["model=tiny-random", "threads=1", "train.steps=3", "train.lr=1e-2", "policy.lora.r=4", "run.progress=false",
          "run.tensorboard=false", "run.log_episodes=false", "run.save_every=100"]
CASES: dict[str, list[str]] = {
    # one policy (shared LoRA), 2 problems x 4 samples
    "grpo": ["rollout.max_new_tokens=12", "rollout.batch_size=2", "rollout.group_size=4"],
    # two LoRA adapters on one base (they decode together), two turns of joint actions
    "magrpo": ["algorithm=magrpo", "task.name=golden_team", "policy.mode=lora_per_role", "magrpo.num_turns=2",
               "rollout.max_new_tokens=8", "rollout.batch_size=2", "rollout.group_size=2"],
}
# metrics that measure time, not the computation
WALL_CLOCK = ("_s",)  # rollout_s, update_s, rollout_tokens_per_s, async/*_wait_s, ...: seconds or rates


def golden_team() -> type:
    """A two-agent task whose reward varies on the tiny model's random text (the lengths of the two replies), so
    that MAGRPO's updates change the weights (writing.tldr scores such text 0: no gradient)."""
    from dataclasses import dataclass

    from teamrl.tasks.task import Problem, TeamTask

    @dataclass
    class GoldenOptions:
        name: str = "golden_team"

    class GoldenTeam(TeamTask):
        name = "golden_team"
        roles = ("short", "long")
        max_reward = 2.0
        Options = GoldenOptions

        def __init__(self, opts: Any = None) -> None:
            self.opts = opts or GoldenOptions()

        def problems(self) -> list:
            return [Problem(f"t{i}", {"i": i}) for i in range(4)]

        def prompt(self, problem: Any, role: str, turn: int = 0, history: Any = (), feedback: str = "") -> list:
            prev = history[-1][role] if history else ""
            return [{"role": "user", "content": f"{role} {problem.data['i']} turn {turn} {prev[:8]} {feedback}"}]

        def reward(self, problem: Any, outputs: dict) -> float:
            return max(0.0, 1 - abs(len(outputs["short"]) - 10) / 10) + max(0.0, 1 - abs(len(outputs["long"]) - 20) / 20)

        def feedback(self, problem: Any, outputs: dict, reward: float) -> str:
            return f"score {reward:.1f}"

    return GoldenTeam


def numeric_metrics(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Every numeric key of each record, wall-clock keys left out."""
    return [{k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
             and not any(k.endswith(w) for w in WALL_CLOCK)} for r in records]


def weights_digest(trainer: Any) -> dict[str, Any]:
    """Policy -> {tensor name: exact float64 sum, "sha256": of every tensor's bytes in name order}."""
    import torch

    out = {}
    for name in trainer.learner.policy_names():
        weights, _ = trainer.learner.state(name)
        h = hashlib.sha256()
        sums = {}
        for k in sorted(weights):
            t = weights[k].detach().to("cpu").contiguous()
            sums[k] = float(t.to(torch.float64).sum())
            h.update(k.encode())
            h.update(t.numpy().tobytes())
        out[name] = {"sums": sums, "sha256": h.hexdigest()}
    return out


def run_case(case: str, run_dir: Path, extra: list[str] = (), setup: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Train ``case`` for 3 steps in ``run_dir``; its metrics and weights digest (``setup`` sees the trainer first)."""
    from teamrl.core.config import load_config
    from teamrl.tasks import TASKS
    from teamrl.trainer.trainer import Trainer

    registered = "golden_team" in TASKS
    if not registered:
        TASKS["golden_team"] = golden_team()
    try:
        cfg = load_config(None, [*COMMON, *CASES[case], f"run.dir={run_dir}", f"name={case}", *extra])
        trainer = Trainer(cfg)
        if setup is not None:
            setup(trainer)
        records = trainer.train()
    finally:
        if not registered:
            del TASKS["golden_team"]
    return {"metrics": numeric_metrics(records), "weights": weights_digest(trainer)}


def same(a: Any, b: Any) -> bool:
    """Exact equality, NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {GOLDEN}")
    ap.add_argument("--commit", default="", help="the commit the code on PYTHONPATH was archived from (recorded)")
    ap.add_argument("--dir", default="/tmp/teamrl_sync_golden", help="run directory parent (emptied first)")
    args = ap.parse_args(argv)
    import shutil

    import teamrl.trainer.trainer as module

    shutil.rmtree(args.dir, ignore_errors=True)
    result: dict[str, Any] = {"code": module.__file__, "commit": args.commit}
    for case in CASES:
        result[case] = run_case(case, Path(args.dir))
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.write:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text + "\n")
        print(f"wrote {GOLDEN} from {module.__file__}")
    else:
        print(text)


if __name__ == "__main__":
    sys.exit(main())
