"""``teamrl``: the command line.

  teamrl train [CONFIG.yaml] [--resume] [key.sub=value ...]
  teamrl config [CONFIG.yaml] [key.sub=value ...]   # validate and print the resolved config
"""

from __future__ import annotations

import argparse
import sys


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="teamrl", description="Train teams of LLM agents with multi-agent RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a run (config file and/or key.sub=value overrides)")
    p_train.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    p_train.add_argument("args", nargs="*", help="CONFIG.yaml and key.sub=value overrides")
    p_cfg = sub.add_parser("config", help="validate a config and print it resolved")
    p_cfg.add_argument("args", nargs="*")
    ns = parser.parse_args(argv)

    from teamrl.core.config import ConfigError, config_to_dict, load_config

    try:
        cfg = load_config(*_split(ns.args))
    except ConfigError as e:
        print(f"teamrl: config error: {e}", file=sys.stderr)
        return 2
    if ns.command == "config":
        import yaml

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    from teamrl.trainer.trainer import RunExists, Trainer

    try:
        trainer = Trainer(cfg, resume=ns.resume)
    except (RunExists, ConfigError) as e:
        print(f"teamrl: {e}", file=sys.stderr)
        return 2
    metrics = trainer.train()
    rewards = [m["reward_mean"] for m in metrics]
    k = min(3, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"mean reward, first {k} steps: {first:.3f}")
    print(f"mean reward, last {k} steps:  {last:.3f}")
    print(f"run directory: {trainer.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
