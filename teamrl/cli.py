"""``teamrl``: the command line.

  teamrl train [CONFIG.yaml] [--resume | --resume-intact] [--plugin FILE.py ...] [key.sub=value ...]
  teamrl config [CONFIG.yaml] [--plugin FILE.py ...] [key.sub=value ...]   # validate and print the resolved config
  teamrl eval [CONFIG.yaml] [--checkpoint RUN_DIR] [--baseline RUN_OR_CHECKPOINT] [--method team,single,...]
              [--limit N] [--out DIR] [key.sub=value ...]
  teamrl sft [CONFIG.yaml] [--data DEMOS.jsonl] [--epochs N] [key.sub=value ...]   # warm start, then train --resume
  teamrl sft CONFIG.yaml --self-play N [--min-reward R] [--rounds K] [--player mod:fn] | --from-episodes PATH
  teamrl calibrate [CONFIG.yaml] [--checkpoint RUN_DIR] [--set KEY=V1,V2 ...] [--level 'K=V K2=V2' ...]
                   [key.sub=value ...]   # why groups' rewards do not vary, and the settings where they do
  teamrl report RUN_DIR                              # RUN_DIR/report/index.html (+ PNG plots, report.md)
  teamrl study STUDY.yaml [--table]                  # a workflow x policy x task x model x seed grid -> study.md
  teamrl serve --model NAME [--port 8000] [--lora NAME=PATH ...]   # OpenAI-compatible completions server
  teamrl bench [--only a,b,c,d] [--steps N] ...      # side-by-side benchmarks -> bench/RESULTS.md (= make bench)
  teamrl bench --learning [--quick] [--seeds N] ...  # the learning benchmark -> bench/LEARNING.md (= make learn)

``--plugin FILE.py`` (repeatable; train, config, eval, sft, calibrate) imports a file that registers your own
tasks, workflows or rewards (see docs/extending.md) before the config is read.

Bad input (a config, a data file, a model name, what a task's reward returned, a plugin or workflow
of yours that fails, a run directory that cannot be written, a checkpoint that does not read whole)
ends in one line on stderr and exit code 2 (``TEAMRL_TRACEBACK=1``: the traceback before it); any
other error is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    config = None
    overrides = []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif config is None:
            config = a
        else:
            from teamrl.core.config import ConfigError

            raise ConfigError(f"unexpected argument {a!r}: expected one CONFIG.yaml, then key.sub=value overrides")
    return config, overrides


def _take_plugins(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the ``--plugin FILE`` values, the other arguments): argparse cannot take an option between
    the positional CONFIG.yaml and the key=value overrides, so they are taken out first."""
    plugins, rest = [], []
    it = iter(argv)
    for a in it:
        if a == "--plugin":
            value = next(it, None)
            if value is None:
                raise SystemExit("teamrl: --plugin needs a FILE.py")
            plugins.append(value)
        elif a.startswith("--plugin="):
            plugins.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    return plugins, rest


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage is one ``--help`` away), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def _config_bounds(dotted: str) -> dict:
    """The bounds (``ge``, ``gt``, ``le``) of the config key ``dotted`` (e.g. ``train.lr``), for a flag that means
    the same."""
    import dataclasses
    import typing

    from teamrl.core.config import Config

    cls, f = Config, None
    for part in dotted.split("."):
        f = {x.name: x for x in dataclasses.fields(cls)}[part]
        cls = typing.get_type_hints(cls)[part]
    return {k: f.metadata[k] for k in ("ge", "gt", "le") if f.metadata.get(k) is not None}


def _number(kind: type, like: str = "", **bounds: float):
    """An argparse ``type``: an ``int`` or a finite ``float`` within ``bounds`` (or those of config key ``like``);
    out of them, argparse's one-line error names the flag, the value and what is accepted."""
    bounds = {**(_config_bounds(like) if like else {}), **bounds}

    def parse(text: str):
        import math
        import operator

        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
        for bound, ok, word in (("ge", operator.ge, ">="), ("gt", operator.gt, ">"), ("le", operator.le, "<=")):
            if bound in bounds and not ok(value, bounds[bound]):
                same = f" (as {like})" if like else ""
                raise argparse.ArgumentTypeError(f"{text} is out of range; must be {word} {bounds[bound]}{same}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


def _bench(argv: list[str]) -> int:
    """Run ``bench/anchors.py`` (or, with ``--learning``, ``bench/learning.py``) of this source tree
    (the benchmarks are not part of the installed package)."""
    import runpy

    learning = "--learning" in argv
    argv = [a for a in argv if a != "--learning"]
    script = Path(__file__).resolve().parents[1] / "bench" / ("learning.py" if learning else "anchors.py")
    if not script.is_file():
        print(f"teamrl: bench needs a source checkout; {script} does not exist", file=sys.stderr)
        return 2
    return int(runpy.run_path(str(script), run_name="teamrl_bench")["main"](argv) or 0)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, as Ctrl-C's KeyboardInterrupt is: every ``finally`` runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the command as Ctrl-C does (in the main thread only: elsewhere signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Terminated(signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: list[str] | None = None) -> int:
    """Run ``teamrl`` with ``argv`` (default: the process's arguments); returns the exit code."""
    from teamrl.core.config import ConfigError, InputError

    try:
        with _sigterm_as_interrupt():
            return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: what was saved stays, a half-written checkpoint does not
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        print(
            f"teamrl: interrupted ({signal.Signals(signum).name}); checkpoints already written are kept: "
            "a training run continues with the same command and --resume",
            file=sys.stderr,
        )
        return 128 + signum
    except InputError as e:  # only the user's input: anything else is a bug and keeps its traceback
        if os.environ.get("TEAMRL_TRACEBACK", "") not in ("", "0"):
            import traceback

            traceback.print_exc()  # the user's own code's traceback is chained to the one line (raise ... from)
        kind = "config error: " if isinstance(e, ConfigError) else ""
        print(f"teamrl: {kind}{' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or folder the input names that cannot be read or written: name it
        if e.filename is None:
            raise
        if os.environ.get("TEAMRL_TRACEBACK", "") not in ("", "0"):
            import traceback

            traceback.print_exc()
        files = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
        print(f"teamrl: {files}: {e.strerror or type(e).__name__} ([Errno {e.errno}]); check the path and its "
              "permissions (TEAMRL_TRACEBACK=1 shows where it was used)", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:  # its options are the bench script's own
        return _bench(argv[1:])
    parser = _Parser(prog="teamrl", description="Train teams of LLM agents with multi-agent RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a run (config file and/or key.sub=value overrides)")
    p_train.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint (refused, "
                         "naming the file, when that checkpoint does not read whole)")
    p_train.add_argument("--resume-intact", action="store_true", help="continue from the newest checkpoint that reads "
                         "whole; unreadable newer ones are moved aside to checkpoints/unreadable_step_N")
    p_train.add_argument("args", nargs="*", help="CONFIG.yaml and key.sub=value overrides")
    p_cfg = sub.add_parser("config", help="validate a config and print it resolved")
    p_cfg.add_argument("args", nargs="*")
    p_eval = sub.add_parser(
        "eval", help="trained vs untrained team and prompt baselines: normalised return, validity, tokens/s"
    )
    p_eval.add_argument("--checkpoint", default=None, help="a run directory (its last checkpoint is the trained team) "
                        "or a checkpoint folder (RUN_DIR/checkpoints/step_N, RUN_DIR/best/step_N)")
    p_eval.add_argument("--baseline", default=None, metavar="RUN_OR_CHECKPOINT", help="compare the trained team with "
                        "this run's last checkpoint or this checkpoint folder (the baseline row), paired over the same "
                        "problems")
    p_eval.add_argument(
        "--method",
        default=None,
        help="comma-separated subset of team,warm_start,baseline,untrained,single,concat,sequential,discussion,"
        "swapped: those the run's workflow takes (default: team with --checkpoint, warm_start for a warm-started run, "
        "baseline with --baseline, untrained and the workflow's baselines)",
    )
    p_eval.add_argument(
        "--limit", type=_number(int, ge=1), default=None,
        help="score only the first N evaluation problems (default: all of them)",
    )
    p_eval.add_argument(
        "--temperature",
        type=_number(float, "rollout.temperature"),
        default=0.0,
        help="sampling temperature (default 0: greedy)",
    )
    p_eval.add_argument("--out", default=None, metavar="DIR", help="where results.json and the per-method episodes go "
                        "(default: RUN_DIR/eval/<timestamp> with --checkpoint, else run.dir/eval-<timestamp>)")
    p_eval.add_argument("args", nargs="*")
    p_sft = sub.add_parser(
        "sft",
        help="warm start: fine-tune each role's policy on demonstrations (a JSONL, or the task's "
        "own solver) and save them as the run's step-0 checkpoint; then teamrl train --resume",
    )
    p_sft.add_argument("--data", default=None, help="JSONL of {role, messages, completion} rows (default: the task's "
                                                     "demonstrations(problem) on its training problems)")
    p_sft.add_argument(
        "--problems",
        type=_number(int, ge=1),
        default=64,
        help="training problems to take task demonstrations from (default 64)",
    )
    p_sft.add_argument(
        "--as-role", default=None, help="train this role's policy on every demonstration, whatever role it names"
    )
    p_sft.add_argument(
        "--epochs", type=_number(int, ge=1), default=3, help="passes over the demonstrations (default 3)"
    )
    p_sft.add_argument(
        "--batch-size", type=_number(int, ge=1), default=8, help="demonstrations per optimizer step (default 8)"
    )
    p_sft.add_argument("--lr", type=_number(float, "train.lr"), default=None, help="learning rate (default train.lr)")
    # warm starts from the team's own successes (teamrl/trainer/self_play.py)
    p_sft.add_argument("--self-play", type=_number(int, ge=1), default=None, metavar="N", help="sample the team N "
                       "times per training problem and train on the episodes that reach --min-reward")
    p_sft.add_argument("--from-episodes", default=None, metavar="PATH", help="train on the episodes at PATH that reach "
                       "--min-reward: a run directory (its episodes/ logs) or an eval / calibrate output directory")
    p_sft.add_argument("--min-reward", type=_number(float), default=1.0, help="keep the episodes whose normalised "
                       "reward (team return / the task's max reward) is at least this (default 1.0: full success)")
    p_sft.add_argument("--temperature", type=_number(float, "rollout.temperature"), default=1.0,
                       help="--self-play sampling temperature (default 1.0)")
    p_sft.add_argument("--rounds", type=_number(int, ge=1), default=1, help="--self-play: sample -> keep -> train this "
                       "many times, each round sampling from the last round's weights (default 1)")
    p_sft.add_argument("--player", default=None, metavar="MODULE:FUNCTION", help="--self-play: a function (role, "
                       "messages) -> str (or FILE.py:function) that writes the replies instead of the model")
    p_sft.add_argument("--player-roles", default=None, metavar="A,B", help="the roles --player answers (default all)")
    p_sft.add_argument("args", nargs="*", help="CONFIG.yaml and key.sub=value overrides (the RL run's own)")
    p_cal = sub.add_parser("calibrate", help="sample a few training problems in groups at a few settings: why rewards "
                           "do not vary within groups (no learning signal), and the settings where they do")
    p_cal.add_argument("--checkpoint", default=None, help="a run directory: its last checkpoint is sampled (e.g. a "
                       "warm start), and its config.yaml is the config when none is given")
    p_cal.add_argument("--problems", type=_number(int, ge=1), default=8, help="training problems (default 8)")
    p_cal.add_argument("--group-size", type=_number(int, ge=2), default=None,
                       help="episodes per problem (default rollout.group_size, or 4 where that is 1)")
    p_cal.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2", dest="sweeps",
                       help="sweep a task., rollout. or workflow. key over these values (repeatable; '|' separates "
                            "values that hold commas); rollout.temperature and rollout.max_new_tokens default to the "
                            "config's and a higher one")
    p_cal.add_argument("--level", action="append", default=[], metavar="'KEY=V KEY2=V2'", dest="levels",
                       help="one setting of several overrides, e.g. a task's difficulty level (repeatable)")
    p_cal.add_argument("--out", default=None, metavar="DIR",
                       help="where calibration.json and the episodes go (default run.dir/NAME/calibrate/<timestamp>)")
    p_cal.add_argument("args", nargs="*", help="CONFIG.yaml and key.sub=value overrides (the run's own)")
    p_report = sub.add_parser(
        "report", help="RUN_DIR/report/index.html: curves, the latest eval, transcripts (+ PNG plots, report.md)"
    )
    p_report.add_argument("run_dir")
    p_study = sub.add_parser("study", help="run a workflow-study grid cell by cell (resumable) and write its table")
    p_study.add_argument("study_config")
    p_study.add_argument("--table", action="store_true", help="only rewrite the table from the finished cells")
    p_serve = sub.add_parser(
        "serve", help="serve the engine behind an OpenAI-compatible completions endpoint (vLLM protocol)"
    )
    p_serve.add_argument(
        "--model", default="smollm2-135m", help="base model: alias, local folder or hub id (default smollm2-135m)"
    )
    p_serve.add_argument(
        "--served-model-name", default=None, help="the base model's name in requests (default: --model)"
    )
    p_serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p_serve.add_argument(
        "--port", type=_number(int, ge=0, le=65535), default=8000, help="port (default 8000; 0 picks a free one)"
    )
    p_serve.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="load a PEFT adapter folder at start (repeatable)",
    )
    p_serve.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda or cuda:N")
    p_serve.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")
    p_serve.add_argument(
        "--seed",
        type=_number(int, "seed"),
        default=0,
        help="initialisation seed of random models (tiny-random); match training's seed",
    )
    p_serve.add_argument(
        "--threads", type=_number(int, "threads"), default=0, help="torch CPU threads; 0 keeps torch's default"
    )
    p_serve.add_argument("--ready-file", default=None, help="write the server's URL to this file once it listens")
    p_serve.add_argument("--verbose", action="store_true", help="log every request")
    p_serve.add_argument(
        "--max-n", type=int, default=1024, help="most completions per prompt of one request (400 above)"
    )
    p_serve.add_argument("--max-sequences", type=int, default=8192,
                         help="most sequences (prompts x n) of one request, which runs as one batch (400 above)")
    p_serve.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections held at once (at most half the open-file limit); one over it closes the "
        "oldest that has sent no complete request",
    )
    p_serve.add_argument("--api-key", default=os.environ.get("TEAMRL_API_KEY", ""),
                         help="every request needs Authorization: Bearer KEY (default: $TEAMRL_API_KEY; unset: none)")
    p_serve.add_argument("--allowed-path", action="append", default=[], metavar="DIR",
                         help="a folder POST /v1/load_lora_adapter and /collective_rpc may load from (repeatable; "
                              "none given: no path is loaded over HTTP, --lora at start still is)")
    p_serve.add_argument("--min-body-rate", type=_number(float, gt=0), default=1024.0, metavar="BYTES_PER_S",
                         help="when the server is at --max-connections, a request body arriving slower than this "
                              "gives way to a new connection (default 1024)")
    p_serve.add_argument("--strict", choices=("vllm", "sglang"), default=None,
                         help="imitate vLLM 0.33.0 or SGLang 0.5.23 where they differ from teamrl (per-prompt seeds, "
                              "generation_config defaults, raw log-probs, real LoRA paths); for testing clients")
    p_serve.add_argument(
        "--logprobs-mode",
        choices=("raw_logprobs", "processed_logprobs"),
        default="raw_logprobs",
        help="with --strict: which log-probs are returned (vLLM's --logprobs-mode; default raw_logprobs)",
    )
    p_serve.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="with --strict: sampling defaults as generation_config.json would set them, "
        'e.g. \'{"repetition_penalty": 1.1}\'',
    )
    for p in (p_train, p_cfg, p_eval, p_sft, p_cal):
        p.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                       help="import a Python file that registers tasks, workflows or rewards (repeatable)")
    sub.add_parser(
        "bench", help="benchmarks vs CoMLRL, TRL and model.generate -> bench/RESULTS.md (options: teamrl bench --help)"
    )
    plugins, argv = _take_plugins(argv)
    ns, unknown = parser.parse_known_args(argv)
    # argparse stops taking positionals after an option: key=value overrides after one are still overrides
    if unknown and hasattr(ns, "args") and all("=" in a and not a.startswith("-") for a in unknown):
        ns.args += unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if plugins and ns.command not in ("train", "config", "eval", "sft", "calibrate"):
        raise SystemExit(f"teamrl {ns.command}: --plugin is taken by train, config, eval, sft and calibrate")
    if ns.command in ("train", "eval", "study") and os.environ.get("TEAMRL_LOW_MEMORY", "") not in ("", "0"):
        from teamrl.core.memory import return_freed_memory_to_os

        # RSS follows the activations in use, not their high-water mark, at the cost of a page fault per
        # fresh page (the demo: ~24% lower peak RSS, ~7x the kernel time), hence opt-in
        return_freed_memory_to_os()
    if ns.command == "serve":
        return _serve(ns)
    if ns.command == "study":
        from teamrl.core.config import ConfigError
        from teamrl.trainer.study import load_study, run_study

        try:
            path = run_study(load_study(ns.study_config), only_table=ns.table)
        except ConfigError as e:
            print(f"teamrl: config error: {e}", file=sys.stderr)
            return 2
        print(path.read_text())
        print(f"study table: {path}")
        return 0
    if ns.command == "report":
        from teamrl.trainer.report import write_report

        try:
            path = write_report(ns.run_dir)
        except (FileNotFoundError, ValueError) as e:
            print(f"teamrl: {e}", file=sys.stderr)
            return 2
        print(f"report: {path} (one file, opens offline; PNG plots and report.md beside it)")
        return 0

    from teamrl.core.config import ConfigError, config_to_dict, load_config
    from teamrl.core.registry import load_plugin

    for plugin in plugins:  # before the config: its names must be registered when they are looked up
        load_plugin(plugin)
    try:
        config, overrides = _split(ns.args)
        if config is None and getattr(ns, "checkpoint", None):
            from teamrl.trainer.checkpoint import resolve_checkpoint

            # evaluate a run (or one of its checkpoints) with the run's own config
            config = str(resolve_checkpoint(Path(ns.checkpoint), "--checkpoint")[0] / "config.yaml")
        cfg = load_config(config, overrides)
    except ConfigError as e:
        print(f"teamrl: config error: {e}", file=sys.stderr)
        return 2
    if ns.command == "config":
        import yaml

        from teamrl.algorithms import make_algorithm
        from teamrl.tasks import make_task

        from teamrl.trainer.trainer import check_policy_roles

        task = make_task(cfg.task)
        algorithm = make_algorithm(cfg, task)  # the task's and workflow's own names and options, as train checks them
        check_policy_roles(cfg, task, algorithm)
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    if ns.command == "eval":
        return _eval(cfg, ns, argv)
    if ns.command == "sft":
        return _sft(cfg, ns)
    if ns.command == "calibrate":
        return _calibrate(cfg, config, overrides, ns, argv)
    from teamrl.rollout.completions_api import ServerError
    from teamrl.trainer.learner import WorkerFailed
    from teamrl.trainer.trainer import RunExists, make_trainer
    from teamrl.trainer.update import NonFiniteReward

    try:
        trainer = make_trainer(cfg, resume=ns.resume, resume_intact=ns.resume_intact)
    # a ConfigError (bad task options or data, a model name) goes to main; ServerError: the start-up check refused
    except (RunExists, WorkerFailed, ServerError) as e:
        print(f"teamrl: {e}", file=sys.stderr)
        return 2
    try:
        everything = trainer.train()
    # ServerError: a sync check failed, or the server went away
    except (WorkerFailed, NonFiniteReward, ServerError) as e:
        print(f"teamrl: {e}", file=sys.stderr)
        return 1
    from teamrl.core.metrics import accuracy_summary, training_records

    metrics = training_records(everything)
    key = "normalised_return" if "normalised_return" in metrics[-1] else "reward_mean"
    label = "normalised return" if key == "normalised_return" else "reward"
    # a step whose turn-0 groups were all dropped has no normalised_return; a non-finite one is logged as null
    values = [m[key] for m in metrics if m.get(key) is not None]
    left_out = sum(1 for m in metrics if key in m and m[key] is None)
    k = min(3, len(values))
    first, last = (sum(values[:k]) / k, sum(values[-k:]) / k) if k else (math.nan, math.nan)
    # the asynchronous loop's rollouts overlap the updates: a step costs its update and the wait for its rollout
    secs = sum(m["update_s"] + (m["async/trainer_wait_s"] if "async/trainer_wait_s" in m else m["rollout_s"])
               for m in metrics) / len(metrics)
    print(f"mean {label}, first {k} steps: {first:.3f}")
    print(f"mean {label}, last {k} steps:  {last:.3f}" +
          (f" ({left_out} step{'s' * (left_out != 1)} without a finite value left out)" if left_out else ""))
    print(f"seconds per step: {secs:.1f}")
    from teamrl.trainer.diagnostics import signal_summary

    no_signal = signal_summary(metrics)  # a run whose groups never varied learned nothing from its rewards: say so
    if no_signal:
        print(no_signal)
        if no_signal.startswith("no learning signal"):
            plugin_args = "".join(f" --plugin {p}" for p in plugins)
            print(f"why, and what to change: teamrl calibrate --checkpoint {trainer.run_dir}{plugin_args}")
    acc = accuracy_summary(everything)
    if acc:
        first = "first (the warm start)" if trainer.warm_start is not None else "first"
        print(f"held-out accuracy: {first} {acc['untrained']:.3f}, peak {acc['peak']:.3f} (step {acc['peak_step']}), "
              f"final {acc['final']:.3f}")
    if trainer.warm_start is not None:
        from teamrl.trainer.checkpoint import describe_warm_start

        print(describe_warm_start(trainer.warm_start, trainer.run_dir))
    best = trainer.best_checkpoint_line()  # with a warm start only: the step RL may not have beaten
    if best and not cfg.train.final_eval_problems:
        print(best)
    if cfg.train.final_eval_problems:
        _final_eval(cfg, trainer.run_dir, argv)
        if best:
            print(best)
    print(f"run directory: {trainer.run_dir}")
    return 0


def _final_eval(cfg, run_dir: Path, argv: list[str]) -> None:
    """Untrained vs trained team (and the warm start, where RL started from one), greedy, on held-out problems,
    with the paired comparisons."""
    from teamrl.trainer.evaluate import (eval_output_dir, evaluate, format_table, held_out_config,
                                         warm_start_to_compare, write_results)

    held_out, where = held_out_config(cfg)
    warm = warm_start_to_compare(run_dir) is not None
    methods = ["untrained", *(["warm_start"] if warm else []), "team"]
    rows = evaluate(held_out, methods, checkpoint=run_dir, limit=cfg.train.final_eval_problems, progress=False,
                    limit_name="train.final_eval_problems")
    print(f"untrained vs {'warm start vs ' if warm else ''}trained team, greedy, on {rows[0].problems} {where}:")
    print(format_table(rows))
    out = write_results(rows, eval_output_dir(run_dir, held_out), held_out, ["teamrl", *argv],
                        checkpoint=run_dir, limit=cfg.train.final_eval_problems)
    print(f"eval results and episodes: {out}")


def _check_writable_file(probe: Path, flag: str, path: Path) -> None:
    """Refuse ``flag path`` now, not after the work, when ``probe`` (the file it writes first) cannot be written."""
    from teamrl.core.config import InputError

    if path.is_dir():
        raise InputError(f"{flag} {path}: is a folder; give a file path in a writable folder")
    existed = probe.exists()
    try:
        with open(probe, "a"):
            pass
        if not existed:
            probe.unlink()
    except OSError as e:
        raise InputError(
            f"{flag} {path}: cannot be written ({e.strerror}); give a file path in a writable folder"
        ) from None


def _check_out_dir(out: Path, flag: str) -> None:
    """Refuse ``flag out`` before the work when it cannot become a folder of results (a file, under a file, not
    writable)."""
    from teamrl.core.config import InputError

    probe = out
    while not probe.exists() and probe.parent != probe:  # the nearest path that exists
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(
            f"{flag} {out}: {probe} is a file, not a folder; give a folder (existing or new) for the results"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {out}: {probe} is not writable; give a folder this user can write")


def _serve(ns) -> int:
    from teamrl.rollout.server import ModelServer, RequestError, serve

    loras = []
    for item in ns.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            print(f"teamrl: --lora {item!r}: expected NAME=PATH (a PEFT adapter folder)", file=sys.stderr)
            return 2
        loras.append((name, path))
    from teamrl.rollout.asgi import listening_socket

    listening_socket(ns.host, ns.port, "--host", "--port").close()  # before the model loads: an address it cannot use
    if ns.ready_file:
        _check_writable_file(Path(ns.ready_file).with_suffix(".tmp"), "--ready-file", Path(ns.ready_file))
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    strict = None
    try:
        if ns.strict:
            from teamrl.rollout.strict_server import StrictBehaviour

            overrides = json.loads(ns.override_generation_config) if ns.override_generation_config else {}
            if not isinstance(overrides, dict):
                raise ValueError(
                    f"--override-generation-config: expected a JSON object, got {ns.override_generation_config!r}"
                )
            strict = StrictBehaviour(ns.strict, ns.logprobs_mode, max_stop_strings=4 if ns.strict == "vllm" else None,
                                     generation_defaults=overrides)
        elif ns.override_generation_config or ns.logprobs_mode != "raw_logprobs":
            raise ValueError("--override-generation-config and --logprobs-mode need --strict vllm|sglang")
        ms = ModelServer(ns.model, served_name=ns.served_model_name, device=ns.device, dtype=ns.dtype, seed=ns.seed,
                         strict=strict, max_n=ns.max_n, max_sequences=ns.max_sequences)
        if ns.max_connections < 8:
            raise ValueError(f"--max-connections {ns.max_connections}: must be >= 8")
        for name, path in loras:
            ms.load_adapter(name, path)
    except (ValueError, RuntimeError) as e:  # ModelNotFound, bad device/dtype, no GPU
        print(f"teamrl: {e}", file=sys.stderr)
        return 2
    except RequestError as e:
        print(f"teamrl: --lora: {e.message}", file=sys.stderr)
        return 2
    serve(ms, ns.host, ns.port, ready_file=ns.ready_file, verbose=ns.verbose, max_connections=ns.max_connections,
          min_body_rate=ns.min_body_rate, api_key=ns.api_key, allowed_paths=ns.allowed_path)
    return 0


def _sft(cfg, ns) -> int:
    from dataclasses import replace

    from teamrl.tasks import make_task
    from teamrl.trainer.sft import load_demonstrations, run_demonstrations, warm_start

    if ns.self_play or ns.from_episodes:
        return _sft_from_successes(cfg, ns)
    if ns.player or ns.player_roles:
        from teamrl.core.config import ConfigError

        raise ConfigError("sft: --player and --player-roles go with --self-play N")
    if ns.data:
        demos = load_demonstrations(ns.data)
    else:
        task = make_task(cfg.task)
        demos = run_demonstrations(cfg, task, task.problems()[:ns.problems])
    if ns.as_role:
        demos = [replace(d, role=ns.as_role) for d in demos]
    source = (f"--data {ns.data}" if ns.data else f"the demonstrations of the first {ns.problems} training problems "
              f"of task {cfg.task.get('name')}" + (f" (workflow {cfg.workflow.name})" if cfg.workflow.name else ""))
    if ns.as_role:
        source += f", as role {ns.as_role}"
    run_dir, records = warm_start(cfg, demos, epochs=ns.epochs, batch_size=ns.batch_size, lr=ns.lr,
                                  progress=cfg.run.progress, source=source)
    for name in dict.fromkeys(r["policy"] for r in records):
        own = [r["loss"] for r in records if r["policy"] == name]
        print(
            f"policy {name}: demonstration loss {own[0]:.3f} (first step) -> {own[-1]:.3f} (last step), "
            f"{len(own)} steps"
        )
    print(f"{len(demos)} demonstrations, warm start saved in {run_dir / 'checkpoints'} (and kept for comparisons in "
          f"{run_dir / 'warm_start'}); "
          f"continue with RL: teamrl train ... name={cfg.name} --resume")
    return 0


def _calibrate(cfg, config: str | None, overrides: list[str], ns, argv: list[str]) -> int:
    from teamrl.core.config import load_config
    from teamrl.trainer.calibrate import (calibrate_output_dir, format_report, measure, parse_level, parse_sweep,
                                          settings_grid, write_calibration)

    if ns.out:
        _check_out_dir(Path(ns.out), "--out")
    axes = [parse_sweep(text) for text in ns.sweeps] + ([[parse_level(t) for t in ns.levels]] if ns.levels else [])
    checkpoint = Path(ns.checkpoint) if ns.checkpoint else None
    cal = measure(lambda extra: load_config(config, [*overrides, *extra]), settings_grid(cfg, axes),
                  problems=ns.problems, group_size=ns.group_size, checkpoint=checkpoint, progress=cfg.run.progress)
    print(format_report(cal))
    out = write_calibration(cal, calibrate_output_dir(cfg, Path(ns.out) if ns.out else None), cfg, ["teamrl", *argv],
                            checkpoint=checkpoint)
    print(f"calibration: {out}/calibration.json; each setting's episodes: {out}/setting<N>.jsonl")
    return 0


def _sft_from_successes(cfg, ns) -> int:
    """``teamrl sft --self-play N`` or ``--from-episodes PATH``: a warm start from the team's own successes."""
    from teamrl.core.config import ConfigError
    from teamrl.trainer.self_play import format_summary, from_episodes, self_play
    from teamrl.workflows.player import load_player

    if ns.self_play and ns.from_episodes or ns.data or ns.as_role:
        raise ConfigError("sft: --self-play and --from-episodes take no --data / --as-role, nor each other")
    if ns.from_episodes:
        if ns.player or ns.player_roles or ns.rounds != 1:
            raise ConfigError("sft: --player, --player-roles and --rounds go with --self-play N")
        run_dir, keep, _ = from_episodes(cfg, ns.from_episodes, ns.min_reward, epochs=ns.epochs,
                                         batch_size=ns.batch_size, lr=ns.lr, progress=cfg.run.progress)
        rounds = [keep]
    else:
        player = load_player(ns.player) if ns.player else None
        roles = [r.strip() for r in ns.player_roles.split(",") if r.strip()] if ns.player_roles else None
        if roles and player is None:
            raise ConfigError("sft: --player-roles names the roles --player answers; give --player too")
        run_dir, rounds = self_play(cfg, ns.self_play, problems=ns.problems, temperature=ns.temperature,
                                    min_reward=ns.min_reward, rounds=ns.rounds, player=player, player_roles=roles,
                                    epochs=ns.epochs, batch_size=ns.batch_size, lr=ns.lr, progress=cfg.run.progress)
    print(format_summary(rounds))
    print(f"warm start saved in {run_dir / 'checkpoints'}; continue with RL: teamrl train ... name={cfg.name} --resume")
    return 0


def _eval(cfg, ns, argv: list[str]) -> int:
    from teamrl.core.config import ConfigError
    from teamrl.trainer.evaluate import (default_methods, eval_output_dir, evaluate, format_table,
                                         warm_start_to_compare, write_results)

    if ns.out:
        _check_out_dir(Path(ns.out), "--out")
    checkpoint = Path(ns.checkpoint) if ns.checkpoint else None
    try:
        if ns.method:
            methods = [m.strip() for m in ns.method.split(",") if m.strip()]
        else:  # the run's workflow, trained (and its warm start) and untrained, and the baselines declared for it
            methods = default_methods(cfg, has_checkpoint=checkpoint is not None,
                                      warm_start=warm_start_to_compare(checkpoint) is not None)
        if ns.baseline and "baseline" not in methods:
            methods.insert(1 if methods[:1] == ["team"] else 0, "baseline")
        rows = evaluate(cfg, methods, checkpoint=checkpoint, limit=ns.limit, temperature=ns.temperature,
                        baseline=Path(ns.baseline) if ns.baseline else None, progress=cfg.run.progress)
    except (ConfigError, FileNotFoundError) as e:
        print(f"teamrl: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    out = write_results(
        rows,
        eval_output_dir(checkpoint, cfg, Path(ns.out) if ns.out else None),
        cfg,
        ["teamrl", *argv],
        checkpoint=checkpoint,
        limit=ns.limit,
        temperature=ns.temperature,
    )
    print(f"eval results: {out}/results.json; each problem's episode per method: "
          + ", ".join(f"{out}/{r.method}.jsonl" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
