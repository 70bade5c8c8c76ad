"""The training loop, :meth:`Trainer.train`: each step collects, learns and publishes (docs/architecture.md).

One step of :meth:`Trainer.train_step`, each phase timed in ``metrics.jsonl`` (``timing/<phase>_s``):

1. **collect** (:class:`~teamrl.trainer.collector.Collector`): the step's problems, every episode sampled by the
   algorithm (rewards and groups included), up to ``rollout.max_staleness`` steps ahead of the learner;
2. **learn**: group-relative advantages, then :meth:`Learner.update <teamrl.trainer.learner.Learner.update>` of every
   policy on its own samples (in this process or on Ray workers);
3. **publish**: every policy's new weights through the one weight sync (:mod:`teamrl.trainer.weight_sync`) to what
   rollouts sample from;
4. log the step's record (:mod:`teamrl.trainer.step_metrics`), evaluate when asked, checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import sys
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from teamrl.algorithms import make_algorithm, workflow_name
from teamrl.algorithms.base import FinishedEpisode
from teamrl.core.config import ADVANTAGE_SCOPES, Config, ConfigError, InputError, config_to_dict
from teamrl.core.metrics import MetricsSink, read_metrics
from teamrl.core.sample import Sample, check_steering_tags
from teamrl.core.seeding import derive_seed, seed_everything
from teamrl.losses import group_ids_from_keys, trajectory_advantages, trajectory_ids
from teamrl.policies.models import check_max_new_tokens, generation_eos_ids
from teamrl.policies.router import check_role_map, declared_role
from teamrl.rollout.engine import Engine, SamplingParams
from teamrl.rollout.engine_setup import make_engine, probe_logprobs, stop_vllm_servers
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks import Problem, make_task
from teamrl.trainer.checkpoint import (check_resume_settings, check_run_dir, checkpoint_to_resume, list_checkpoints,
                                      load_checkpoint, lock_run_dir, record_warm_start, run_dir_writes, save_checkpoint,
                                      unlock_run_dir, warm_start_of, warm_start_weights,
                                      began_from_warm_start)
from teamrl.trainer.collector import Collector, Rollout
from teamrl.trainer.diagnostics import CliffDetector, learning_signal
from teamrl.trainer.evaluate import workflow_stats
from teamrl.trainer.learner import LearnBatch, make_router
from teamrl.trainer.learner_setup import make_learner
from teamrl.trainer.step_metrics import (episode_outcome_line, learner_metrics, role_metrics, sample_metrics,
                                         staleness_metrics)
from teamrl.trainer.update import (NonFiniteReward, contributes_to_loss, check_sampling_logprobs, make_update_params,
                                   nonfinite_reward_groups)
from teamrl.trainer.weight_sync import DriverCopy, InProcess, WeightSync
from teamrl.workflows import WORKFLOWS, default_workflow
from teamrl.workflows.context import EpisodeContext


def progress_bar(total: int, desc: str, unit: str, enabled: bool, initial: int = 0) -> Any:
    """The progress bar a command shows on stderr (``run.progress``): a ``tqdm`` of ``total`` units."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)



# The highest LoRA learning rate at which RL after a warm start was seen to keep it (reverse_text, seed 0: 1e-4 and
# 2e-4 kept it, 5e-4 undid it; AT-GRPO, M-GRPO and the study's warm starts also fell at 5e-4: docs/learning.md).
WARM_START_SAFE_LR = 2e-4

class RunExists(RuntimeError):
    """The run directory already holds checkpoints and ``resume`` was not asked for."""


class NothingToTrain(InputError):
    """A step's episodes produced no trainable sample (e.g. a workflow that never calls ``ctx.generate``)."""


def make_trainer(cfg: Config, resume: bool = False, resume_intact: bool = False) -> "Trainer":
    """The trainer a config asks for: one :class:`Trainer` for every algorithm and placement (``policy.placement``)."""
    return Trainer(cfg, resume=resume, resume_intact=resume_intact)


def check_policy_roles(cfg: Config, task: Any, algorithm: Any) -> None:
    """``policy.roles`` must list every role that acts and nothing the team does not have: a key that is
    neither a role of the task or workflow (its sub-agents included) nor a numbered instance of one
    (``generator0``) is a typo, refused here before any model loads. A role of the team that this
    algorithm leaves out (M-GRPO's single-agent baseline drops ``sub``) may stay in the map."""
    if not cfg.policy.roles:
        return
    acting = list(algorithm.roles or task.roles)
    check_role_map(cfg.policy.roles, acting)
    team = set(acting) | set(getattr(task, "roles", ()) or ())
    if cfg.workflow.name:
        spec = WORKFLOWS.get_entry(cfg.workflow.name, "workflow.name")
        team |= set(spec.role_types) | set(spec.sub_roles)
    for role in cfg.policy.roles:
        try:
            declared_role(role, team)
        except KeyError:
            raise ConfigError(f"policy.roles: {role!r} is not a role of the team; its roles are {sorted(team)} (a "
                              "numbered instance of one, such as generator0, may be listed too): remove it or fix its "
                              "spelling") from None


def comparison_keys(samples: Sequence[Sample], scope: str) -> list[Hashable]:
    """Each sample's comparison group for its advantage (``train.advantage_scope``): ``agent``, the algorithm's own
    group key (``Sample.group``: per role, turn, ...); ``team``, its problem, pooling every role's samples."""
    if scope not in ADVANTAGE_SCOPES:
        raise ValueError(f"advantage_scope {scope!r} is not one of {', '.join(ADVANTAGE_SCOPES)}")
    return [s.group for s in samples] if scope == "agent" else [(s.problem_id,) for s in samples]


class Trainer:
    """Trains the policies of a workflow on a task, as configured by a validated :class:`Config`."""

    # Collect in a thread ahead of the learner (separate weight copies) even at rollout.max_staleness=0; only tests set
    # it: at 0 the thread must give what collecting in the trainer's thread gives.
    collect_in_thread = False

    def __init__(self, cfg: Config, resume: bool = False, resume_intact: bool = False) -> None:
        """``resume``: continue from the newest checkpoint (refused, naming the file, when it does not read
        whole); ``resume_intact``: continue from the newest checkpoint that reads whole, keeping the
        unreadable newer ones aside as ``unreadable_step_N``."""
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir) / cfg.name
        self.ckpt_dir = self.run_dir / "checkpoints"
        resume = resume or resume_intact
        check_run_dir(self.run_dir)  # a read-only or unwritable run.dir: one line before any model loads
        # one process per run: another one's train or --resume is refused (its pid)
        created = lock_run_dir(self.run_dir)
        self._locked = True
        try:
            self._set_up(resume, resume_intact)
        except BaseException:
            self._locked = False
            unlock_run_dir(self.run_dir, remove_created=created)
            raise

    def _set_up(self, resume: bool, resume_intact: bool) -> None:
        """Everything of :meth:`__init__` after the run directory is held."""
        cfg = self.cfg
        if list_checkpoints(self.ckpt_dir) and not resume:
            raise RunExists(
                f"run directory {self.run_dir} already has checkpoints: pass --resume to continue it, or choose "
                "another name="
            )
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(cfg.seed)
        self.task = make_task(cfg.task)
        self.algorithm = make_algorithm(cfg, self.task)  # checks the task kind before any model loads
        self.workflow = WORKFLOWS.get_entry(workflow_name(cfg, self.task), "workflow.name")
        # the roles that act (a study workflow's role types; M-GRPO's single-agent baseline drops the sub-agent)
        self.roles = list(self.algorithm.roles or self.task.roles)
        check_policy_roles(cfg, self.task, self.algorithm)
        # rollout.max_staleness > 0: the rollouts of the next steps are sampled while a step trains (collector.py)
        self.max_staleness = cfg.rollout.max_staleness
        self.ahead = self.max_staleness > 0 or self.collect_in_thread
        self.collector: Collector | None = None  # started by the first step
        # checked before any model loads: a truncated last checkpoint is named at once
        resume_from, set_aside = checkpoint_to_resume(self.ckpt_dir, intact=resume_intact) if resume else (None, [])
        if resume_from is not None:
            check_resume_settings(self.run_dir, cfg)  # another model or LoRA rank: one line before any model loads
        for ckpt, target in set_aside:
            print(f"teamrl: checkpoint {ckpt.name} does not read whole; moved to {target} and resuming from "
                  f"{resume_from.name if resume_from else 'the start'}", file=sys.stderr)
        # a run that began from a warm start pulls toward it by default (train.loss.kl_coef: null); its policies
        # and workers are built from the resolved weight
        cfg.train.loss = cfg.train.loss.with_warm_start(
            began_from_warm_start(self.run_dir, resume_from) and not cfg.policy.ranks)
        self._build_policies()
        check_max_new_tokens(next(iter(self.router.policies.values())).model, cfg.rollout.max_new_tokens, cfg.model)
        self.params = SamplingParams.from_rollout(cfg.rollout)
        self.greedy_params = dataclasses.replace(self.params, temperature=0.0)  # baselines and evaluation
        self.update_params = make_update_params(cfg, self.roles)
        self.last_role_stats: dict[str, float] = {}
        self.nonfinite_groups_dropped = 0  # groups left out of the last step for a NaN/inf reward
        # the tokenizer's EOS and generation_config's (vLLM stops at both): one set for every engine and the loss mask
        self.eos_ids = generation_eos_ids(next(iter(self.router.policies.values())).model, self.tokenizer)
        self.problems = self.task.problems()
        if not self.problems:
            raise ConfigError(
                f"task {self.task.name!r}: no training problems (check task.num_problems / task.test_size)"
            )
        self.eval_task = self._eval_task() if cfg.train.eval_every else None
        self.cliffs = CliffDetector(cfg.train.cliff_points)
        self.stopped_at_cliff = False
        self.step = 0
        self.data_position = 0  # of the last trained step (the producer of the asynchronous loop keeps its own)
        # the warm start RL started from (RUN_DIR/warm_start.json; teamrl sft writes it), its held-out accuracy (the
        # step-0 evaluation) and whether the last evaluation was under it
        self.warm_start: dict[str, Any] | None = warm_start_of(self.run_dir)
        self.warm_start_accuracy: float | None = None
        self.below_warm_start = False
        from_warm_start = False
        if resume_from is not None:
            state = load_checkpoint(resume_from, self.learner)
            self.step, self.data_position = state["step"], state["data_position"]
            from_warm_start = bool(state.get("warm_start"))
            # its own RNG (AT-GRPO branch choice, M-GRPO alignment); a checkpoint from before it was saved:
            # one rollout per step, so the count of rollouts is the step
            self.algorithm.load_state_dict(state.get("algorithm", {"calls": self.step}))
            for rec in read_metrics(self.run_dir / "metrics.jsonl"):  # replay the evaluations for the running peak
                if "eval/accuracy" in rec and rec["step"] <= self.step:
                    self._watch(rec["step"], rec["eval/accuracy"])
        # updates of each policy published to the engine: one per trained step (every policy is published after every
        # step, changed or not), so a resumed run knows them from its step
        self.policy_versions: dict[str, int] = {name: self.step for name in self.router.policies}
        # the driver's copies hold what the learner holds (its initial or restored weights) before any rollout
        for name in self.router.policies:
            self.weight_copy.publish(name)
        # after a resume, so a server gets the restored adapters
        self.engine, self.vllm_servers = make_engine(cfg, self.router, self.eos_ids, self.run_dir, self.params,
                                                     self._send_initial, self._probe_logprobs)
        self.vllm_server = self.vllm_servers[0] if self.vllm_servers else None
        self.weight_sync = WeightSync(self.weight_copy, self.engine)  # the one way new weights reach the engine
        with run_dir_writes(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
            if from_warm_start:  # its weights kept out of checkpoints/ (rotated), for comparisons (an older sft's too)
                resumed = f"{resume_from.parent.name}/{resume_from.name}"
                self.warm_start = record_warm_start(self.run_dir, resume_from, {"rl_resumed_from": resumed})
            self.kl_reference = self._set_kl_reference()  # after the record: an older sft's warm start has one now
            if from_warm_start and cfg.policy.lora is not None and cfg.train.lr > WARM_START_SAFE_LR:
                print(f"warning: train.lr={cfg.train.lr:g} after a warm start: RL at 5e-4 undid warm starts here "
                      "(reverse_text, AT-GRPO, M-GRPO: docs/learning.md, RL after a warm start) where 1e-4 and 2e-4 "
                      f"kept them; consider train.lr={WARM_START_SAFE_LR:g} or lower", file=sys.stderr)
            self.metrics = MetricsSink(
                self.run_dir / "metrics.jsonl",
                start_step=self.step,
                tensorboard=cfg.run.tensorboard,
                wandb=cfg.run.wandb,
                wandb_project=cfg.run.wandb_project,
                run_name=cfg.name,
                config=config_to_dict(cfg),
            )

    def _set_kl_reference(self) -> str:
        """Point each policy's KL term at the warm start (``train.loss.kl_reference``: ``warm_start``, or ``auto`` in a
        run that began from one), else leave it on the base; returns which (``"base"``, ``"warm start"``, ``"none"``
        without a KL term). A warm start is what RL must keep: a KL to the base would pull toward what it undid."""
        loss = self.cfg.train.loss
        if loss.kl_coef == 0:
            return "none"
        if loss.kl_reference == "base":
            return "base"
        weights = warm_start_weights(self.run_dir, self.learner)
        if weights is None:
            if loss.kl_reference == "warm_start":
                raise ConfigError(f"train.loss.kl_reference=warm_start: run {self.run_dir} has no warm start "
                                  f"({self.run_dir}/warm_start.json, which teamrl sft writes); run teamrl sft "
                                  "first, or set train.loss.kl_reference to base or auto")
            return "base"
        for name, state in weights.items():
            self.learner.set_reference(name, state)
        return "warm start"

    def _eval_task(self) -> Any:
        """The held-out split of the task, for evaluation during training."""
        if not self.algorithm.can_evaluate:
            raise ConfigError(f"train.eval_every: evaluation during training runs under algorithm grpo, not "
                              f"{self.cfg.algorithm}; set train.eval_every=0 and evaluate with teamrl eval")
        if "split" not in getattr(self.task.Options, "__dataclass_fields__", {}):
            raise ConfigError(f"train.eval_every: task {self.task.name!r} has no held-out split (task.split); "
                              "set train.eval_every=0, or use a task that holds problems out")
        task = make_task({**self.cfg.task, "split": "test"})
        if not task.problems():
            raise ConfigError("train.eval_every: the task holds out no problems; set task.test_size > 0")
        return task

    def _send_initial(self, engine: Engine) -> None:
        """Every policy's initial (or restored) weights to a server the run starts with."""
        for name in self.router.policies:
            WeightSync(self.weight_copy, engine).publish(name)

    def _probe_logprobs(
        self,
        policy: str,
        prompt_ids: list[int] | list[list[int]],
        completions: list,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> list[list[float]]:
        """The trainer's log-probs of a server's ``completions`` under ``policy``'s weights (the start-up and sync
        checks; :func:`~teamrl.rollout.engine_setup.probe_logprobs`)."""
        return probe_logprobs(self.router, policy, prompt_ids, completions, temperature, top_k, top_p)

    def _build_policies(self) -> None:
        """The driver's router (the rollout engine samples from it), the tokenizer, the role -> policy route, the
        learner that trains the policies (``policy.placement``: this router itself, its own copy when collecting
        ahead, or Ray actors) and how its weights reach the driver's router (:mod:`teamrl.trainer.weight_sync`)."""
        self.router = make_router(self.cfg, self.roles)
        self.tokenizer = self.router.tokenizer
        self.route = self.router.policy_name
        self.learner = make_learner(self.cfg, self.router, self.roles, separate=self.ahead)
        in_process = not self.learner.remote and not self.ahead
        self.weight_copy = InProcess() if in_process else DriverCopy(self.router, self.learner)

    # ---- data -------------------------------------------------------------------------
    def _next_problems(self) -> list[Problem]:
        """The next batch in a per-epoch shuffled order that depends only on (seed, position)."""
        out, self.data_position = self._problems_at(self.data_position)
        return out

    def _problems_at(self, position: int) -> tuple[list[Problem], int]:
        """The batch at data position ``position`` and the position after it (see :meth:`_next_problems`)."""
        n, out = len(self.problems), []
        for _ in range(self.cfg.rollout.batch_size):
            epoch, idx = divmod(position, n)
            order = list(range(n))
            random.Random(derive_seed(self.cfg.seed, epoch)).shuffle(order)
            out.append(self.problems[order[idx]])
            position += 1
        return out, position

    # ---- one step: collect, learn, publish ------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One step (module docstring); returns the metrics record it logged."""
        step = self.step + 1
        if self.collector is None:
            self.collector = Collector(produce=self._sample_rollout, sync=self.weight_sync, learner=self.learner,
                                       start_step=self.step, last_step=self.cfg.train.steps,
                                       start_position=self.data_position, versions=dict(self.policy_versions),
                                       max_staleness=self.max_staleness, threaded=self.ahead)
        t0 = time.perf_counter()
        rollout = self.collector.collect(step)
        t1 = time.perf_counter()
        record: dict[str, Any] = {"step": step}
        train_samples, dropped = self._learn(rollout, record)
        t2 = time.perf_counter()
        for name in self.router.policies:  # every policy is published after every step, changed or not
            self.policy_versions[name] += 1
        for name, figures in self.collector.publish(step, dict(self.policy_versions)).items():
            record.update({f"sync/{name}/{k}": v for k, v in figures.items()})
        t3 = time.perf_counter()
        timing = {"timing/collect_s": rollout.rollout_s, "timing/learn_s": t2 - t1, "timing/publish_s": t3 - t2}
        self.data_position = rollout.data_position
        self._log_step(rollout, train_samples, record, update_s=t3 - t1,
                       ahead=(t1 - t0, dropped) if self.ahead else None)
        if self.eval_task is not None and step % self.cfg.train.eval_every == 0:
            t_eval = time.perf_counter()
            record.update(self._evaluate_and_watch(step))
            timing["timing/evaluate_s"] = time.perf_counter() - t_eval
        record.update(timing)
        self.step = step
        self.metrics.log(record)
        if step % self.cfg.run.save_every == 0 or step == self.cfg.train.steps or self.stopped_at_cliff:
            # the data position and algorithm state of this step's rollout: a resumed run produces the next one
            # from them
            state = {"data_position": self.data_position}
            algorithm_state = rollout.algorithm.state_dict()
            if algorithm_state:
                state["algorithm"] = algorithm_state
            save_checkpoint(self.ckpt_dir, step, self.learner, state, keep=self.cfg.run.keep_checkpoints)
        return record

    def _sample_rollout(self, step: int, position: int, versions: dict[str, int], engine: Engine) -> Rollout:
        """Step ``step``'s rollout: the problems at data ``position``, every episode sampled with ``engine`` holding
        each policy at ``versions`` (stamped on every sample)."""
        t0 = time.perf_counter()
        problems, position = self._problems_at(position)
        scheduler = GenerationScheduler(engine, seed=derive_seed(self.cfg.seed, step, 1))

        def make_ctx(problem: Problem, episode: int, tags: dict) -> EpisodeContext:
            params = self.greedy_params if tags.get("greedy") else self.params
            return EpisodeContext(scheduler, self.route, self.tokenizer, params, problem.id, episode, tags)

        samples = self._rollout(problems, make_ctx, scheduler)
        if not any(s.trainable and not s.baseline for s in samples):
            raise self._nothing_to_train(step, problems, samples)
        for s in samples:  # one set of weights for the whole rollout: its version at the start
            s.policy_version = versions[s.policy]
        # the algorithm as this rollout left it: a rollout ahead moves the live one on (a shallow copy suffices: a
        # rollout replaces its state, finished episodes included, it never mutates the old objects)
        algorithm = copy.copy(self.algorithm) if self.ahead else self.algorithm
        return Rollout(step, problems, samples, len(scheduler.calls), time.perf_counter() - t0, algorithm, position,
                       dict(versions))

    def _learn(self, rollout: Rollout, record: dict[str, Any]) -> tuple[list[Sample], tuple[int, int]]:
        """Advantages and every policy's update on ``rollout`` (stats into ``record``, per-role statistics into
        ``last_role_stats``); returns the trained samples and (samples dropped as too stale, samples looked at)."""
        dropped = self._drop_stale(rollout.samples) if self.ahead else (0, 0)
        train_samples = self._assign_advantages(rollout.samples)
        # how much of the batch can teach anything: groups with a non-zero advantage, samples the update computes
        loss = self.update_params.loss
        record.update(learning_signal(train_samples, self.roles, lambda s: contributes_to_loss(s, loss)))
        if self.cfg.train.nonfinite_reward == "drop_group":
            record["nonfinite_groups_dropped"] = self.nonfinite_groups_dropped
        parts: dict[str, list[list[Sample]]] = {}
        for name in self.router.policies:
            own = [s for s in train_samples if s.policy == name]
            # One optimizer step per policy, or (equalize_steps false) one per role instance in turn; with several,
            # each is clipped against the weights that sampled (old log-probs taken before the first)
            parts[name] = [own] if self.cfg.policy.equalize_steps else [[s for s in own if s.role == r]
                                                                         for r in dict.fromkeys(s.role for s in own)]
        mode = self.update_params.loss.importance_correction
        if mode != "none" and self.learner.remote:  # update_policy checks too; on the driver, a Ray worker's error
            check_sampling_logprobs(train_samples, mode)  # would come back wrapped in its remote traceback
        steps = self.learner.update(LearnBatch(parts, self.update_params, self.tokenizer.pad_token_id,
                                               tuple(self.eos_ids)))
        policy_record, self.last_role_stats = learner_metrics(steps, parts)
        record.update(policy_record)
        return train_samples, dropped

    def _drop_stale(self, samples: list[Sample]) -> tuple[int, int]:
        """The defensive staleness filter: a trainable sample more than ``max_staleness`` updates behind its policy is
        left out of the update (``trainable`` False; it is still logged). None is, by the gate's construction.
        Returns (samples dropped, trainable samples looked at)."""
        eligible = [s for s in samples if s.trainable and not s.baseline]
        stale = [s for s in eligible if self.policy_versions[s.policy] - s.policy_version > self.max_staleness]
        for s in stale:
            s.trainable = False
        if stale and len(stale) == len(eligible):
            worst = max(self.policy_versions[s.policy] - s.policy_version for s in stale)
            raise RuntimeError(f"step {self.step + 1}: every trainable sample is more than rollout.max_staleness="
                               f"{self.max_staleness} updates behind its policy (up to {worst}); the rollout producer "
                               "broke its gate")
        return len(stale), len(eligible)

    def _log_step(self, rollout: Rollout, train_samples: list[Sample], record: dict[str, Any], update_s: float,
                  ahead: tuple[float, tuple[int, int]] | None) -> None:
        """The step's record (:mod:`teamrl.trainer.step_metrics`) and, with ``run.log_episodes``, its episodes.
        ``ahead``: for a rollout collected ahead, the trainer's wait for it and (samples dropped as too stale, looked
        at); None: collected in this thread."""
        samples = rollout.samples
        record.update(sample_metrics(train_samples))
        gen_tokens = sum(len(s.completion_ids) for s in samples)
        record.update({"engine_calls": rollout.engine_calls, "rollout_s": rollout.rollout_s, "update_s": update_s,
                       "rollout_tokens_per_s": gen_tokens / max(rollout.rollout_s, 1e-9),
                       "data_position": self.data_position})
        if ahead is not None:
            wait_s, dropped = ahead
            # the versions of the policies before this step's publish: how far behind the trained samples were
            before = {name: v - 1 for name, v in self.policy_versions.items()}
            record.update(staleness_metrics(list(self.router.policies), before, train_samples, self.max_staleness,
                                            dropped))
            record.update({"async/trainer_wait_s": wait_s, "async/weights_wait_s": rollout.weights_wait_s,
                           "async/weights_load_s": rollout.weights_load_s})
            for name, figures in rollout.sync_figures.items():  # the server's checks of the loads before this rollout
                record.update({f"sync/{name}/{k}": v for k, v in figures.items()})
        endpoint_metrics = getattr(self.engine, "metrics", None)  # a pool of rollout servers: pool/endpoints_live
        if callable(endpoint_metrics):
            record.update(endpoint_metrics())
        if len(self.roles) > 1:
            record.update(role_metrics(train_samples, self.roles, self.last_role_stats, record, self.route,
                                       shared=self.cfg.policy.mode == "shared"))
        algorithm = rollout.algorithm
        record.update(algorithm.metrics(train_samples))
        finished = list(algorithm.finished)
        for k, v in self._workflow_stats(finished).items():
            record.setdefault(k, v)  # a statistic named like one of the trainer's own keeps the trainer's value
        baselines = [s for s in samples if s.baseline]
        if baselines:
            record["greedy_reward_mean"] = sum(s.reward for s in baselines) / len(baselines)
        if self.cfg.run.log_episodes:
            self._write_episodes(rollout.step, samples, finished)

    def _write_episodes(self, step: int, samples: list[Sample], finished: list[FinishedEpisode]) -> None:
        """``episodes/step_<step>.jsonl`` (every sample) and ``outcomes_<step>.jsonl`` (every finished episode)."""
        ep_dir = self.run_dir / "episodes"
        ep_dir.mkdir(exist_ok=True)
        with (ep_dir / f"step_{step:06d}.jsonl").open("w") as f:
            for s in samples:
                f.write(json.dumps(s.to_record()) + "\n")
        if finished:  # one line per episode that ran to its end: its outcome and the workflow's stats
            with (ep_dir / f"outcomes_{step:06d}.jsonl").open("w") as f:
                for e in finished:
                    f.write(episode_outcome_line(e) + "\n")

    def _workflow_stats(self, finished: list[FinishedEpisode]) -> dict[str, float]:
        """The workflow's statistics over the episodes of the step that ended with an outcome, as ``teamrl eval``
        shows them: accuracy, its registered summary, else the mean of each numeric ``stats`` entry."""
        outcomes = [e.result.outcome for e in finished if e.result.outcome is not None]
        return workflow_stats(self.workflow, outcomes) if outcomes else {}

    def _nothing_to_train(self, step: int, problems: list[Problem], samples: list[Sample]) -> NothingToTrain:
        """The error of a step without a trainable sample, naming the workflow (its usual cause)."""
        name = self.cfg.workflow.name or default_workflow(self.task)
        ids = sorted({str(p.id) for p in problems})
        shown = ", ".join(ids[:3]) + (", ..." if len(ids) > 3 else "")
        if not samples:
            return NothingToTrain(
                f"workflow {name!r}: no episode of step {step} called the model (problems {shown}); each "
                "episode must sample at least one completion with await ctx.generate(role, messages) "
                "(a gateway workflow: call its endpoint) for there to be anything to train"
            )
        return NothingToTrain(f"workflow {name!r}: none of the {len(samples)} samples of step {step} is trainable (all "
                              "are greedy baselines or frozen roles'); nothing to train")

    def evaluate_accuracy(self) -> dict[str, float]:
        """Greedy accuracy (and the workflow diagnostics) on the held-out problems: one episode each."""
        problems = self.eval_task.problems()[:self.cfg.train.eval_problems]
        scheduler = GenerationScheduler(self.engine, seed=derive_seed(self.cfg.seed, self.step, 2))
        def make_ctx(problem: Problem, episode: int, tags: dict) -> EpisodeContext:
            return EpisodeContext(scheduler, self.route, self.tokenizer, self.greedy_params, problem.id, episode, tags)

        return {
            f"eval/{k}": v
            for k, v in self.algorithm.evaluate(problems, self.eval_task, make_ctx, scheduler.run).items()
        }

    def _watch(self, step: int, accuracy: float) -> tuple[Any, bool]:
        """Feed one held-out accuracy to the running peak and, with a warm start, compare it with the warm start's
        (the step-0 evaluation); returns (the cliff event, whether it newly fell under the warm start)."""
        event = self.cliffs.update(step, accuracy)
        fell = False
        if self.warm_start is not None:
            if step == 0:
                self.warm_start_accuracy = accuracy
            elif self.warm_start_accuracy is not None:
                below = accuracy < self.warm_start_accuracy
                fell, self.below_warm_start = below and not self.below_warm_start, below
        return event, fell

    def best_checkpoint_line(self) -> str | None:
        """With a warm start and held-out evaluations: one line naming the best checkpoint by held-out accuracy (the
        warm start included) and where it is kept; None otherwise (a run without a warm start says nothing new)."""
        if self.warm_start is None or self.cliffs.peak is None:
            return None
        step = self.cliffs.peak_step
        which = "the warm start (step 0)" if step == 0 else f"step {step}"
        kept = self.run_dir / "best" / f"step_{step:06d}"
        return (f"best checkpoint by held-out accuracy: {which}, accuracy {self.cliffs.peak:.3f}"
                + (f"; kept in {kept}" if kept.is_dir() else ""))

    def _evaluate_and_watch(self, step: int) -> dict[str, Any]:
        """Evaluate, update the running peak; keep the best checkpoint; warn (and stop) at a cliff; with a warm
        start, say when the accuracy falls under the warm start's."""
        from tqdm import tqdm

        # the engine between two rollouts, with these weights
        if self.collector is not None and self.collector.threaded:
            with self.collector.exclusive():
                out: dict[str, Any] = self.evaluate_accuracy()
        else:
            out = self.evaluate_accuracy()
        event, fell = self._watch(step, out["eval/accuracy"])
        out["eval/peak_accuracy"] = event.peak
        if self.warm_start is not None and step > 0 and self.warm_start_accuracy is not None:
            out["eval/under_warm_start"] = int(self.below_warm_start)
        # the base weights need no copy; a warm start's step-0 peak is kept like any other
        if event.kind == "peak" and (step > 0 or self.warm_start is not None):
            save_checkpoint(self.run_dir / "best", step, self.learner, {"data_position": self.data_position,
                                                                    "eval_accuracy": event.accuracy}, keep=1)
        if fell:
            tqdm.write(
                f"warning: held-out accuracy {event.accuracy:.3f} at step {step} is under the warm start's "
                f"{self.warm_start_accuracy:.3f} (step 0): RL has lost {self.warm_start_accuracy - event.accuracy:.3f} "
                f"against its warm start; the best checkpoint (step {event.peak_step}) is in {self.run_dir / 'best'}",
                file=sys.stderr,
            )
        if event.kind == "cliff":
            out["eval/cliff"] = 1
            tqdm.write(
                f"warning: accuracy cliff at step {step}: eval accuracy {event.accuracy:.3f} is "
                f"{event.drop_points:.1f} "
                f"points under its peak {event.peak:.3f} (step {event.peak_step}); the best checkpoint is in "
                f"{self.run_dir / 'best'}" + ("; stopping (train.cliff_stop)" if self.cfg.train.cliff_stop else ""),
                file=sys.stderr,
            )
            self.stopped_at_cliff = self.cfg.train.cliff_stop
        return out

    def _rollout(self, problems: list[Problem], make_ctx, scheduler: GenerationScheduler) -> list[Sample]:
        """Every sample of this step's rollouts, with rewards and groups."""
        return self.algorithm.rollout(problems, self.task, make_ctx, scheduler.run)

    def _assign_advantages(self, samples: list[Sample]) -> list[Sample]:
        """Group-relative advantages over the trainable samples; returns them.

        Left out: greedy baselines, samples not ``trainable`` (a frozen agent's, or
        sub-trajectories dropped by M-GRPO's alignment) and, with ``train.nonfinite_reward:
        drop_group``, every group holding a NaN/inf reward (their count in ``nonfinite_groups_dropped``;
        by default such a reward raises :class:`NonFiniteReward`)."""
        check_steering_tags(samples)  # one written into tags after construction would be ignored
        train = [s for s in samples if s.trainable and not s.baseline]
        scored = train + [s for s in samples if s.baseline]  # a greedy baseline's reward enters 'max' advantages
        dropped = nonfinite_reward_groups(scored, self.task.name, self.cfg.train.nonfinite_reward)
        self.nonfinite_groups_dropped = len(dropped)
        if dropped:
            train = [s for s in train if s.group not in dropped]
            if not train:
                raise NonFiniteReward(
                    f"task {self.task.name!r}: every group of step {self.step + 1} has a NaN/inf reward; "
                    "nothing is left to train on"
                )
        rewards = torch.tensor([s.reward for s in train], dtype=torch.float32)
        ids = group_ids_from_keys(comparison_keys(train, self.cfg.train.advantage_scope))
        baselines = None
        if self.cfg.train.advantage == "max":
            greedy = {s.group: s.reward for s in samples if s.baseline}
            baselines = torch.tensor([greedy[s.group] for s in train], dtype=torch.float32)
        # the turns of one rollout marked as one trajectory (M-GRPO) count once in their group's statistics
        adv = trajectory_advantages(
            rewards,
            ids,
            trajectory_ids([s.trajectory for s in train]),
            self.cfg.train.advantage,
            eps=self.cfg.train.advantage_eps,
            baselines=baselines,
        )
        for s, a in zip(train, adv.tolist()):
            s.advantage = a
        return train

    # ---- the loop ---------------------------------------------------------------------
    def train(self) -> list[dict[str, Any]]:
        """Run until ``train.steps``; returns every step's metrics of this run directory."""
        try:
            with run_dir_writes(self.run_dir):  # a disk that fills, a run.dir made read-only: one line
                return self._train_loop()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the collector's thread (collecting ahead), the policy workers (Ray actors), unload this run's adapters
        from a rollout server and stop the vLLM server the run started (``rollout.engine=vllm``); the run directory and
        its checkpoints stay as they are."""
        collector, self.collector = getattr(self, "collector", None), None
        if collector is not None:  # first: its thread uses the engine (its rollouts not trained yet are dropped)
            collector.close()
        close = getattr(getattr(self, "engine", None), "close", None)
        try:
            if close is not None:
                close()
        finally:
            try:
                stop_vllm_servers(getattr(self, "vllm_servers", []))  # after the adapters are unloaded from it
                learner = getattr(self, "learner", None)
                if learner is not None:
                    learner.shutdown()
            finally:
                if getattr(self, "_locked", False):
                    self._locked = False
                    unlock_run_dir(self.run_dir)

    def _train_loop(self) -> list[dict[str, Any]]:
        total = self.cfg.train.steps
        bar = progress_bar(total, f"train {self.cfg.name}", "step", self.cfg.run.progress, initial=self.step)
        # the untrained (or warm-started) workflow's accuracy starts the running peak
        if self.eval_task is not None and self.step == 0:
            self.metrics.log({"step": 0, **self._evaluate_and_watch(0)})
        while self.step < total and not self.stopped_at_cliff:
            rec = self.train_step()
            bar.update(1)
            bar.set_postfix(
                reward=f"{rec.get('normalised_return', rec['reward_mean']):.3f}",
                len=f"{rec['completion_len']:.0f}",
                loss=f"{next((v for k, v in rec.items() if k.startswith('loss/')), 0.0):+.3f}",
            )
        bar.close()
        self.metrics.close()
        return read_metrics(self.run_dir / "metrics.jsonl")
