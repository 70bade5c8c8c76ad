"""Prove a refactor kept behaviour: train the same short runs from a base revision and from the working tree.

The base revision is checked out with ``git worktree add`` in a temporary folder (removed at the end). Each case
trains 3 steps on the tiny random model in both trees, each in its own subprocess (``PYTHONPATH=<tree>``, this
python, ``OMP_NUM_THREADS=1``, seed 0, its own run directory), and compares

- every key and value of every ``metrics.jsonl`` record, exactly, but for the timing keys (:data:`TIMING`), and
- every tensor of the final checkpoint's ``policy_*.pt`` and ``optimizer_*.pt`` (a sha256 of dtype, shape and bytes).

Cases: GRPO, MAGRPO (one LoRA adapter per role on one base), AT-GRPO, M-GRPO and the Voting workflow, each at
``rollout.max_staleness`` 0 and 1, each in-process (``rollout.engine=hf``) and through ``teamrl serve``
(``rollout.engine=http``; one server per tree, started from that tree's code on a free port, stopped after): 20.
The rewards of :data:`PLUGIN` (written to the temporary folder, the same file for both trees) vary on the random
model's text, so every case's weights move. A case refused by a tree's config (its command exits non-zero) is
``refused: <its last stderr line>``; refused alike in both trees counts as kept. Exit status 1 on any difference.

    python tools/compare_trees.py                          # base 241fba5 vs the working tree, 20 cases
    python tools/compare_trees.py --base HEAD~3 --only magrpo/k1
    python tools/compare_trees.py --base 241fba5 --tree /path/to/other/checkout   # any two trees
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOW = 3  # differences shown per case

# ---- the cases ---------------------------------------------------------------------------------------------------

COMMON = ["model=tiny-random", "seed=0", "threads=1", "policy.device=cpu", "policy.lora.r=4", "train.steps=3",
          "train.lr=1e-2", "rollout.max_new_tokens=8", "rollout.group_size=2", "rollout.batch_size=2",
          "train.eval_every=0", "train.final_eval_problems=0", "run.save_every=100", "run.progress=false",
          "run.tensorboard=false", "run.log_episodes=false"]
ALGORITHMS = {  # name -> overrides ("{tree}" is the tree's own folder: each tree trains its own shipped config)
    "grpo": ["{tree}/configs/grpo_word_count.yaml", "task.num_problems=8"],
    "magrpo": ["algorithm=magrpo", "task.name=ct_team", "policy.mode=lora_per_role", "magrpo.num_turns=2"],
    "at_grpo": ["algorithm=at_grpo", "task.name=ct_team", "policy.mode=lora_per_role"],
    "m_grpo": ["algorithm=m_grpo", "task.name=math.solve", "task.num_problems=8", "task.test_size=2",
               "workflow.name=ct_orch", "policy.mode=lora_per_role"],
    "voting": ["{tree}/configs/workflow_voting_math.yaml", "task.num_problems=8", "task.test_size=2",
               "workflow.reward=ct_parity"],
}
STALENESS = (0, 1)
ENGINES = ("hf", "http")


def cases() -> list[tuple[str, str, int, str]]:
    """(label, algorithm, max_staleness, engine) of every case."""
    return [(f"{a}/k{k}/{e}", a, k, e) for a in ALGORITHMS for k in STALENESS for e in ENGINES]


PLUGIN = '''"""compare_trees' plugin: rewards that vary on the tiny random model's text, so that the weights move."""
from dataclasses import dataclass

from teamrl.api import EpisodeOutcome, Problem, register_reward, register_task, register_workflow
from teamrl.tasks.task import TeamTask


def _h(text):
    return sum(map(ord, text))


@register_reward("ct_parity")
def ct_parity(sample, outcome):
    return (sum(sample.completion_ids) % 7) / 6


@dataclass
class CtTeamOptions:
    name: str = "ct_team"


@register_task("ct_team")
class CtTeam(TeamTask):
    """Two agents; the reward is how near their replies' lengths come to 10 and 20 characters."""
    name, roles, max_reward, Options = "ct_team", ("short", "long"), 2.0, CtTeamOptions

    def __init__(self, opts=None):
        self.opts = opts or CtTeamOptions()

    def problems(self):
        return [Problem(f"t{i}", {"i": i}) for i in range(4)]

    def prompt(self, problem, role, turn=0, history=(), feedback=""):
        prev = history[-1][role] if history else ""
        return [{"role": "user", "content": f"{role} {problem.data['i']} turn {turn} {prev[:8]} {feedback}"}]

    def reward(self, problem, outputs):
        return max(0.0, 1 - abs(len(outputs["short"]) - 10) / 10) + max(0.0, 1 - abs(len(outputs["long"]) - 20) / 20)

    def feedback(self, problem, outputs, reward):
        return f"score {reward:.1f}"


@register_workflow("ct_orch", roles=("orchestrator", "worker"), sub_roles=("worker",))
async def ct_orch(ctx, task, problem, settings):
    """A main agent and one or two nested workers; the team reward reads the texts' hashes."""
    plan = await ctx.generate("orchestrator", task.prompt(problem))
    parts = [await ctx.sub_episode("worker").generate("worker", f"do part {i} of: {plan[:20]}")
             for i in range(1 + _h(plan) % 2)]
    return EpisodeOutcome(parts[-1], None, False, team_reward=(_h(plan) + sum(map(_h, parts))) % 5 / 4)
'''

# ---- what is compared --------------------------------------------------------------------------------------------

TIMING = {  # rule -> test of a metrics key: these measure time, not the computation
    "contains 'timing/'": lambda k: "timing/" in k,
    "ends with '_s' (seconds or per second: rollout_s, update_s, rollout_tokens_per_s, async/weights_load_s)":
        lambda k: k.endswith("_s"),
    "async/ and contains 'wait'": lambda k: k.startswith("async/") and "wait" in k,
}


def timing(key: str) -> bool:
    return any(rule(key) for rule in TIMING.values())


def same(a, b) -> bool:
    """Exactly equal JSON values (NaN equals NaN; 1 and 1.0 differ: a type change is a change)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def compare_metrics(a: Path, b: Path) -> tuple[int, int, list[str]]:
    """(keys compared, steps, differences) of two metrics.jsonl files."""
    ra, rb = ([json.loads(line) for line in p.read_text().splitlines()] for p in (a, b))
    diffs = [f"metrics: {len(ra)} records vs {len(rb)}"] if len(ra) != len(rb) else []
    n = 0
    for x, y in zip(ra, rb):
        step = x.get("step")
        for k in sorted(set(x) | set(y)):
            if timing(k):
                continue
            n += 1
            if k not in x or k not in y:
                diffs.append(f"step {step} {k}: only in {'base' if k in x else 'tree'}")
            elif not same(x[k], y[k]):
                diffs.append(f"step {step} {k}: {x[k]!r} (base) vs {y[k]!r} (tree)")
    return n, len(ra), diffs


def tensors(obj, path: str = ""):
    """(path, tensor) of every tensor in a loaded checkpoint file, nested dicts and lists included."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}/{i}")


def checkpoint_digest(run_dir: Path) -> dict[str, str]:
    """``file/tensor path`` -> sha256 of dtype, shape and bytes, for the final checkpoint's weights and optimizer."""
    import torch

    steps = sorted((run_dir / "checkpoints").glob("step_*"))
    if not steps:
        return {}
    out = {}
    for f in sorted([*steps[-1].glob("policy_*.pt"), *steps[-1].glob("optimizer_*.pt")]):
        for path, t in tensors(torch.load(f, map_location="cpu", weights_only=True)):
            t = t.detach().contiguous()
            h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            out[f"{steps[-1].name}/{f.name}{path}"] = h.hexdigest()
    return out


def compare_weights(a: Path, b: Path) -> tuple[int, list[str]]:
    da, db = checkpoint_digest(a), checkpoint_digest(b)
    diffs = [f"tensor {k}: " + ("differs" if k in da and k in db else f"only in {'base' if k in da else 'tree'}")
             for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)]
    if not da and not db:
        diffs.append("no checkpoint in either run")
    return len(set(da) | set(db)), diffs


# ---- running a tree ----------------------------------------------------------------------------------------------

# Runs teamrl's CLI, then checks that every teamrl module came from the tree (teamrl is a namespace package: a module
# the tree lacks would otherwise be found in an installed checkout).
WRAPPER = """import sys
tree = sys.argv.pop(1)
from teamrl.cli import main
rc = main(sys.argv[1:])
strays = sorted(n for n, m in list(sys.modules.items()) if (n == "teamrl" or n.startswith("teamrl."))
                and getattr(m, "__file__", None) and not m.__file__.startswith(tree + "/"))
if strays:
    print(f"compare_trees: modules imported from outside {tree}: {strays[:5]}", file=sys.stderr)
    rc = 3
sys.exit(rc)
"""


def env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def teamrl(tree: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-c", WRAPPER, str(tree), *args]


class Server:
    """``teamrl serve`` of tiny-random from ``tree``'s code on a free port of 127.0.0.1."""

    def __init__(self, tree: Path, work: Path) -> None:
        ready = work / "url"
        self.log = open(work / "serve.log", "w")
        self.proc = subprocess.Popen(teamrl(tree, ["serve", "--model", "tiny-random", "--seed", "0", "--port", "0",
                                                   "--threads", "1", "--ready-file", str(ready)]),
                                     cwd=work, env=env(tree), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"teamrl serve of {tree} did not start: see {work / 'serve.log'}")
            time.sleep(0.1)
        self.url = ready.read_text().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def train(tree: Path, work: Path, plugin: Path, algorithm: str, k: int, engine: str, url: str | None) -> tuple[Path, str | None]:
    """Train one case in ``tree``; (run directory, None) or (run directory, the refusal's last stderr line)."""
    args = [a.format(tree=tree) for a in ALGORITHMS[algorithm]]
    extra = [f"rollout.max_staleness={k}", f"rollout.engine={engine}"] + ([f"rollout.server_url={url}"] if url else [])
    work.mkdir(parents=True)
    done = subprocess.run(teamrl(tree, ["train", *args, "--plugin", str(plugin), *COMMON, *extra, f"run.dir={work}",
                                        "name=run"]), cwd=work, env=env(tree), capture_output=True, text=True, timeout=900)
    (work / "stderr.log").write_text(done.stderr)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return work / "run", (lines[-1] if lines else f"exit {done.returncode}")
    return work / "run", None


# ---- one case, the whole comparison ------------------------------------------------------------------------------


def compare_case(label: str, algorithm: str, k: int, engine: str, trees: dict, work: Path, plugin: Path,
                 urls: dict) -> tuple[str, int, int]:
    """(its report line(s), differences, 1 when refused alike in both trees)."""
    runs = {side: train(tree, work / label.replace("/", "-") / side, plugin, algorithm, k, engine, urls.get(side))
            for side, tree in trees.items()}
    (da, ea), (db, eb) = runs["base"], runs["tree"]
    if ea or eb:
        if ea == eb:
            return f"{label}: refused: {ea} (both trees)", 0, 1
        return f"{label}: 1 differences\n    base: {ea or 'trained'}\n    tree: {eb or 'trained'}", 1, 0
    n, steps, diffs = compare_metrics(da / "metrics.jsonl", db / "metrics.jsonl")
    t, wdiffs = compare_weights(da, db)
    diffs += wdiffs
    line = f"{label}: {n} keys compared over {steps} steps, {t} tensors compared, {len(diffs)} differences"
    return "\n    ".join([line, *diffs[:SHOW]] + ([f"... {len(diffs) - SHOW} more"] if len(diffs) > SHOW else [])), \
        len(diffs), 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="241fba5", help="the base git revision (default 241fba5)")
    p.add_argument("--tree", default=str(ROOT), help="the tree compared with it (default: this working tree)")
    p.add_argument("--only", default="", help="only the cases whose label (e.g. magrpo/k1/http) contains this")
    p.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (run directories, logs)")
    args = p.parse_args()
    selected = [c for c in cases() if args.only in c[0]]
    if not selected:
        p.error(f"--only {args.only!r} matches no case of {[c[0] for c in cases()]}")
    print("timing keys left out:", "; ".join(TIMING))
    work = Path(tempfile.mkdtemp(prefix="compare_trees-"))
    base = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(base), args.base], check=True)
    trees = {"base": base, "tree": Path(args.tree).resolve()}
    print(f"base {args.base} ({base}) vs {trees['tree']}; {len(selected)} cases; work in {work}")
    plugin = work / "compare_trees_plugin.py"
    plugin.write_text(PLUGIN)
    servers: dict[str, Server] = {}
    start = time.monotonic()
    try:
        if any(c[3] == "http" for c in selected):
            for side, tree in trees.items():
                (work / f"serve-{side}").mkdir()
                servers[side] = Server(tree, work / f"serve-{side}")
        for side in ("base", "tree"):
            servers.get(side) and print(f"teamrl serve ({side}): {servers[side].url}")
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            jobs = [pool.submit(compare_case, *c, trees, work, plugin,
                                {s: v.url for s, v in servers.items()} if c[3] == "http" else {}) for c in selected]
            results = []
            for job in jobs:  # in case order, each as it finishes
                results.append(job.result())
                print(results[-1][0], flush=True)
    finally:
        for s in servers.values():
            s.stop()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
        if not args.keep:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    diffs, refused = sum(r[1] for r in results), sum(r[2] for r in results)
    differing = sum(r[1] > 0 for r in results)
    print(f"total: {len(results)} cases, {len(results) - differing - refused} kept, {refused} refused alike in both "
          f"trees, {differing} with differences ({diffs} differences); {time.monotonic() - start:.0f} s")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
