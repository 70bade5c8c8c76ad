"""The training loop: problems -> rollouts -> rewards -> advantages -> per-policy updates -> log -> checkpoint."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from teamrl.algorithms import make_algorithm, workflow_name
from teamrl.algorithms.base import FinishedEpisode
from teamrl.core.config import Config, ConfigError, InputError, config_to_dict
from teamrl.core.metrics import MetricsSink, read_metrics
from teamrl.core.sample import Sample, check_steering_tags
from teamrl.core.seeding import derive_seed, seed_everything
from teamrl.losses import group_ids_from_keys, trajectory_advantages, trajectory_ids
from teamrl.policies.chat import encode_chat
from teamrl.policies.logprobs import build_token_batch, completion_logprobs, truncated_token_logprobs
from teamrl.policies.models import check_max_new_tokens, generation_eos_ids
from teamrl.policies.multi_lora import SharedBaseAdapters
from teamrl.policies.router import check_role_map, declared_role
from teamrl.rollout.engine import Engine, GenerationRequest, SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks import Problem, make_task
from teamrl.tasks.solve import SolveTask
from teamrl.trainer.checkpoint import (check_resume_settings, check_run_dir, checkpoint_to_resume, list_checkpoints,
                                      load_checkpoint, lock_run_dir, run_dir_writes, save_checkpoint, unlock_run_dir)
from teamrl.trainer.diagnostics import CliffDetector, learning_signal, role_capture
from teamrl.trainer.evaluate import workflow_stats
from teamrl.trainer.pipeline import Rollout, RolloutPipeline
from teamrl.trainer.update import (IMPORTANCE_STATS, NonFiniteReward, _contributes, _to_device, check_sampling_logprobs,
                                   combine_importance_stats, make_update_params, nonfinite_reward_groups)
from teamrl.trainer.weight_sync import WeightSync
from teamrl.trainer.workers import PolicyPlacement, make_router
from teamrl.workflows import WORKFLOWS, default_workflow
from teamrl.workflows.context import EpisodeContext


def episode_outcome_line(e: FinishedEpisode) -> str:
    """One line of ``episodes/outcomes_<step>.jsonl`` (JSON): which episode (``where``: e.g. MAGRPO's path of
    joint actions), its team return and final reward, and what the workflow returned (correct, answer, stats;
    a stats value JSON cannot hold is written as its ``str``, a whole ``stats`` with non-text keys as its ``repr``)."""
    outcome = e.result.outcome
    record = {"problem_id": e.problem_id, "episode": e.episode, **e.where, "team_return": e.result.team_return,
              "final_reward": e.result.final_reward,
              **({"correct": outcome.correct, "answer": outcome.answer, "stats": outcome.stats} if outcome is not None else {})}
    try:
        return json.dumps(record, default=str)
    except TypeError:  # a dict key json cannot write (a tuple) inside stats
        return json.dumps({**record, "stats": repr(record.get("stats"))}, default=str)


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


# The prompt of the HTTP engine's start-up check (any prompt works: it only needs long, sampled completions).
STARTUP_PROBE = "Write a few words about the weather."
# The prompts of the sync check after every adapter load: fixed (each check also scores the last one's tokens) and
# short, without the chat template (any tokens exercise the adapter; the trainer's forward is most of the check's cost)
SYNC_PROBES = ("The weather today is", "Three colours I like are")


# Statistics of several optimizer steps of one policy (policy.equalize_steps false) that add up; every other one is
# the mean over the steps that have it (a role's gradient norm: the mean over the steps that trained it, as the
# workflow study defines it and verl's reduce_metrics averages).
SUMMED_OVER_STEPS = ("tokens", "skipped_steps")


def over_steps(stat: str, values: Sequence[float]) -> float:
    """One statistic of a policy's (or role's) optimizer steps of an iteration: the sum for :data:`SUMMED_OVER_STEPS`,
    else the mean."""
    return sum(values) if stat in SUMMED_OVER_STEPS else sum(values) / len(values)


class Trainer:
    """Trains the policies of a workflow on a task, as configured by a validated :class:`Config`."""

    # Run the asynchronous loop (rollout producer thread, separate weight copies) even at rollout.max_staleness=0;
    # only tests set it: at 0 the loop must give what the synchronous one gives.
    force_pipeline = False

    def __init__(self, cfg: Config, resume: bool = False, resume_intact: bool = False) -> None:
        """``resume``: continue from the newest checkpoint (refused, naming the file, when it does not read
        whole); ``resume_intact``: continue from the newest checkpoint that reads whole, keeping the
        unreadable newer ones aside as ``unreadable_step_N``."""
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir) / cfg.name
        self.ckpt_dir = self.run_dir / "checkpoints"
        resume = resume or resume_intact
        check_run_dir(self.run_dir)  # a read-only or unwritable run.dir: one line before any model loads
        created = lock_run_dir(self.run_dir)  # one process per run: another one's train or --resume is refused (its pid)
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
            raise RunExists(f"run directory {self.run_dir} already has checkpoints: pass --resume to continue it, or choose another name=")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(cfg.seed)
        self.task = make_task(cfg.task)
        self.algorithm = make_algorithm(cfg, self.task)  # checks the task kind before any model loads
        self.workflow = WORKFLOWS.get_entry(workflow_name(cfg, self.task), "workflow.name")
        # the roles that act (a study workflow's role types; M-GRPO's single-agent baseline drops the sub-agent)
        self.roles = list(self.algorithm.roles or self.task.roles)
        check_policy_roles(cfg, self.task, self.algorithm)
        # rollout.max_staleness > 0: the rollouts of the next steps are sampled while a step trains (teamrl.trainer.pipeline)
        self.max_staleness = cfg.rollout.max_staleness
        self.pipelined = self.max_staleness > 0 or self.force_pipeline
        self._pipeline: RolloutPipeline | None = None
        # checked before any model loads: a truncated last checkpoint is named at once
        resume_from, set_aside = checkpoint_to_resume(self.ckpt_dir, intact=resume_intact) if resume else (None, [])
        if resume_from is not None:
            check_resume_settings(self.run_dir, cfg)  # another model or LoRA rank: one line before any model loads
        for ckpt, target in set_aside:
            print(f"teamrl: checkpoint {ckpt.name} does not read whole; moved to {target} and resuming from "
                  f"{resume_from.name if resume_from else 'the start'}", file=sys.stderr)
        self._build_policies()
        check_max_new_tokens(next(iter(self.router.policies.values())).model, cfg.rollout.max_new_tokens, cfg.model)
        self.params = SamplingParams.from_rollout(cfg.rollout)
        self.greedy_params = dataclasses.replace(self.params, temperature=0.0)  # baselines and evaluation
        self.update_settings = make_update_params(cfg, self.roles)
        self.last_role_stats: dict[str, float] = {}
        self.nonfinite_groups_dropped = 0  # groups left out of the last step for a NaN/inf reward
        # the tokenizer's EOS and generation_config's (vLLM stops at both): one set for every engine and the loss mask
        self.eos_ids = generation_eos_ids(next(iter(self.router.policies.values())).model, self.tokenizer)
        self.problems = self.task.problems()
        if not self.problems:
            raise ConfigError(f"task {self.task.name!r}: no training problems (check task.num_problems / task.test_size)")
        self.eval_task = self._eval_task() if cfg.train.eval_every else None
        self.cliffs = CliffDetector(cfg.train.cliff_points)
        self.stopped_at_cliff = False
        self.step = 0
        self.data_position = 0  # of the last trained step (the producer of the asynchronous loop keeps its own)
        if resume_from is not None:
            state = load_checkpoint(resume_from, self.placement)
            self.step, self.data_position = state["step"], state["data_position"]
            # its own RNG (AT-GRPO branch choice, M-GRPO alignment); a checkpoint from before it was saved:
            # one rollout per step, so the count of rollouts is the step
            self.algorithm.load_state_dict(state.get("algorithm", {"calls": self.step}))
            for rec in read_metrics(self.run_dir / "metrics.jsonl"):  # replay the evaluations for the running peak
                if "eval/accuracy" in rec and rec["step"] <= self.step:
                    self.cliffs.update(rec["step"], rec["eval/accuracy"])
        # updates of each policy published to the engine: one per trained step (every policy is published after every
        # step, changed or not), so a resumed run knows them from its step
        self.policy_versions: dict[str, int] = {name: self.step for name in self.router.policies}
        self.engine = self._make_engine()  # after a resume, so a server gets the restored adapters
        self.weight_sync = WeightSync(self.placement, self.engine)  # the one way new weights reach the engine
        with run_dir_writes(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
            self.metrics = MetricsSink(self.run_dir / "metrics.jsonl", start_step=self.step, tensorboard=cfg.run.tensorboard,
                                       wandb=cfg.run.wandb, wandb_project=cfg.run.wandb_project, run_name=cfg.name,
                                       config=config_to_dict(cfg))

    def _eval_task(self) -> SolveTask:
        """The held-out split of the task, for evaluation during training."""
        if not self.algorithm.can_evaluate:
            raise ConfigError("train.eval_every: evaluation during training needs a study workflow (workflow.name) on a "
                              "math.solve or code.solve task")
        task = make_task({**self.cfg.task, "split": "test"})
        if not task.problems():
            raise ConfigError("train.eval_every: the task holds out no problems; set task.test_size > 0")
        return task

    def _make_engine(self) -> Engine:
        """The in-process engine, or (``rollout.engine=http``) a client of a ``teamrl serve`` / vLLM / SGLang server, or
        (``rollout.engine=vllm``) a client of a vLLM server started here for the run (stopped by :meth:`shutdown`).
        Several servers (``rollout.server_urls``, ``rollout.vllm.servers``, or servers placed by Ray) make a pool
        (:class:`~teamrl.rollout.pool.EnginePool`), each endpoint checked and synced as one server is."""
        if self.cfg.rollout.engine == "hf":
            # LoRA policies on one base decode together through it, each row with its own adapter (no merged copies)
            return HFEngine(lambda name: self.router.policies[name].generation_model(), self.tokenizer, device=self.router.device,
                            extra_eos_ids=self.eos_ids, row_models=SharedBaseAdapters(self.router.policies))
        from tqdm import tqdm

        from teamrl.rollout.http_engine import HTTPEngine, ServerError
        from teamrl.rollout.pool import EnginePool
        from teamrl.rollout.vllm_server import check_lora_slots, check_served_model, explain_lora_error

        r = self.cfg.rollout
        adapter_dir = (Path(r.adapter_dir) if r.adapter_dir else self.run_dir / "served_adapters").resolve()
        # adapters named per process (<policy>@<run>-<id>): a second run, a resume or another run on the same server
        # never meets a name already loaded there
        urls, dialect = list(r.server_urls) or [r.server_url], r.server_dialect
        exited: list = [None] * len(urls)
        if r.engine == "vllm":
            from teamrl.rollout.vllm_server import start_servers

            self.vllm_servers = start_servers(self.cfg, self.run_dir, len(self.router.policies),
                                              log=lambda line: tqdm.write(line, file=sys.stderr))
            self.vllm_server = self.vllm_servers[0]
            urls, dialect = [s.url for s in self.vllm_servers], "vllm"
            exited = [s.exit_reason for s in self.vllm_servers]
        tag = f"{self.cfg.name}-{uuid.uuid4().hex[:6]}"
        # in a pool each endpoint has its own adapter names (and so its own adapter folders): _e1, _e2, ... (no "." or
        # "-": PEFT refuses dots in adapter names, and release_stale reads the run name up to the last "-")
        # token ids an answer may hold: the model's embedding rows (a padded vocabulary has more than the tokenizer)
        model = getattr(next(iter(self.router.policies.values()), None), "model", None)  # None: policies on workers
        vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else 0
        engines = [HTTPEngine(url, self.tokenizer, adapter_dir=adapter_dir, dialect=dialect, request_deadline_s=r.request_deadline_s,
                              vocab_size=max(vocab, len(self.tokenizer)),
                              save_adapter=lambda name, folder: self.router.policies[name].save_adapter(folder),
                              adapter_tag=tag if len(urls) == 1 else f"{tag}_e{i + 1}",
                              verify_logprobs=self._probe_logprobs if r.server_sync_check else None,
                              verify_tolerance=r.server_check_tolerance,
                              probe_prompts=[self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in SYNC_PROBES],
                              log=tqdm.write) for i, url in enumerate(urls)]
        engine: Engine = engines[0] if len(engines) == 1 else EnginePool(
            engines, names=urls, on_failure=r.on_endpoint_failure, log=lambda line: tqdm.write(line, file=sys.stderr),
            exited=exited)
        try:
            for e in engines:
                if e.dialect == "vllm":
                    check_served_model(e, self.cfg.model)  # one line naming --served-model-name
                e.check_base_model(self.cfg.model)
                stale = e.release_stale()
                if stale:
                    print(f"teamrl: unloaded {len(stale)} adapter(s) an earlier process of this run left on {e.base_url}: "
                          f"{', '.join(stale)}", file=sys.stderr)
            for name in self.router.policies:  # the server holds none of this run's adapters yet: send the initial ones
                WeightSync(self.placement, engine).publish(name)
            if r.server_check:
                for e in engines:
                    truncated = e.processed_logprobs and self.params.temperature > 0 and (r.top_k > 0 or r.top_p < 1)
                    f = e.startup_check(self.cfg.model, list(self.router.policies), self.params, r.group_size,
                                        encode_chat(self.tokenizer, STARTUP_PROBE), self._probe_logprobs,
                                        tolerance=r.server_check_tolerance, seed=derive_seed(self.cfg.seed, 0, 3))
                    print(f"teamrl: start-up check of {e.base_url} ({e.dialect}): {f['distinct']:.0f} of {f['group']:.0f} "
                          f"samples distinct (fewest over {len(self.router.policies)} policies); log-probs vs the trainer's under "
                          f"temperature {self.params.temperature}, top_k {self.params.top_k}, top_p {self.params.top_p}"
                          f"{' (truncated and renormalised as the server samples)' if truncated else ''}: "
                          f"max gap {f['logprob_gap']:.2e}, mean {f['logprob_mean_gap']:.2e} over {f['tokens']:.0f} tokens; "
                          f"tolerance {f['tolerance']:g}", flush=True)
            for e in engines:
                if e.dialect == "vllm":  # one line naming --max-loras when the policies cannot all be served at once
                    check_lora_slots(e, list(self.router.policies), probe=lambda e=e: e.generate(
                        self.cfg.model, [GenerationRequest(encode_chat(self.tokenizer, STARTUP_PROBE), SamplingParams(max_new_tokens=1))]))
        except ServerError as e:  # an adapter the server would not load: name the vLLM flag that would
            try:
                engine.close()
            finally:
                self._stop_vllm_server()
            lora = self.cfg.policy.lora
            raise explain_lora_error(e, lora.r if lora is not None else 0) from None
        except BaseException:
            try:
                engine.close()  # a failed check leaves nothing of this run on the server
            finally:
                self._stop_vllm_server()
            raise
        if len(engines) > 1:
            print(f"teamrl: a pool of {len(engines)} rollout endpoints ({', '.join(urls)}); each policy's requests are "
                  f"spread over them; on a failed endpoint: {r.on_endpoint_failure} (rollout.on_endpoint_failure)",
                  file=sys.stderr)
        return engine

    def _stop_vllm_server(self) -> None:
        """Stop the vLLM server(s) this run started (``rollout.engine=vllm``; on Ray: the servers, then their actors)."""
        from tqdm import tqdm

        servers = getattr(self, "vllm_servers", None) or [s for s in [getattr(self, "vllm_server", None)] if s is not None]
        errors = []
        for server in servers:
            try:
                server.stop(log=lambda line: tqdm.write(line, file=sys.stderr))
            except Exception as e:  # stop the others all the same
                errors.append(e)
        if errors:
            raise errors[0]

    def _probe_logprobs(self, policy: str, prompt_ids: list[int] | list[list[int]], completions: list, temperature: float,
                        top_k: int = 0, top_p: float = 1.0) -> list[list[float]]:
        """The trainer's log-probs of ``completions`` of ``prompt_ids`` (one prompt, or one per completion) under
        ``policy``'s current weights, in one forward (the start-up and sync checks compare the server's with them); with
        ``top_k``/``top_p``, those of the truncated and renormalised distribution a server samples from
        (:func:`truncated_token_logprobs`)."""
        prompts = prompt_ids if prompt_ids and isinstance(prompt_ids[0], list) else [prompt_ids] * len(completions)
        batch = build_token_batch(prompts, [c.token_ids for c in completions], self.tokenizer.pad_token_id)
        with self.router.policies[policy].generation_model() as model, torch.no_grad():
            batch = _to_device(batch, next(model.parameters()).device)
            if top_k <= 0 and top_p >= 1:
                lp, _ = completion_logprobs(model, batch, temperature or 1.0)
            else:
                out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                            use_cache=False, logits_to_keep=batch.completion_len + 1)
                # one row at a time: the sort of top-p over the vocabulary at every position is large
                lp = torch.stack([truncated_token_logprobs(out.logits[i, :-1], batch.completion_ids[i], temperature, top_k, top_p)
                                  for i in range(len(completions))])
        return [lp[i, :len(c.token_ids)].tolist() for i, c in enumerate(completions)]

    def _build_policies(self) -> None:
        """The driver's router (the rollout engine samples from it), the tokenizer, the role -> policy route, and
        the workers that train the policies (``policy.placement``: this router itself, or Ray actors)."""
        self.router = make_router(self.cfg, self.roles)
        self.tokenizer = self.router.tokenizer
        self.route = self.router.policy_name
        self.placement = PolicyPlacement(self.cfg, self.router, self.roles, deferred=self.pipelined)

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

    # ---- one iteration ----------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One iteration; returns the metrics record it logged.

        Synchronous (``rollout.max_staleness`` 0): the rollout, then the update, then the weight sync. Asynchronous:
        the step's rollout comes from the producer thread (started at the first step), which samples the next steps'
        rollouts while this one trains (:mod:`teamrl.trainer.pipeline`)."""
        step = self.step + 1
        if not self.pipelined:
            return self._consume(self._produce(step, self.data_position, dict(self.policy_versions)), None)
        if self._pipeline is None:
            self._start_pipeline()
        t0 = time.perf_counter()
        rollout = self._pipeline.get(step)
        return self._consume(rollout, time.perf_counter() - t0)

    def _produce(self, step: int, position: int, versions: dict[str, int], engine: Engine | None = None) -> Rollout:
        """Step ``step``'s rollout: the problems at data ``position``, every episode sampled with ``engine`` (default:
        the trainer's) holding each policy at ``versions`` (stamped on every sample)."""
        t0 = time.perf_counter()
        problems, position = self._problems_at(position)
        scheduler = GenerationScheduler(engine or self.engine, seed=derive_seed(self.cfg.seed, step, 1))

        def make_ctx(problem: Problem, episode: int, tags: dict) -> EpisodeContext:
            params = self.greedy_params if tags.get("greedy") else self.params
            return EpisodeContext(scheduler, self.route, self.tokenizer, params, problem.id, episode, tags)

        samples = self._rollout(problems, make_ctx, scheduler)
        if not any(s.trainable and not s.baseline for s in samples):
            raise self._nothing_to_train(step, problems, samples)
        for s in samples:  # one set of weights for the whole rollout: its version at the start
            s.policy_version = versions[s.policy]
        # the algorithm as this rollout left it: the producer's next rollout moves the live one on (a shallow copy
        # suffices: a rollout replaces its state, finished episodes included, it never mutates the old objects)
        algorithm = copy.copy(self.algorithm) if self.pipelined else self.algorithm
        return Rollout(step, problems, samples, len(scheduler.calls), time.perf_counter() - t0, algorithm, position,
                       dict(versions))

    def _start_pipeline(self) -> None:
        """Start the rollout producer of the asynchronous loop after the current step."""
        self._pipeline = RolloutPipeline(produce=self._produce, placement=self.placement, sync=self.weight_sync,
                                         start_step=self.step, last_step=self.cfg.train.steps,
                                         start_position=self.data_position, versions=dict(self.policy_versions),
                                         max_staleness=self.max_staleness)

    def _stop_pipeline(self) -> None:
        """Stop the rollout producer, if one runs (its rollouts not trained yet are dropped)."""
        pipeline, self._pipeline = getattr(self, "_pipeline", None), None
        if pipeline is not None:
            pipeline.close()

    def _publish(self, step: int, record: dict[str, Any]) -> None:
        """After the update of ``step``, every policy's new version leaves the learner: synchronous, through
        :meth:`WeightSync.publish` now (the server's sync figures into ``record``); asynchronous, as a snapshot for
        the producer, which publishes it at the start of the rollout whose gate it opens."""
        if not self.pipelined:
            for name in self.router.policies:
                figures = self.weight_sync.publish(name)
                self.policy_versions[name] += 1
                record.update({f"sync/{name}/{k}": v for k, v in figures.items()})
            return
        out = {}
        for name in self.router.policies:
            self.policy_versions[name] += 1
            out[name] = (self.policy_versions[name], self.placement.snapshot(name))
        self._pipeline.publish(step, out)

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

    def _async_metrics(self, rollout: Rollout, train_samples: list[Sample], dropped: tuple[int, int],
                       trainer_wait_s: float) -> dict[str, float]:
        """``async/*``: per policy, how many trained samples were n = 0..k updates behind (and the mean), the share
        dropped as too stale, the trainer's wait for the rollout and the producer's wait for (and load of) weights."""
        out: dict[str, float] = {}
        for name in self.router.policies:
            behind = [self.policy_versions[name] - s.policy_version for s in train_samples if s.policy == name]
            if not behind:
                continue
            for n in range(self.max_staleness + 1):
                out[f"async/staleness/{name}/{n}"] = float(sum(b == n for b in behind))
            out[f"async/staleness_mean/{name}"] = sum(behind) / len(behind)
        out["async/dropped_stale_share"] = dropped[0] / dropped[1] if dropped[1] else 0.0
        out["async/trainer_wait_s"] = trainer_wait_s
        out["async/weights_wait_s"] = rollout.weights_wait_s
        out["async/weights_load_s"] = rollout.weights_load_s
        for name, figures in rollout.sync_figures.items():  # the server's sync check of the loads before this rollout
            for k, v in figures.items():
                out[f"sync/{name}/{k}"] = v
        return out

    def _consume(self, rollout: Rollout, trainer_wait_s: float | None) -> dict[str, Any]:
        """Train on ``rollout`` (step ``rollout.step``), log the step, checkpoint; returns the record.
        ``trainer_wait_s``: the asynchronous loop's wait for the rollout (None: synchronous)."""
        step, samples = rollout.step, rollout.samples
        self.data_position = rollout.data_position
        t1 = time.perf_counter()
        record: dict[str, Any] = {"step": step}
        dropped = self._drop_stale(samples) if self.pipelined else (0, 0)
        samples, train_samples = self._train(samples, record)
        if self.pipelined:
            async_record = self._async_metrics(rollout, train_samples, dropped, trainer_wait_s or 0.0)
        t_learned = time.perf_counter()
        self._publish(step, record)  # before the logging: the asynchronous producer may be waiting for these weights
        t_update = time.perf_counter() - t1
        timing = {"timing/collect_s": rollout.rollout_s, "timing/learn_s": t_learned - t1,
                  "timing/publish_s": t_update - (t_learned - t1)}
        rewards = torch.tensor([s.reward for s in train_samples])
        lengths = torch.tensor([len(s.completion_ids) for s in train_samples], dtype=torch.float32)
        gen_tokens = sum(len(s.completion_ids) for s in samples)
        record.update({
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "reward_max": float(rewards.max()), "completion_len": float(lengths.mean()),
            "eos_frac": sum(s.finish_reason == "eos" for s in train_samples) / len(train_samples),
            "engine_calls": rollout.engine_calls, "rollout_s": rollout.rollout_s, "update_s": t_update,
            "rollout_tokens_per_s": gen_tokens / max(rollout.rollout_s, 1e-9), "data_position": self.data_position,
        })
        if self.pipelined:
            record.update(async_record)
        endpoint_metrics = getattr(self.engine, "metrics", None)  # a pool of rollout servers: pool/endpoints_live
        if callable(endpoint_metrics):
            record.update(endpoint_metrics())
        if len(self.roles) > 1:
            record.update(self._role_metrics(train_samples, self.last_role_stats, record))
        algorithm = rollout.algorithm
        record.update(algorithm.metrics(train_samples))
        finished = list(algorithm.finished)
        for k, v in self._workflow_stats(finished).items():
            record.setdefault(k, v)  # a statistic named like one of the trainer's own keeps the trainer's value
        baselines = [s for s in samples if s.baseline]
        if baselines:
            record["greedy_reward_mean"] = sum(s.reward for s in baselines) / len(baselines)
        if self.cfg.run.log_episodes:
            ep_dir = self.run_dir / "episodes"
            ep_dir.mkdir(exist_ok=True)
            with (ep_dir / f"step_{step:06d}.jsonl").open("w") as f:
                for s in samples:
                    f.write(json.dumps(s.to_record()) + "\n")
            if finished:  # one line per episode that ran to its end: its outcome and the workflow's stats
                with (ep_dir / f"outcomes_{step:06d}.jsonl").open("w") as f:
                    for e in finished:
                        f.write(episode_outcome_line(e) + "\n")
        if self.eval_task is not None and step % self.cfg.train.eval_every == 0:
            t_eval = time.perf_counter()
            record.update(self._evaluate_and_watch(step))
            timing["timing/evaluate_s"] = time.perf_counter() - t_eval
        record.update(timing)
        self.step = step
        self.metrics.log(record)
        if step % self.cfg.run.save_every == 0 or step == self.cfg.train.steps or self.stopped_at_cliff:
            # the data position and algorithm state of this step's rollout: a resumed run produces the next one from them
            state = {"data_position": self.data_position}
            algorithm_state = algorithm.state_dict()
            if algorithm_state:
                state["algorithm"] = algorithm_state
            save_checkpoint(self.ckpt_dir, step, self.placement, state, keep=self.cfg.run.keep_checkpoints)
        return record

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
            return NothingToTrain(f"workflow {name!r}: no episode of step {step} called the model (problems {shown}); each "
                                  "episode must sample at least one completion with await ctx.generate(role, messages) "
                                  "(a gateway workflow: call its endpoint) for there to be anything to train")
        return NothingToTrain(f"workflow {name!r}: none of the {len(samples)} samples of step {step} is trainable (all "
                              "are greedy baselines or frozen roles'); nothing to train")

    def _role_metrics(self, samples: list[Sample], role_stats: dict[str, float], record: dict[str, Any]) -> dict[str, float]:
        """Per declared role (its instances ``generator0..`` included): reward, response length and,
        when measured, loss, entropy, gradient norm and role capture (share of the summed gradient norms)."""
        out: dict[str, float] = {}
        types = list(dict.fromkeys(self.roles))
        for t in types:
            own = [s for s in samples if declared_role(s.role, types) == t]
            if own:
                out[f"reward/{t}"] = sum(s.reward for s in own) / len(own)
                out[f"completion_len/{t}"] = sum(len(s.completion_ids) for s in own) / len(own)
        norms = {t: role_stats[f"grad_norm@{t}"] for t in types if f"grad_norm@{t}" in role_stats}
        for t in types:
            for k in ("loss", "entropy"):
                if f"{k}@{t}" in role_stats:
                    out[f"role_{k}/{t}"] = role_stats[f"{k}@{t}"]
        if not norms and self.cfg.policy.mode != "shared":  # one policy per role type: its norm is the role's
            norms = {t: record[f"grad_norm/{self.route(t)}"] for t in types if f"grad_norm/{self.route(t)}" in record}
        for t, v in norms.items():
            out[f"role_grad_norm/{t}"] = v
        if len(norms) > 1 and sum(norms.values()) > 0:  # no gradient (all advantages 0): capture is undefined
            out.update({f"role_capture/{t}": v for t, v in role_capture(norms).items()})
        return out

    def evaluate_accuracy(self) -> dict[str, float]:
        """Greedy accuracy (and the workflow diagnostics) on the held-out problems: one episode each."""
        problems = self.eval_task.problems()[:self.cfg.train.eval_problems]
        scheduler = GenerationScheduler(self.engine, seed=derive_seed(self.cfg.seed, self.step, 2))
        def make_ctx(problem: Problem, episode: int, tags: dict) -> EpisodeContext:
            return EpisodeContext(scheduler, self.route, self.tokenizer, self.greedy_params, problem.id, episode, tags)

        return {f"eval/{k}": v for k, v in self.algorithm.evaluate(problems, self.eval_task, make_ctx, scheduler.run).items()}

    def _evaluate_and_watch(self, step: int) -> dict[str, Any]:
        """Evaluate, update the running peak; keep the best checkpoint; warn (and stop) at a cliff."""
        from tqdm import tqdm

        if self._pipeline is not None:  # the engine between two rollouts, holding this step's weights
            with self._pipeline.exclusive():
                out: dict[str, Any] = self.evaluate_accuracy()
        else:
            out = self.evaluate_accuracy()
        event = self.cliffs.update(step, out["eval/accuracy"])
        out["eval/peak_accuracy"] = event.peak
        if event.kind == "peak" and step > 0:
            save_checkpoint(self.run_dir / "best", step, self.placement, {"data_position": self.data_position,
                                                                      "eval_accuracy": event.accuracy}, keep=1)
        if event.kind == "cliff":
            out["eval/cliff"] = 1
            tqdm.write(f"warning: accuracy cliff at step {step}: eval accuracy {event.accuracy:.3f} is {event.drop_points:.1f} "
                       f"points under its peak {event.peak:.3f} (step {event.peak_step}); the best checkpoint is in "
                       f"{self.run_dir / 'best'}" + ("; stopping (train.cliff_stop)" if self.cfg.train.cliff_stop else ""),
                       file=sys.stderr)
            self.stopped_at_cliff = self.cfg.train.cliff_stop
        return out

    def _rollout(self, problems: list[Problem], make_ctx, scheduler: GenerationScheduler) -> list[Sample]:
        """Every sample of this step's rollouts, with rewards and groups."""
        return self.algorithm.rollout(problems, self.task, make_ctx, scheduler.run)

    def _train(self, samples: list[Sample], record: dict[str, Any]) -> tuple[list[Sample], list[Sample]]:
        """Advantages and the updates (stats into ``record``, per-role statistics into
        ``last_role_stats``); returns (samples to log, trained samples)."""
        train_samples = self._assign_advantages(samples)
        # how much of the batch can teach anything: groups with a non-zero advantage, samples the update computes
        record.update(learning_signal(train_samples, self.roles, lambda s: _contributes(s, self.update_settings.loss)))
        if self.cfg.train.nonfinite_reward == "drop_group":
            record["nonfinite_groups_dropped"] = self.nonfinite_groups_dropped
        role_stats: dict[str, list[float]] = {}
        parts_by_policy = {}
        for name in self.router.policies:
            own = [s for s in train_samples if s.policy == name]
            # One optimizer step per policy, or (equalize_steps false) one per role instance in turn.
            parts_by_policy[name] = [own] if self.cfg.policy.equalize_steps else [[s for s in own if s.role == r] for r in dict.fromkeys(s.role for s in own)]
        # with several steps, each is clipped against the weights that sampled (old log-probs taken before the first);
        # every worker updates its policies at once, and the driver's copies are synced after (the asynchronous loop
        # publishes the new weights instead: the producer loads them at a rollout boundary)
        mode = self.update_settings.loss.importance_correction
        if mode != "none" and self.placement.remote:  # update_policy checks too; on the driver, a Ray worker's error
            check_sampling_logprobs(train_samples, mode)  # would come back wrapped in its remote traceback
        steps = self.placement.update(parts_by_policy, self.update_settings, self.tokenizer.pad_token_id, self.eos_ids)
        for name, parts in parts_by_policy.items():
            policy_stats: dict[str, list[float]] = {}
            for part_stats in steps[name]:
                for k, v in part_stats.items():
                    if "@" in k:
                        role_stats.setdefault(k, []).append(v)
                    elif k not in IMPORTANCE_STATS:  # those are of every step's weights (below)
                        policy_stats.setdefault(k, []).append(v)
            record.update({f"{k}/{name}": over_steps(k, v) for k, v in policy_stats.items()})
            record.update({f"{k}/{name}": v for k, v in combine_importance_stats(steps[name]).items()})
            record[f"optimizer_steps/{name}"] = len([p for p in parts if p]) - int(record.get(f"skipped_steps/{name}", 0))
        self.last_role_stats = {k: over_steps(k.split("@", 1)[0], v) for k, v in role_stats.items()}
        return samples, train_samples

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
                raise NonFiniteReward(f"task {self.task.name!r}: every group of step {self.step + 1} has a NaN/inf reward; "
                                      "nothing is left to train on")
        rewards = torch.tensor([s.reward for s in train], dtype=torch.float32)
        ids = group_ids_from_keys([s.group for s in train])
        baselines = None
        if self.cfg.train.advantage == "max":
            greedy = {s.group: s.reward for s in samples if s.baseline}
            baselines = torch.tensor([greedy[s.group] for s in train], dtype=torch.float32)
        # the turns of one rollout marked as one trajectory (M-GRPO) count once in their group's statistics
        adv = trajectory_advantages(rewards, ids, trajectory_ids([s.trajectory for s in train]), self.cfg.train.advantage,
                                    eps=self.cfg.train.advantage_eps, baselines=baselines)
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
        """Stop the rollout producer (asynchronous loop), the policy workers (Ray actors), unload this run's adapters
        from a rollout server and stop the vLLM server the run started (``rollout.engine=vllm``); the run directory and
        its checkpoints stay as they are."""
        self._stop_pipeline()  # first: the producer uses the engine
        close = getattr(getattr(self, "engine", None), "close", None)
        try:
            if close is not None:
                close()
        finally:
            try:
                self._stop_vllm_server()  # after the adapters are unloaded from it
                self.placement.shutdown()
            finally:
                if getattr(self, "_locked", False):
                    self._locked = False
                    unlock_run_dir(self.run_dir)

    def _train_loop(self) -> list[dict[str, Any]]:
        from tqdm import tqdm

        total = self.cfg.train.steps
        bar = tqdm(total=total, initial=self.step, desc=f"train {self.cfg.name}", unit="step",
                   disable=not self.cfg.run.progress, file=sys.stderr, dynamic_ncols=True)
        if self.eval_task is not None and self.step == 0:  # the untrained workflow's accuracy starts the running peak
            self.metrics.log({"step": 0, **self._evaluate_and_watch(0)})
        while self.step < total and not self.stopped_at_cliff:
            rec = self.train_step()
            bar.update(1)
            bar.set_postfix(reward=f"{rec.get('normalised_return', rec['reward_mean']):.3f}", len=f"{rec['completion_len']:.0f}",
                            loss=f"{next((v for k, v in rec.items() if k.startswith('loss/')), 0.0):+.3f}")
        bar.close()
        self.metrics.close()
        return read_metrics(self.run_dir / "metrics.jsonl")
