"""Decoupled M-GRPO training: one worker per agent, each with its own model and optimizer, and a trajectory store.

``m_grpo.decoupled``:

- ``inprocess``: the workers and the store are plain objects in the trainer's process;
- ``ray``: each :class:`PolicyWorker` and the :class:`TrajectoryStore` is a Ray actor (its own
  process; Ray is imported only here, only in this mode).

Both modes run the same classes and the same code, so for a fixed seed they give the same
losses and weights (tested). A step: the trainer runs the rollouts (the workflow and the
environment live in the trainer; each agent's generation is a call to its own worker, which
samples with its current weights); it puts the main trajectories, the raw sub-agent
trajectories and the reward statistics (each rollout's main reward, the alignment seed) into
the store. Then every worker, at the same time, takes its own trajectories from the store,
finishes their rewards (the sub-agent worker: :func:`~teamrl.algorithms.m_grpo.prepare_sub_samples`,
i.e. the main outcome gated by format, and trajectory alignment), computes group-relative
advantages over its own samples and takes one optimizer step. Only trajectories and reward
statistics cross between processes; gradients and weights never do.

Advantages are normalised per worker, over that agent's samples; for the group modes this is
what the single-process trainer computes too (main and sub groups never mix); ``batch``
normalises over each agent's own batch here. ``train.advantage: max`` is not supported.

A dead or silent Ray actor raises :class:`WorkerFailed` naming it (``ray.get`` has a timeout,
``m_grpo.ray_timeout_s``), never a hang.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import torch

from teamrl.algorithms.m_grpo import prepare_sub_samples
from teamrl.core.config import Config, ConfigError
from teamrl.core.sample import Sample, check_steering_tags
from teamrl.core.seeding import derive_seed
from teamrl.losses import group_ids_from_keys, trajectory_advantages, trajectory_ids
from teamrl.policies.router import PolicyRouter
from teamrl.rollout.engine import Completion, Engine, GenerationRequest
from teamrl.rollout.hf_engine import HFEngine
from teamrl.tasks.task import Problem
from teamrl.trainer.trainer import Trainer
from teamrl.trainer.update import NonFiniteReward, make_update_settings, nonfinite_reward_groups, update_policy

DECOUPLED_MODES = ("inprocess", "ray")
AGENT_INDEX = {"main": 0, "sub": 1}  # seeds each worker's initialisation


class WorkerFailed(RuntimeError):
    """A decoupled worker or the store died or did not answer in time; the message names it."""


class TrajectoryStore:
    """Trajectories per (step, agent) and reward statistics per step: all that crosses between workers."""

    def __init__(self) -> None:
        self._trajectories: dict[tuple[int, str], list[Sample]] = {}
        self._stats: dict[int, dict[str, Any]] = {}

    def put(self, step: int, agent: str, samples: list[Sample]) -> int:
        """Store ``agent``'s trajectories of ``step``; returns how many samples."""
        self._trajectories[(step, agent)] = list(samples)
        return len(samples)

    def take(self, step: int, agent: str) -> list[Sample]:
        """Remove and return ``agent``'s trajectories of ``step``."""
        key = (step, agent)
        if key not in self._trajectories:
            raise KeyError(f"trajectory store: nothing for agent {agent!r} at step {step}; have {sorted(self._trajectories)}")
        return self._trajectories.pop(key)

    def put_stats(self, step: int, stats: dict[str, Any]) -> None:
        """Store the reward statistics of ``step`` (each rollout's main reward, the alignment seed)."""
        self._stats[step] = stats
        for old in [s for s in self._stats if s < step - 1]:  # keep the store small
            del self._stats[old]

    def get_stats(self, step: int) -> dict[str, Any]:
        """The reward statistics of ``step``."""
        if step not in self._stats:
            raise KeyError(f"trajectory store: no reward statistics for step {step}; have steps {sorted(self._stats)}")
        return self._stats[step]


class Handle:
    """Calls on a local object or on a Ray actor, with one error naming ``name`` if the actor fails."""

    def __init__(self, name: str, target: Any, remote: bool, timeout: float) -> None:
        self.name, self.target, self.remote, self.timeout = name, target, remote, timeout

    def submit(self, method: str, *args: Any) -> Any:
        """Start a call; on Ray it runs concurrently with other actors' calls until :meth:`result`."""
        if self.remote:
            return getattr(self.target, method).remote(*args)
        return getattr(self.target, method)(*args)

    def result(self, future: Any) -> Any:
        """The value of a :meth:`submit`; a dead or silent actor raises :class:`WorkerFailed`."""
        if not self.remote:
            return future
        import ray

        try:
            return ray.get(future, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerFailed(f"{self.name}: no answer within m_grpo.ray_timeout_s={self.timeout:g} s") from e
        except ray.exceptions.RayActorError as e:
            raise WorkerFailed(f"{self.name} died ({type(e).__name__}); the run cannot continue: "
                               "restart it with --resume to continue from the last checkpoint") from e

    def call(self, method: str, *args: Any) -> Any:
        """A blocking call."""
        return self.result(self.submit(method, *args))


class PolicyWorker:
    """One agent's trainer: its own model (a base with one LoRA adapter, or full weights), optimizer and engine.

    ``store`` is the :class:`TrajectoryStore` (a local object, or a Ray actor handle when
    ``remote``). The sub-agent's worker finishes its samples' rewards from the store's reward
    statistics before computing advantages.
    """

    def __init__(self, agent: str, cfg: Config, store: Any, remote: bool) -> None:
        if agent not in AGENT_INDEX:
            raise ValueError(f"PolicyWorker agent {agent!r}: choose one of {list(AGENT_INDEX)}")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.agent, self.cfg = agent, cfg
        self.store = Handle("trajectory store", store, remote, cfg.m_grpo.ray_timeout_s)
        torch.manual_seed(derive_seed(cfg.seed, AGENT_INDEX[agent]))  # LoRA initialisation, the same in every mode
        router = PolicyRouter("separate", [agent], cfg.model, cfg.policy.lora, lr=cfg.train.lr,
                              weight_decay=cfg.train.weight_decay, seed=cfg.seed, need_reference=cfg.train.loss.kl_coef > 0)
        self.policy = router.policies[agent]
        self.tokenizer = router.tokenizer
        self.engine = HFEngine(lambda name: self.policy.generation_model(), self.tokenizer)
        self.settings = make_update_settings(cfg)

    def get_tokenizer(self) -> Any:
        """The tokenizer (the trainer encodes prompts with it)."""
        return self.tokenizer

    def generate(self, requests: Sequence[GenerationRequest], seed: int | None) -> list[list[Completion]]:
        """Sample with this agent's current weights."""
        return self.engine.generate(self.agent, requests, seed)

    def train(self, step: int) -> dict[str, Any]:
        """Take this agent's trajectories of ``step`` from the store, finish rewards, advantages, one update.

        Returns ``{"stats": loss statistics, "samples": every sample with its reward and advantage}``.
        """
        samples = self.store.call("take", step, self.agent)
        if self.agent == "sub":
            stats = self.store.call("get_stats", step)
            m = self.cfg.m_grpo
            samples = prepare_sub_samples(samples, stats["outcomes"], m.d_max, m.sub_reward, stats["seed"],
                                          frozen=m.sub_agent == "frozen")
        check_steering_tags(samples)
        train = [s for s in samples if s.trainable]
        dropped = nonfinite_reward_groups(train, self.cfg.task["name"], self.cfg.train.nonfinite_reward)
        for s in train:
            if s.group in dropped:
                s.trainable = False  # left out of the update and of the trained samples' metrics
        train = [s for s in train if s.group not in dropped]
        dropped_stats = {"nonfinite_groups_dropped": float(len(dropped))} if self.cfg.train.nonfinite_reward == "drop_group" else {}
        if not train:
            return {"stats": dropped_stats, "samples": samples}
        rewards = torch.tensor([s.reward for s in train], dtype=torch.float32)
        adv = trajectory_advantages(rewards, group_ids_from_keys([s.group for s in train]),
                                    trajectory_ids([s.trajectory for s in train]), self.cfg.train.advantage,
                                    eps=self.cfg.train.advantage_eps)
        for s, a in zip(train, adv.tolist()):
            s.advantage = a
        stats = update_policy(self.policy, train, self.settings, self.tokenizer.pad_token_id, [self.tokenizer.eos_token_id])
        return {"stats": {**stats, **dropped_stats}, "samples": samples}

    def named_state(self) -> dict[str, torch.Tensor]:
        """This agent's trainable weights (copies)."""
        return {k: v.clone() for k, v in self.policy.named_state().items()}

    def load_named_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore this agent's trainable weights (from a checkpoint)."""
        self.policy.load_named_state(state)

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state (for a checkpoint)."""
        return self.policy.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore the optimizer's state (from a checkpoint)."""
        self.policy.optimizer.load_state_dict(state)

    def ping(self) -> str:
        """The agent's name: proves the worker is up."""
        return self.agent


class WorkerEngine(Engine):
    """The trainer's engine in decoupled mode: each policy's generation is a call to that agent's worker."""

    def __init__(self, workers: dict[str, Handle]) -> None:
        self.workers = workers

    def generate(self, policy: str, requests: Sequence[GenerationRequest], seed: int | None = None) -> list[list[Completion]]:
        if policy not in self.workers:
            raise KeyError(f"no worker for policy {policy!r}; workers: {sorted(self.workers)}")
        return self.workers[policy].call("generate", list(requests), seed)


def _policy_view(worker: Handle) -> SimpleNamespace:
    """What checkpoints need of a policy, forwarded to its worker (weights and optimizer state)."""
    optimizer = SimpleNamespace(state_dict=lambda: worker.call("optimizer_state"),
                                load_state_dict=lambda st: worker.call("load_optimizer_state", st))
    return SimpleNamespace(named_state=lambda: worker.call("named_state"),
                           load_named_state=lambda st: worker.call("load_named_state", st), optimizer=optimizer)


class DecoupledTrainer(Trainer):
    """The M-GRPO trainer with one worker per agent (``m_grpo.decoupled: inprocess | ray``); see the module docstring."""

    def _build_policies(self) -> None:
        cfg = self.cfg
        mode = cfg.m_grpo.decoupled
        if cfg.algorithm != "m_grpo" or mode not in DECOUPLED_MODES:
            raise ConfigError(f"m_grpo.decoupled: {mode!r} with algorithm {cfg.algorithm!r}; "
                              f"the decoupled trainer needs algorithm m_grpo and one of {list(DECOUPLED_MODES)}")
        if cfg.train.advantage == "max":
            raise ConfigError("train.advantage: max needs greedy baseline rollouts, which decoupled M-GRPO does not run; "
                              "choose group, rloo, mean, batch or none")
        remote = mode == "ray"
        timeout = cfg.m_grpo.ray_timeout_s
        if remote:
            store, workers = self._ray_actors()
        else:
            store = TrajectoryStore()
            workers = {a: PolicyWorker(a, cfg, store, False) for a in self.roles}
        self.store = Handle("trajectory store", store, remote, timeout)
        self.workers = {a: Handle(f"policy worker {a!r}", w, remote, timeout) for a, w in workers.items()}
        self.tokenizer = self.workers[self.roles[0]].call("get_tokenizer")
        self.route = lambda role: role  # each agent is its own policy, on its own worker
        self.router = SimpleNamespace(policies={a: _policy_view(w) for a, w in self.workers.items()})

    def _make_engine(self) -> Engine:
        return WorkerEngine(self.workers)

    def _ray_actors(self) -> tuple[Any, dict[str, Any]]:
        import ray

        cfg = self.cfg
        if not ray.is_initialized():
            ray.init(address=cfg.m_grpo.ray_address or None, include_dashboard=False, log_to_driver=False)
        # Workers import this very teamrl (not another install) and keep to their CPU share.
        env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
               "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(cfg.threads or 1), "TOKENIZERS_PARALLELISM": "false"}
        opts = {"runtime_env": {"env_vars": env}, "max_restarts": 0}
        store = ray.remote(TrajectoryStore).options(num_cpus=0, **opts).remote()
        worker_cls = ray.remote(PolicyWorker)
        workers = {a: worker_cls.options(num_cpus=1, **opts).remote(a, cfg, store, True) for a in self.roles}
        for a, w in workers.items():  # fail here, naming the worker, if one cannot start
            Handle(f"policy worker {a!r}", w, True, cfg.m_grpo.ray_timeout_s).call("ping")
        return store, workers

    def _rollout(self, problems: list[Problem], make_ctx, scheduler) -> list[Sample]:
        step = self.step + 1
        raw = self.algorithm.rollout_raw(problems, self.task, make_ctx, scheduler.run)
        self.store.call("put", step, "main", raw.main)
        if "sub" in self.workers:
            self.store.call("put", step, "sub", raw.sub)
        self.store.call("put_stats", step, {"outcomes": raw.outcomes, "seed": raw.seed})
        return raw.main + raw.sub

    def _train(self, samples: list[Sample], record: dict[str, Any]) -> tuple[list[Sample], list[Sample]]:
        step = self.step + 1
        futures = {a: w.submit("train", step) for a, w in self.workers.items()}  # all agents train at once
        logged: list[Sample] = []
        for a, fut in futures.items():
            out = self.workers[a].result(fut)
            record.update({f"{k}/{a}": v for k, v in out["stats"].items()})
            logged += out["samples"]
        trained = [s for s in logged if s.trainable]
        if not trained and any(record.get(f"nonfinite_groups_dropped/{a}") for a in futures):
            raise NonFiniteReward(f"task {self.task.name!r}: every group of step {step} has a NaN/inf reward; "
                                  "nothing is left to train on")
        return logged, trained

    def train(self) -> list[dict[str, Any]]:
        """Run until ``train.steps``, then stop the Ray actors."""
        try:
            return super().train()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the Ray actors (the Ray runtime itself is left to whoever started it)."""
        if self.store.remote:
            import ray

            for h in [self.store, *self.workers.values()]:
                try:
                    ray.kill(h.target)
                except Exception:  # already dead: nothing to stop
                    pass
