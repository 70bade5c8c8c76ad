"""Warm starts from the team's own successes: rejection sampling and expert iteration (as STaR and RFT do).

``teamrl sft CONFIG --self-play N``: the run's workflow runs through the episode protocol (as ``teamrl eval``
runs it: :func:`~teamrl.workflows.episode.run_episode` on :class:`~teamrl.workflows.context.EpisodeContext`)
``N`` times per training problem at ``--temperature`` (default 1.0); the episodes whose team return over the
task's ``max_reward`` (the normalised reward ``teamrl eval`` scores) is at least ``--min-reward`` (default
1.0: full success) are kept, and each role's policy is fine-tuned on its own calls of the kept episodes: on
exactly the prompt and completion token ids the call's Sample recorded (the loss on the completion tokens,
:func:`~teamrl.trainer.sft.sft_step`). ``--rounds K`` repeats sample -> keep -> train K times, each round
sampling from the weights the previous round trained (expert iteration). ``--player module:function``
writes the replies instead of the model (:mod:`teamrl.workflows.player`).

``teamrl sft CONFIG --from-episodes PATH``: the same keep-and-train on episodes already on disk: a run's
training logs (``RUN_DIR/episodes/step_*.jsonl`` + ``outcomes_*.jsonl``) or a ``teamrl eval`` / ``teamrl
calibrate`` output (``<method>.jsonl`` records of :func:`~teamrl.trainer.evaluate.episode_record`). Both
logs hold each call's exact ``prompt_ids`` and ``completion_ids``; logs written before they did are
re-tokenised from the recorded rendered prompt (the same ids ``ctx.generate`` computed) and the recorded
completion text (+ EOS when it ended there), and the summary counts those calls.

The warm start is saved as ``teamrl sft`` saves one (checkpoint ``step_000000``, ``warm_start: True``), with
what it was trained on in its trainer state (``trained_on``: episodes sampled and kept, calls kept per role,
the reward threshold, the temperature, the rounds).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Hashable, Sequence

import torch

from teamrl.algorithms import configured_workflow_options
from teamrl.algorithms.episodes import workflow_options_or_defaults
from teamrl.core.config import Config, ConfigError, InputError, InputFileMissing
from teamrl.core.sample import Sample
from teamrl.core.seeding import derive_seed
from teamrl.policies.multi_lora import SharedBaseAdapters
from teamrl.policies.router import PolicyRouter
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks import Problem, make_task
from teamrl.trainer.evaluate import run_workflow
from teamrl.trainer.sft import TokenRow, fresh_run_dir, save_warm_start, sft_epochs, sft_router
from teamrl.workflows import WORKFLOWS
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.episode import run_episode
from teamrl.workflows.player import Player, PlayerContext, check_player_answered

PROBLEMS_PER_BATCH = 8  # problems sampled together (N episodes each) between two progress lines


@dataclass
class TeamEpisode:
    """One episode of the team: its problem, its normalised reward and its calls (Samples with their token ids)."""

    problem_id: Hashable
    reward: float  # team return / the task's max_reward
    samples: list[Sample]


@dataclass
class KeepRound:
    """What one round of sample (or read) -> keep -> train saw and trained."""

    round: int
    episodes: list[TeamEpisode]
    min_reward: float
    trained: dict[str, list[TokenRow]] = field(default_factory=dict)  # policy -> the (prompt, completion) ids trained
    records: list[dict[str, Any]] = field(default_factory=list)  # the SFT steps (sft.jsonl rows)

    @property
    def kept(self) -> list[TeamEpisode]:
        """The episodes whose normalised reward reached ``min_reward``."""
        return kept_episodes(self.episodes, self.min_reward)

    def summary(self) -> dict[str, Any]:
        """Episodes sampled and kept, the calls kept per role, the mean reward of all and of the kept ones."""
        kept = self.kept
        return {
            "round": self.round,
            "episodes": len(self.episodes),
            "kept": len(kept),
            "calls_kept": dict(Counter(s.role for e in kept for s in trainable_calls(e))),
            "mean_reward": mean([e.reward for e in self.episodes]),
            "mean_reward_kept": mean([e.reward for e in kept]),
            "best_reward": max((e.reward for e in self.episodes), default=None),
        }


def mean(values: Sequence[float]) -> float | None:
    """The mean, None for no values."""
    return sum(values) / len(values) if values else None


def kept_episodes(episodes: Sequence[TeamEpisode], min_reward: float) -> list[TeamEpisode]:
    """The episodes whose normalised reward is at least ``min_reward``."""
    return [e for e in episodes if e.reward >= min_reward]


def trainable_calls(episode: TeamEpisode) -> list[Sample]:
    """The calls of an episode a warm start trains: trainable, not a greedy baseline's, with a completion."""
    return [s for s in episode.samples if s.trainable and not s.baseline and s.completion_ids]


def training_rows(router: PolicyRouter, episodes: Sequence[TeamEpisode],
                  roles: Sequence[str] = ()) -> dict[str, list[TokenRow]]:
    """Each policy's (prompt ids, completion ids) rows: its own roles' calls of ``episodes``, as recorded
    (``roles``: the run's, named when a call's role is not one of them)."""
    rows: dict[str, list[TokenRow]] = {}
    for e in episodes:
        for s in trainable_calls(e):
            try:
                name = router.policy_name(s.role)
            except KeyError:
                raise InputError(f"sft: a kept call's role {s.role!r} (problem {e.problem_id!r}) is not a role of "
                                 f"this run; its roles are {list(roles)}") from None
            rows.setdefault(name, []).append((list(s.prompt_ids), list(s.completion_ids)))
    return rows


def sample_episodes(cfg: Config, router: PolicyRouter, task: Any, problems: Sequence[Problem], n: int,
                    temperature: float, seed: int, first_episode: int = 0, player: Player | None = None,
                    player_roles: Collection[str] | None = None) -> list[TeamEpisode]:
    """``n`` episodes of the run's workflow per problem, sampled together at ``temperature`` from ``router``'s
    current weights (``player`` answering ``player_roles``' calls: all roles when None); episode numbers from
    ``first_episode`` (they seed the workflow's ``ctx.rng``)."""
    run = run_workflow(cfg, task)
    spec = WORKFLOWS.get_entry(run.name, "workflow.name")
    settings = configured_workflow_options(cfg) if cfg.workflow.name else workflow_options_or_defaults(spec)
    engine = HFEngine(lambda name: router.policies[name].generation_model(), router.tokenizer, device=router.device,
                      row_models=SharedBaseAdapters(router.policies))
    params = SamplingParams.from_rollout(cfg.rollout, temperature=temperature, ignore_eos=False, min_new_tokens=0)
    scheduler = GenerationScheduler(engine, seed=seed)
    jobs = [(p, first_episode + j) for p in problems for j in range(n)]
    if player is None:
        ctxs = [EpisodeContext(scheduler, router.policy_name, router.tokenizer, params, p.id, e, seed=cfg.seed,
                               workflow=run.name) for p, e in jobs]
    else:
        ctxs = [PlayerContext(scheduler, router.policy_name, router.tokenizer, params, p.id, e, seed=cfg.seed,
                              workflow=run.name, player=player, roles=player_roles) for p, e in jobs]
    with torch.no_grad():
        results = scheduler.run([run_episode(lambda c, _p=p: spec.run(c, task, _p, settings), ctx)
                                 for (p, _), ctx in zip(jobs, ctxs)])
    if player is not None:
        for ctx in ctxs:
            check_player_answered(ctx, ctx.samples)
    max_reward = getattr(task, "max_reward", 1.0)
    return [TeamEpisode(ctx.problem_id, r.team_return / max_reward, list(ctx.samples)) for ctx, r in zip(ctxs, results)]


def round_seed(cfg: Config, round_index: int, first_problem: int) -> int:
    """The sampling seed of a round's batch of problems (from ``first_problem`` on)."""
    return derive_seed(cfg.seed, round_index, first_problem, 73)


def nothing_kept(episodes: Sequence[TeamEpisode], min_reward: float, source: str) -> InputError:
    """The one-line refusal when no episode reached ``min_reward``: the best reward seen and what to try."""
    best = max((e.reward for e in episodes), default=None)
    seen = "no episode" if best is None else f"best normalised reward seen {best:.3f}"
    lower = f"a lower --min-reward (e.g. {best:.3g}), " if best is not None and best > 0 else ""
    return InputError(f"sft: none of the {len(episodes)} episodes {source} reached --min-reward {min_reward:g} "
                      f"({seen}); try {lower}more samples (--self-play N, a higher --temperature) or replies written "
                      "by a player (--player module:function)")


def train_round(cfg: Config, router: PolicyRouter, roles: Sequence[str], keep: KeepRound, epochs: int,
                batch_size: int, progress: bool, first_step: int) -> None:
    """Fine-tune each policy on its own calls of the round's kept episodes; fills ``keep.trained`` and
    ``keep.records``."""
    keep.trained = training_rows(router, keep.kept, roles)
    if not keep.trained:  # e.g. eval records of a gateway workflow, whose calls are not in the record
        raise InputError(f"sft: the {len(keep.kept)} kept episodes hold no call to train (no recorded completion); "
                         "sample them again with --self-play N")
    keep.records = sft_epochs(cfg, router, keep.trained, epochs, batch_size, progress, first_step=first_step)
    for r in keep.records:
        r["round"] = keep.round


def self_play(cfg: Config, samples_per_problem: int, problems: int = 64, temperature: float = 1.0,
              min_reward: float = 1.0, rounds: int = 1, player: Player | None = None,
              player_roles: Collection[str] | None = None, epochs: int = 3, batch_size: int = 8,
              lr: float | None = None, progress: bool = True) -> tuple[Path, list[KeepRound]]:
    """Sample the team ``samples_per_problem`` times on each of the first ``problems`` training problems, keep the
    episodes whose normalised reward is >= ``min_reward``, train each policy on its own kept calls; ``rounds``
    times, each round sampling from the weights the last trained. Saves the warm start; returns (run directory,
    the rounds). Refuses (:class:`InputError`) when no episode of any round was kept."""
    if samples_per_problem < 1 or rounds < 1 or epochs < 1 or batch_size < 1:
        raise ConfigError(f"sft: --self-play {samples_per_problem}, --rounds {rounds}, --epochs {epochs} and "
                          f"--batch-size {batch_size} must be >= 1")
    fresh_run_dir(cfg)
    router, roles = sft_router(cfg, lr)
    task = make_task(cfg.task)
    chosen = task.problems()[:problems]
    if not chosen:
        raise ConfigError(f"task {task.name!r}: no training problems to sample (check the task's options)")
    done: list[KeepRound] = []
    step = 0
    for k in range(1, rounds + 1):
        keep = KeepRound(k, [], min_reward)
        for start in range(0, len(chosen), PROBLEMS_PER_BATCH):
            part = chosen[start:start + PROBLEMS_PER_BATCH]
            keep.episodes += sample_episodes(cfg, router, task, part, samples_per_problem, temperature,
                                             seed=round_seed(cfg, k, start),
                                             first_episode=(k - 1) * samples_per_problem, player=player,
                                             player_roles=player_roles)
            if progress:
                print(f"[teamrl sft] round {k}/{rounds}: sampled {start + len(part)}/{len(chosen)} problems "
                      f"({len(keep.episodes)} episodes), kept {len(keep.kept)} so far (reward >= {min_reward:g})",
                      file=sys.stderr, flush=True)
        if not keep.kept:
            if not any(r.kept for r in done):
                raise nothing_kept(keep.episodes, min_reward, "sampled")
            if progress:
                print(f"[teamrl sft] round {k}/{rounds}: no episode reached --min-reward {min_reward:g}; the weights "
                      "stay those of the last round", file=sys.stderr, flush=True)
        else:
            train_round(cfg, router, roles, keep, epochs, batch_size, progress, step)
            step += len(keep.records)
        done.append(keep)
    trained_on = {"source": "self-play", "samples_per_problem": samples_per_problem, "problems": len(chosen),
                  "temperature": temperature, "min_reward": min_reward, "player": player is not None,
                  "player_roles": None if player_roles is None else sorted(player_roles), **totals(done),
                  "rounds": [r.summary() for r in done]}
    run_dir = save_warm_start(cfg, router, [r for k in done for r in k.records], trained_on)
    return run_dir, done


def totals(rounds: Sequence[KeepRound]) -> dict[str, Any]:
    """Episodes sampled and kept, and calls kept per role, over every round."""
    calls: Counter[str] = Counter()
    for r in rounds:
        calls.update(r.summary()["calls_kept"])
    return {"episodes": sum(len(r.episodes) for r in rounds), "kept": sum(len(r.kept) for r in rounds),
            "calls_kept": dict(calls)}


# ---- episodes on disk -------------------------------------------------------------------------


@dataclass
class EpisodesOnDisk:
    """The episodes read from a path, and what was left out or re-tokenised."""

    episodes: list[TeamEpisode]
    kind: str  # "training logs" or "eval records"
    skipped: dict[str, int] = field(default_factory=dict)  # why -> episodes left out
    retokenised: int = 0  # calls whose logs held no token ids


def _call_sample(rec: dict[str, Any], problem_id: Hashable, tok: Any, text_key: str) -> tuple[Sample, bool]:
    """A logged call as a Sample with its exact ids, else re-tokenised (second: whether it was)."""
    prompt_ids, completion_ids = rec.get("prompt_ids"), rec.get("completion_ids")
    exact = prompt_ids is not None and completion_ids is not None
    if not exact:  # the rendered prompt is what ctx.generate tokenised; the completion text loses its EOS
        prompt_ids = tok(rec["prompt"], add_special_tokens=False)["input_ids"]
        completion_ids = tok(rec[text_key], add_special_tokens=False)["input_ids"]
        completion_ids += [tok.eos_token_id] if rec.get("finish_reason") == "eos" else []
    sample = Sample(role=rec["role"], policy=str(rec.get("policy", "")), problem_id=problem_id,
                    prompt_ids=list(prompt_ids), completion_ids=list(completion_ids), sampling_logprobs=[],
                    text=rec[text_key], finish_reason=rec.get("finish_reason", "length"),
                    episode=int(rec.get("episode", 0)), turn=int(rec.get("turn", 0)),
                    trainable=bool(rec.get("trainable", True)), baseline=bool(rec.get("baseline", False)))
    return sample, not exact


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise InputError(f"--from-episodes: {path}: not JSON lines ({e.msg}, line {e.lineno})") from None


def read_training_logs(folder: Path, tok: Any, max_reward: float) -> EpisodesOnDisk:
    """The episodes of a run's ``episodes/step_*.jsonl`` (its calls) and ``outcomes_*.jsonl`` (their team returns).

    An episode is a step's (problem, episode number); one with several outcomes (MAGRPO's tree of joint actions)
    cannot say which calls led to which, and is refused. A call RL logged but never trained (not trainable, a
    greedy baseline's, a played-out or duplicated copy) is left out; in an AT-GRPO tree only the chosen candidate
    of each call is kept (the others did not happen in the episode)."""
    out = EpisodesOnDisk([], "training logs")
    steps = sorted(folder.glob("step_*.jsonl"))
    for step_file in steps:
        outcomes: dict[tuple[str, int], list[float]] = {}
        outcome_file = folder / step_file.name.replace("step_", "outcomes_")
        for o in _jsonl(outcome_file) if outcome_file.is_file() else []:
            outcomes.setdefault((json.dumps(o["problem_id"]), int(o["episode"])), []).append(float(o["team_return"]))
        calls: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for rec in _jsonl(step_file):
            calls.setdefault((json.dumps(rec["problem_id"]), int(rec["episode"])), []).append(rec)
        for key, recs in calls.items():
            returns = outcomes.get(key)
            if not returns:
                out.skipped["no outcome logged"] = out.skipped.get("no outcome logged", 0) + 1
                continue
            if len(returns) > 1:
                raise InputError(f"--from-episodes {folder}: {step_file.name}: episode {key[1]} of problem {key[0]} "
                                 f"has {len(returns)} outcomes (a tree of joint actions, MAGRPO's): its calls cannot "
                                 "be told apart by outcome; use an eval or calibrate output of the run instead")
            tags = [r.get("tags") or {} for r in recs]
            tree = any("chosen" in t for t in tags)
            samples = []
            for rec, t in zip(recs, tags):
                if t.get("rollout") or t.get("duplicate") or t.get("dropped") or (tree and not t.get("chosen")):
                    continue
                sample, re = _call_sample(rec, json.loads(key[0]), tok, "completion")
                out.retokenised += re
                samples.append(sample)
            out.episodes.append(TeamEpisode(json.loads(key[0]), returns[0] / max_reward, samples))
    return out


def read_eval_records(files: Sequence[Path], tok: Any, workflow: str) -> EpisodesOnDisk:
    """The episodes of ``teamrl eval`` / ``teamrl calibrate`` records (:func:`~teamrl.trainer.evaluate.episode_record`)
    that ran the run's ``workflow`` (a baseline's episodes, other roles and prompts, are left out)."""
    out = EpisodesOnDisk([], "eval records")
    for path in files:
        for rec in _jsonl(path):
            if not isinstance(rec, dict) or "calls" not in rec or "score" not in rec:
                break  # not an episode file
            if rec.get("workflow") != workflow:
                why = f"workflow {rec.get('workflow')!r}, not the run's"
                out.skipped[why] = out.skipped.get(why, 0) + 1
                continue
            samples = []
            for c in rec["calls"]:
                sample, re = _call_sample(c, rec["problem_id"], tok, "completion")
                out.retokenised += re
                samples.append(sample)
            out.episodes.append(TeamEpisode(rec["problem_id"], float(rec["score"]), samples))
    return out


def read_episodes(path: str | Path, cfg: Config, tok: Any) -> EpisodesOnDisk:
    """The episodes at ``path``: a run directory (its ``episodes/`` training logs), that ``episodes/`` folder, or a
    folder of eval / calibrate output (``*.jsonl`` episode records, found in its subfolders too)."""
    path = Path(path)
    if not path.is_dir():
        raise InputFileMissing(f"--from-episodes {path}: no such directory; give a run directory (runs/<name>) or an "
                               "eval / calibrate output directory (results.json + <method>.jsonl)")
    task = make_task(cfg.task)
    logs = path / "episodes" if (path / "episodes").is_dir() else path
    if any(logs.glob("step_*.jsonl")):
        found = read_training_logs(logs, tok, getattr(task, "max_reward", 1.0))
    else:
        found = read_eval_records(sorted(path.rglob("*.jsonl")), tok, run_workflow(cfg, task).name)
    if not found.episodes:
        raise InputError(f"--from-episodes {path}: no episodes of this run's workflow in it"
                         + (f" ({', '.join(f'{n} left out: {why}' for why, n in found.skipped.items())})"
                            if found.skipped else "")
                         + "; give a run directory with episodes/step_*.jsonl or an eval / calibrate output directory")
    return found


def from_episodes(cfg: Config, path: str | Path, min_reward: float = 1.0, epochs: int = 3, batch_size: int = 8,
                  lr: float | None = None, progress: bool = True) -> tuple[Path, KeepRound, EpisodesOnDisk]:
    """Keep the episodes at ``path`` whose normalised reward is >= ``min_reward`` and train each policy on its own
    calls of them; save the warm start. Returns (run directory, the round, what was read)."""
    if epochs < 1 or batch_size < 1:
        raise ConfigError(f"sft: --epochs {epochs} and --batch-size {batch_size} must be >= 1")
    fresh_run_dir(cfg)
    router, roles = sft_router(cfg, lr)
    found = read_episodes(path, cfg, router.tokenizer)
    keep = KeepRound(1, found.episodes, min_reward)
    if progress:
        print(f"[teamrl sft] read {len(found.episodes)} episodes ({found.kind}) from {path}, kept {len(keep.kept)} "
              f"(reward >= {min_reward:g})", file=sys.stderr, flush=True)
    if not keep.kept:
        raise nothing_kept(found.episodes, min_reward, f"in {path}")
    train_round(cfg, router, roles, keep, epochs, batch_size, progress, 0)
    trained_on = {"source": f"episodes: {path}", "kind": found.kind, "min_reward": min_reward,
                  "retokenised_calls": found.retokenised, "skipped": found.skipped, **totals([keep]),
                  "rounds": [keep.summary()]}
    return save_warm_start(cfg, router, keep.records, trained_on), keep, found


def format_summary(rounds: Sequence[KeepRound]) -> str:
    """A few lines: per round, the episodes sampled and kept, the calls kept per role, the mean reward of the kept
    episodes against all of them, and each policy's loss from its first to its last step."""
    lines = []
    for keep in rounds:
        s = keep.summary()
        calls = ", ".join(f"{role} {n}" for role, n in sorted(s["calls_kept"].items())) or "none"
        kept_mean = "-" if s["mean_reward_kept"] is None else f"{s['mean_reward_kept']:.3f}"
        all_mean = "-" if s["mean_reward"] is None else f"{s['mean_reward']:.3f}"
        lines.append(f"round {keep.round}: {s['episodes']} episodes, {s['kept']} kept (normalised reward >= "
                     f"{keep.min_reward:g}); calls kept per role: {calls}; mean reward kept {kept_mean} vs all "
                     f"{all_mean}")
        for name in dict.fromkeys(r["policy"] for r in keep.records):
            own = [r["loss"] for r in keep.records if r["policy"] == name]
            lines.append(f"  policy {name}: loss {own[0]:.3f} (first step) -> {own[-1]:.3f} (last step), "
                         f"{len(own)} steps")
    return "\n".join(lines)
