"""``teamrl``: the command line.

  teamrl train [CONFIG.yaml] [--resume] [key.sub=value ...]
  teamrl config [CONFIG.yaml] [key.sub=value ...]   # validate and print the resolved config
  teamrl eval [CONFIG.yaml] [--checkpoint RUN_DIR] [--method team,single,...] [--limit N] [key.sub=value ...]
  teamrl report RUN_DIR                              # PNG plots + report.md in RUN_DIR/report
  teamrl bench [--only a,b,c,d] [--steps N] ...      # side-by-side benchmarks -> bench/RESULTS.md (= make bench)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    config = None
    overrides = []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif config is None:
            config = a
        else:
            raise SystemExit(f"teamrl: unexpected argument {a!r} (expected CONFIG.yaml or key.sub=value)")
    return config, overrides


def _bench(argv: list[str]) -> int:
    """Run ``bench/anchors.py`` of this source tree (the benchmarks are not part of the installed package)."""
    import runpy

    script = Path(__file__).resolve().parents[1] / "bench" / "anchors.py"
    if not script.is_file():
        print(f"teamrl: bench needs a source checkout; {script} does not exist", file=sys.stderr)
        return 2
    return int(runpy.run_path(str(script), run_name="teamrl_bench")["main"](argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its options are the bench script's own
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="teamrl", description="Train teams of LLM agents with multi-agent RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a run (config file and/or key.sub=value overrides)")
    p_train.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    p_train.add_argument("args", nargs="*", help="CONFIG.yaml and key.sub=value overrides")
    p_cfg = sub.add_parser("config", help="validate a config and print it resolved")
    p_cfg.add_argument("args", nargs="*")
    p_eval = sub.add_parser("eval", help="trained team vs prompt baselines: normalised return, tokens/s, s/problem")
    p_eval.add_argument("--checkpoint", default=None, help="a run directory: its last checkpoint is the trained team")
    p_eval.add_argument("--method", default=None, help="comma-separated subset of team,single,concat,sequential,discussion")
    p_eval.add_argument("--limit", type=int, default=20, help="number of evaluation problems (default 20)")
    p_eval.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p_eval.add_argument("args", nargs="*")
    p_report = sub.add_parser("report", help="plots and a summary page of a run directory")
    p_report.add_argument("run_dir")
    sub.add_parser("bench", help="benchmarks vs CoMLRL, TRL and model.generate -> bench/RESULTS.md (options: teamrl bench --help)")
    ns = parser.parse_args(argv)
    if ns.command == "report":
        from teamrl.trainer.report import write_report

        try:
            path = write_report(ns.run_dir)
        except (FileNotFoundError, ValueError) as e:
            print(f"teamrl: {e}", file=sys.stderr)
            return 2
        print(f"report: {path}")
        return 0

    from teamrl.core.config import ConfigError, config_to_dict, load_config

    try:
        config, overrides = _split(ns.args)
        if config is None and getattr(ns, "checkpoint", None):
            config = str(Path(ns.checkpoint) / "config.yaml")  # evaluate a run with its own config
        cfg = load_config(config, overrides)
    except ConfigError as e:
        print(f"teamrl: config error: {e}", file=sys.stderr)
        return 2
    if ns.command == "config":
        import yaml

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    if ns.command == "eval":
        return _eval(cfg, ns)
    from teamrl.trainer.trainer import RunExists, Trainer

    try:
        trainer = Trainer(cfg, resume=ns.resume)
    except (RunExists, ConfigError) as e:
        print(f"teamrl: {e}", file=sys.stderr)
        return 2
    metrics = trainer.train()
    key = "normalised_return" if "normalised_return" in metrics[-1] else "reward_mean"
    label = "normalised return" if key == "normalised_return" else "reward"
    values = [m[key] for m in metrics]
    k = min(3, len(values))
    first, last = sum(values[:k]) / k, sum(values[-k:]) / k
    secs = sum(m["rollout_s"] + m["update_s"] for m in metrics) / len(metrics)
    print(f"mean {label}, first {k} steps: {first:.3f}")
    print(f"mean {label}, last {k} steps:  {last:.3f}")
    print(f"seconds per step: {secs:.1f}")
    print(f"run directory: {trainer.run_dir}")
    return 0


def _eval(cfg, ns) -> int:
    from teamrl.core.config import ConfigError
    from teamrl.tasks import make_task
    from teamrl.tasks.task import Task
    from teamrl.trainer.evaluate import evaluate, format_table

    try:
        if ns.method:
            methods = [m.strip() for m in ns.method.split(",") if m.strip()]
        else:
            from teamrl.tasks.environment import Environment

            task = make_task(cfg.task)
            if isinstance(task, Environment):
                methods = ["untrained", "single"] + (["team", "swapped"] if ns.checkpoint else [])
            else:
                methods = ["single"] if isinstance(task, Task) else ["single", "concat", "sequential", "discussion"]
                if ns.checkpoint:
                    methods = ["team", *methods]
        rows = evaluate(cfg, methods, checkpoint=Path(ns.checkpoint) if ns.checkpoint else None, limit=ns.limit,
                        temperature=ns.temperature)
    except (ConfigError, FileNotFoundError) as e:
        print(f"teamrl: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
