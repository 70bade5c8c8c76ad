"""The learner: the one interface through which the trainer updates its policies, wherever they live.

A :class:`Learner` holds every policy's trainable weights and optimizer and answers typed calls:

- :meth:`~Learner.update` (a :class:`LearnBatch`: each policy's samples, split into optimizer steps) -> each
  policy's per-step statistics;
- :meth:`~Learner.version` (how many times a policy's weights changed) and :meth:`~Learner.weights` (a CPU copy of
  its trainable weights: what a weight sync publishes);
- :meth:`~Learner.state` / :meth:`~Learner.load_state` (weights and optimizer: what a checkpoint holds).

Two learners stand behind it (``policy.placement``):

- :class:`LocalLearner` (``local``): one :class:`PolicyWorker` in this process.
- :class:`RayLearner` (``ray``): one Ray actor per worker (``policy.workers``, default one per policy), each with the
  resources ``policy.resources.<worker>`` asks for. Calls to several actors run at once; every wait has a timeout
  (``policy.ray_timeout_s``) and a dead or silent actor is a :class:`WorkerFailed` naming it. The actors are not
  detached: they die with the driver.

A :class:`PolicyWorker` owns the policies of one router (they share its base model and device); a
:class:`RayPolicyWorker` is the same worker built inside a Ray actor's process. Only samples, weights (adapters, for a
LoRA) and optimizer states cross between processes.

The learner never touches what rollouts sample from: new weights reach the rollout engine only through
:mod:`teamrl.trainer.weight_sync`.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from teamrl.core.config import Config, ConfigError
from teamrl.core.memory import trim_freed_memory
from teamrl.core.ray_cluster import start_ray
from teamrl.core.sample import Sample
from teamrl.policies.router import PolicyRouter
from teamrl.trainer.update import UpdateParams, update_policy_steps

# What a worker asks of Ray when policy.resources does not name it.
DEFAULT_WORKER_RESOURCES = {"num_cpus": 1}


class WorkerFailed(RuntimeError):
    """A policy worker died or did not answer in time; the message names it."""


def make_router(cfg: Config, roles: Sequence[str], role_map: dict[str, str] | None = None) -> PolicyRouter:
    """The router ``cfg`` asks for, for ``roles`` (``role_map``: a part of ``policy.roles``; default all of it)."""
    p = cfg.policy
    role_map = dict(p.roles) if role_map is None else role_map
    return PolicyRouter(p.mode, list(roles), cfg.model, p.lora, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                        seed=cfg.seed, need_reference=(cfg.train.loss.kl_coef or 0) > 0, device=p.device, dtype=p.dtype,
                        role_map=role_map or None)


def roles_of(router: PolicyRouter, roles: Sequence[str], role_map: dict[str, str],
             policies: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The roles that act with ``policies`` and their part of ``role_map``: what a worker holding only those builds."""
    return ([r for r in roles if router.policy_name(r) in policies],
            {r: name for r, name in role_map.items() if name in policies})


class PolicyWorker:
    """Owns the policies of one router (they share its base model and device) and updates them on request."""

    def __init__(self, router: PolicyRouter) -> None:
        self.router = router

    def policy(self, name: str):
        """Policy ``name``; a policy this worker does not hold is a KeyError naming the ones it holds."""
        if name not in self.router.policies:
            raise KeyError(f"policy {name!r} is not on this worker; it holds {sorted(self.router.policies)}")
        return self.router.policies[name]

    def policies(self) -> list[str]:
        """The names of the policies this worker holds (also proves that it is up)."""
        return list(self.router.policies)

    def update(self, name: str, parts: Sequence[Sequence[Sample]], params: UpdateParams, pad_id: int,
               eos_ids: Sequence[int]) -> dict[str, Any]:
        """One optimizer step of policy ``name`` per non-empty part (see :func:`update_policy_steps`).

        Returns ``{"steps": each step's statistics, "version": the policy's weight version after them}``.
        """
        policy = self.policy(name)
        steps = update_policy_steps(policy, parts, params, pad_id, eos_ids)
        trim_freed_memory()  # the update's freed activations would stay resident under the next rollout
        return {"steps": steps, "version": policy.version}

    def version(self, name: str) -> int:
        """How many times policy ``name``'s weights changed (steps and loads)."""
        return self.policy(name).version

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """Policy ``name``'s trainable weights (its adapter for a LoRA), as CPU copies."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.policy(name).named_state().items()}

    def load_adapter_state(self, name: str, state: dict[str, torch.Tensor]) -> int:
        """Replace policy ``name``'s trainable weights; returns its new version."""
        policy = self.policy(name)
        policy.load_named_state(state)
        return policy.version

    def set_reference(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Make ``state`` (policy ``name``'s own weights by name: its warm start) its KL reference."""
        self.policy(name).set_reference(state)

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """Policy ``name``'s optimizer state (for a checkpoint)."""
        return self.policy(name).optimizer.state_dict()

    def load_optimizer_state(self, name: str, state: dict[str, Any]) -> None:
        """Restore policy ``name``'s optimizer state (from a checkpoint)."""
        self.policy(name).load_optimizer_state(state)

    def where(self) -> dict[str, Any]:
        """Where this worker runs: Ray node id (empty outside Ray), process id and the policies' device."""
        node = ""
        try:
            import ray

            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"node_id": node, "pid": os.getpid(), "device": str(self.router.device)}


class RayPolicyWorker(PolicyWorker):
    """A :class:`PolicyWorker` that builds its own router inside its Ray actor's process."""

    def __init__(self, cfg: Config, roles: list[str], role_map: dict[str, str]) -> None:
        torch.set_num_threads(cfg.threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
        super().__init__(make_router(cfg, roles, role_map))


def worker_groups(cfg: Config, policies: Sequence[str]) -> dict[str, list[str]]:
    """Worker name -> the policies it holds: ``policy.workers``, else one worker per policy (checked against
    ``policies``)."""
    groups = {w: list(names) for w, names in cfg.policy.workers.items()} or {p: [p] for p in policies}
    placed = [n for names in groups.values() for n in names]
    unknown = [n for n in placed if n not in policies]
    if unknown:
        raise ConfigError(f"policy.workers: policy {unknown[0]!r} does not exist; the policies are {list(policies)}")
    missing = [p for p in policies if p not in placed]
    if missing:
        raise ConfigError(f"policy.workers: policies {missing} are on no worker; list every one of {list(policies)}")
    for key in ("resources", "ranks"):
        extra = [w for w in getattr(cfg.policy, key) if w not in groups]
        if extra:
            raise ConfigError(f"policy.{key}: {extra[0]!r} is not a worker; the workers are {list(groups)}")
    return groups


def own_copy(router: PolicyRouter) -> PolicyRouter:
    """A second router for the local worker (the asynchronous loop), a copy of ``router``: its own trainable weights
    (adapters, or a whole model), optimizers and modules. The weights no policy trains (a LoRA's base, a KL reference)
    are the same tensors in both, read and never written by either; the tokenizer is shared too. The trainable ones
    are copies, every adapter of a base that holds several (``lora_per_role``) included: the update must never write
    the weights a rollout is reading. Which weights a policy trains is its own list, not ``requires_grad`` (PEFT
    freezes the adapters it is not computing with)."""
    trained = {id(p) for policy in router.policies.values() for p in policy.parameters()}
    shared: dict[int, Any] = {id(router.tokenizer): router.tokenizer}
    for policy in router.policies.values():
        for model in (policy.model, policy.reference_model):
            for p in (model.parameters() if model is not None else ()):
                if id(p) not in trained:
                    shared[id(p)] = p
        policy_merged = getattr(policy, "_merged", None)
        if policy_merged is not None:  # the sampling copy is the driver's alone
            shared[id(policy_merged)] = None
    return copy.deepcopy(router, memo=shared)


def actor_options(cfg: Config, worker: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Ray actor options of one process of ``worker`` (``policy.resources.<worker>``, default
    :data:`DEFAULT_WORKER_RESOURCES`): its resources, no restarts, and an environment that imports this very teamrl
    (not another install) and keeps to its CPU share. Returns (options, the resources it asks for)."""
    res = dict(cfg.policy.resources.get(worker, DEFAULT_WORKER_RESOURCES))
    threads = cfg.threads or max(1, int(res.get("num_cpus", 1)))
    env = {
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": str(threads),
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
    }
    asked = {"num_cpus": res.pop("num_cpus", 1), **res}
    return {"runtime_env": {"env_vars": env}, "max_restarts": 0, **asked}, asked


def start_actors(cfg: Config, groups: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, tuple[Any, dict]]:
    """One Ray actor per worker (``groups``: its roles and role map), with the resources ``policy.resources``
    asks for; starts Ray if none runs in this process. Worker name -> (actor handle, the resources it asked for)."""
    import ray

    start_ray(cfg.policy.ray_address)
    actor_cls = ray.remote(RayPolicyWorker)
    actors = {}
    for worker, (roles, role_map) in groups.items():
        options, asked = actor_options(cfg, worker)
        actors[worker] = (actor_cls.options(**options).remote(cfg, roles, role_map), asked)
    return actors


# Statistics of one optimizer step, by name (loss, grad_norm, tokens, ...; per role as ``name@role``).
StepStats = dict[str, float]
# A policy's weights and optimizer state, as a checkpoint holds them.
PolicyState = tuple[dict[str, torch.Tensor], dict[str, Any]]


@dataclass
class LearnBatch:
    """What one learn phase trains: each policy's samples split into its optimizer steps (one part per step), with
    the update's parameters and the tokenizer ids the loss mask needs."""

    parts: dict[str, list[list[Sample]]]
    params: UpdateParams
    pad_id: int
    eos_ids: tuple[int, ...]


class Learner(Protocol):
    """Every policy's weights and optimizer, updated by the trainer (module docstring)."""

    remote: bool  # the policies live in other processes (their errors come back wrapped)

    def policy_names(self) -> list[str]: ...

    def update(self, batch: LearnBatch) -> dict[str, list[StepStats]]: ...

    def version(self, name: str) -> int: ...

    def weights(self, name: str) -> dict[str, torch.Tensor]: ...

    def state(self, name: str) -> PolicyState: ...

    def load_state(self, name: str, weights: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None: ...

    def set_reference(self, name: str, weights: dict[str, torch.Tensor]) -> None: ...

    def where(self) -> dict[str, dict[str, Any]]: ...

    def shutdown(self) -> None: ...


class LocalLearner:
    """The policies of one router in this process (``router``: the driver's own, or its copy when rollouts sample
    from a separate one)."""

    remote = False

    def __init__(self, router: PolicyRouter) -> None:
        self.router = router
        self.worker = PolicyWorker(router)

    def policy_names(self) -> list[str]:
        return list(self.router.policies)

    def update(self, batch: LearnBatch) -> dict[str, list[StepStats]]:
        return {name: self.worker.update(name, parts, batch.params, batch.pad_id, batch.eos_ids)["steps"]
                for name, parts in batch.parts.items()}

    def version(self, name: str) -> int:
        return self.worker.version(name)

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return self.worker.adapter_state(name)

    def state(self, name: str) -> PolicyState:
        policy = self.worker.policy(name)
        return policy.named_state(), policy.optimizer.state_dict()

    def load_state(self, name: str, weights: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
        self.worker.load_adapter_state(name, weights)
        self.worker.load_optimizer_state(name, optimizer)

    def set_reference(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        self.worker.set_reference(name, weights)

    def where(self) -> dict[str, dict[str, Any]]:
        return {"local": self.worker.where()}

    def shutdown(self) -> None:
        """Nothing runs elsewhere."""


class RayLearner:
    """The policies on Ray actors (module docstring); ``router`` is the driver's, whose initial weights every actor
    takes, so both placements train the same weights from the same seed."""

    remote = True

    def __init__(self, cfg: Config, router: PolicyRouter, roles: Sequence[str]) -> None:
        import ray

        self.timeout = cfg.policy.ray_timeout_s
        groups = worker_groups(cfg, list(router.policies))
        started = start_actors(
            cfg, {w: roles_of(router, roles, dict(cfg.policy.roles), names) for w, names in groups.items()}
        )
        self.actors = {w: actor for w, (actor, _) in started.items()}
        self.worker_of = {name: w for w, names in groups.items() for name in names}
        self._names = list(router.policies)
        self._versions: dict[str, int] = {}  # policy -> its version on its actor, as last reported
        try:
            for w, actor in self.actors.items():  # fail here, naming the worker, when one cannot start
                try:
                    self._get(w, actor.policies.remote())
                except WorkerFailed as e:
                    if not isinstance(e.__cause__, ray.exceptions.GetTimeoutError):
                        raise
                    raise WorkerFailed(
                        f"policy worker {w!r} did not start within policy.ray_timeout_s={self.timeout:g} s; "
                        f"it asks Ray for {started[w][1]} (policy.resources.{w}): does the cluster offer "
                        "that (ray status)?"
                    ) from e
            futures = {name: self._actor(name).load_adapter_state.remote(name, router.policies[name].named_state())
                       for name in self._names}
            self._versions = {name: self._get(self.worker_of[name], f) for name, f in futures.items()}
        except BaseException:
            self.shutdown()
            raise

    def _actor(self, policy: str) -> Any:
        return self.actors[self.worker_of[policy]]

    def _get(self, worker: str, future: Any) -> Any:
        """The value of a Ray call on ``worker``'s actor; a dead or silent actor raises :class:`WorkerFailed`."""
        import ray

        try:
            return ray.get(future, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerFailed(
                f"policy worker {worker!r}: no answer within policy.ray_timeout_s={self.timeout:g} s"
            ) from e
        except ray.exceptions.RayActorError as e:
            raise WorkerFailed(
                f"policy worker {worker!r} died ({type(e).__name__}); the run cannot continue: restart it "
                "with --resume to continue from the last checkpoint"
            ) from e

    def _call(self, policy: str, future: Any) -> Any:
        return self._get(self.worker_of[policy], future)

    def policy_names(self) -> list[str]:
        return list(self._names)

    def update(self, batch: LearnBatch) -> dict[str, list[StepStats]]:
        """Every policy's steps at once (one call per policy, the actors concurrently)."""
        futures = {name: self._actor(name).update.remote(name, parts, batch.params, batch.pad_id, list(batch.eos_ids))
                   for name, parts in batch.parts.items()}
        out = {}
        for name, future in futures.items():
            result = self._call(name, future)
            out[name] = result["steps"]
            self._versions[name] = result["version"]
        return out

    def version(self, name: str) -> int:
        """The version the actor reported with its last update or load (no round trip)."""
        return self._versions[name]

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return self._call(name, self._actor(name).adapter_state.remote(name))

    def state(self, name: str) -> PolicyState:
        actor = self._actor(name)
        weights, optim = actor.adapter_state.remote(name), actor.optimizer_state.remote(name)
        return self._call(name, weights), self._call(name, optim)

    def load_state(self, name: str, weights: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
        actor = self._actor(name)
        self._versions[name] = self._call(name, actor.load_adapter_state.remote(name, weights))
        self._call(name, actor.load_optimizer_state.remote(name, optimizer))

    def set_reference(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        self._call(name, self._actor(name).set_reference.remote(name, weights))

    def where(self) -> dict[str, dict[str, Any]]:
        """Worker name -> where it runs (:meth:`PolicyWorker.where`)."""
        return {w: self._get(w, actor.where.remote()) for w, actor in self.actors.items()}

    def shutdown(self) -> None:
        """Stop the Ray actors (the Ray runtime itself is left to whoever started it)."""
        import ray

        for actor in getattr(self, "actors", {}).values():
            try:
                ray.kill(actor)
            except ray.exceptions.RayError:  # already dead: nothing to stop
                pass

