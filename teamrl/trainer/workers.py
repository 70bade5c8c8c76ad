"""Policy workers: where each policy's model, adapters and optimizer live, and how the driver reaches them.

The driver (:class:`~teamrl.trainer.trainer.Trainer`) keeps the control flow: rollouts,
grouping, advantages and which policy updates when. Each policy lives on a :class:`PolicyWorker`,
which owns one or more policies that share a base (model, adapters, optimizer, device) and does
what the driver asks of them: an update from the policy's own samples, its weights for a sync or a
checkpoint, its optimizer state. ``policy.placement`` says where the workers are:

- ``local`` (default): one worker in the driver's process, holding the driver's own router; the
  rollout engine samples from the very weights the worker trains. The reference for correctness.
- ``ray``: each worker is a Ray actor with the resources ``policy.resources.<worker>`` asks for
  (GPUs, CPUs, custom node resources), holding the policies ``policy.workers.<worker>`` lists
  (default: one worker per policy). The driver keeps a copy of each policy for rollouts; after
  an update it pulls the policy's weights from its worker when the worker's version of them
  changed (and the HTTP engine sends them on to its server as usual). At start the workers take
  the driver's initial weights, so both placements train the same weights from the same seed.

With ``rollout.max_staleness`` > 0 (the asynchronous loop, :mod:`teamrl.trainer.pipeline`) the
update must not change the weights a rollout is sampling from, so the driver's router is always a
copy: with ``local`` the one worker builds its own router (started from the driver's weights), and
with either placement an update leaves the driver's copy alone. The trainer then takes a
:meth:`PolicyPlacement.snapshot` of each policy's new weights and the rollout producer loads it into
the driver's copy (:meth:`PolicyPlacement.apply`) at the start of a later rollout.

Only samples, weights (adapters, for a LoRA) and optimizer states cross between processes. A dead
or silent actor raises :class:`WorkerFailed` naming it (every ``ray.get`` has a timeout,
``policy.ray_timeout_s``), never a hang. The actors are not detached: they die with the driver.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from teamrl.core.config import Config, ConfigError
from teamrl.core.memory import trim_freed_memory
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
                        seed=cfg.seed, need_reference=cfg.train.loss.kl_coef > 0, device=p.device, dtype=p.dtype,
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

    def _policy(self, name: str):
        if name not in self.router.policies:
            raise KeyError(f"policy {name!r} is not on this worker; it holds {sorted(self.router.policies)}")
        return self.router.policies[name]

    def policies(self) -> list[str]:
        """The names of the policies this worker holds (also proves that it is up)."""
        return list(self.router.policies)

    def update(self, name: str, parts: Sequence[Sequence[Sample]], settings: UpdateParams, pad_id: int,
               eos_ids: Sequence[int]) -> dict[str, Any]:
        """One optimizer step of policy ``name`` per non-empty part (see :func:`update_policy_steps`).

        Returns ``{"steps": each step's statistics, "version": the policy's weight version after them}``.
        """
        policy = self._policy(name)
        steps = update_policy_steps(policy, parts, settings, pad_id, eos_ids)
        trim_freed_memory()  # the update's freed activations would stay resident under the next rollout
        return {"steps": steps, "version": policy.version}

    def version(self, name: str) -> int:
        """How many times policy ``name``'s weights changed (steps and loads)."""
        return self._policy(name).version

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """Policy ``name``'s trainable weights (its adapter for a LoRA), as CPU copies."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self._policy(name).named_state().items()}

    def load_adapter_state(self, name: str, state: dict[str, torch.Tensor]) -> int:
        """Replace policy ``name``'s trainable weights; returns its new version."""
        policy = self._policy(name)
        policy.load_named_state(state)
        return policy.version

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """Policy ``name``'s optimizer state (for a checkpoint)."""
        return self._policy(name).optimizer.state_dict()

    def load_optimizer_state(self, name: str, state: dict[str, Any]) -> None:
        """Restore policy ``name``'s optimizer state (from a checkpoint)."""
        self._policy(name).load_optimizer_state(state)

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


class WorkerHandle:
    """Calls on a local :class:`PolicyWorker` or on a Ray actor, with one error naming ``name`` if the actor fails."""

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
            raise WorkerFailed(f"{self.name}: no answer within policy.ray_timeout_s={self.timeout:g} s") from e
        except ray.exceptions.RayActorError as e:
            raise WorkerFailed(f"{self.name} died ({type(e).__name__}); the run cannot continue: restart it with "
                               "--resume to continue from the last checkpoint") from e

    def call(self, method: str, *args: Any) -> Any:
        """A blocking call."""
        return self.result(self.submit(method, *args))


def worker_groups(cfg: Config, policies: Sequence[str]) -> dict[str, list[str]]:
    """Worker name -> the policies it holds: ``policy.workers``, else one worker per policy (checked against ``policies``)."""
    groups = {w: list(names) for w, names in cfg.policy.workers.items()} or {p: [p] for p in policies}
    placed = [n for names in groups.values() for n in names]
    unknown = [n for n in placed if n not in policies]
    if unknown:
        raise ConfigError(f"policy.workers: policy {unknown[0]!r} does not exist; the policies are {list(policies)}")
    missing = [p for p in policies if p not in placed]
    if missing:
        raise ConfigError(f"policy.workers: policies {missing} are on no worker; list every one of {list(policies)}")
    extra = [w for w in cfg.policy.resources if w not in groups]
    if extra:
        raise ConfigError(f"policy.resources: {extra[0]!r} is not a worker; the workers are {list(groups)}")
    return groups


class PolicyPlacement:
    """The driver's view of the policy workers: updates, weight sync to the driver's copy, checkpoint parts.

    ``router`` is the driver's router (the rollout engine samples from its policies). With
    placement ``local`` it is also the one worker's; with ``ray`` it is a copy kept in sync.

    ``deferred`` (the asynchronous loop): the driver's router is a copy under either placement (with
    ``local``, the worker builds its own router and takes the driver's weights), and :meth:`update`
    leaves it alone; :meth:`snapshot` takes a policy's trained weights and :meth:`apply` loads them
    into the driver's copy when the rollout producer is ready for them.
    """

    def __init__(self, cfg: Config, router: PolicyRouter, roles: Sequence[str], deferred: bool = False) -> None:
        self.router = router
        self.remote = cfg.policy.placement == "ray"
        self.deferred = deferred
        self._trained: dict[str, int] = {}  # policy -> the version its worker reported after its last update
        timeout = cfg.policy.ray_timeout_s
        if not self.remote:
            worker_router = _own_copy(router) if deferred else router
            self.workers = {"local": WorkerHandle("policy worker 'local'", PolicyWorker(worker_router), False, timeout)}
            self.worker_of = {name: "local" for name in router.policies}
            return
        import ray

        groups = worker_groups(cfg, list(router.policies))
        actors = _start_actors(cfg, {w: roles_of(router, roles, dict(cfg.policy.roles), names) for w, names in groups.items()})
        self.workers = {w: WorkerHandle(f"policy worker {w!r}", a, True, timeout) for w, (a, _) in actors.items()}
        self.worker_of = {name: w for w, names in groups.items() for name in names}
        try:
            for w, h in self.workers.items():  # fail here, naming the worker, when one cannot start
                try:
                    h.call("policies")
                except WorkerFailed as e:
                    if not isinstance(e.__cause__, ray.exceptions.GetTimeoutError):
                        raise
                    raise WorkerFailed(f"{h.name} did not start within policy.ray_timeout_s={timeout:g} s; it asks Ray "
                                       f"for {actors[w][1]} (policy.resources.{w}): does the cluster offer that "
                                       "(ray status)?") from e
            # the workers start from the driver's weights: the same as placement local's for the same seed
            futures = {name: self._handle(name).submit("load_adapter_state", name, self.router.policies[name].named_state())
                       for name in self.router.policies}
            self._synced = {name: self._handle(name).result(f) for name, f in futures.items()}
        except BaseException:
            self.shutdown()
            raise

    def _handle(self, policy: str) -> WorkerHandle:
        return self.workers[self.worker_of[policy]]

    def update(self, parts_by_policy: dict[str, list[list[Sample]]], settings: UpdateParams, pad_id: int,
               eos_ids: Sequence[int]) -> dict[str, list[dict[str, float]]]:
        """Each policy's optimizer steps on its parts (on Ray, all workers at once); the new weights reach the driver's
        copy through :meth:`to_driver`. Returns each policy's per-step statistics, in the order of ``parts_by_policy``."""
        futures = {name: self._handle(name).submit("update", name, parts, settings, pad_id, list(eos_ids))
                   for name, parts in parts_by_policy.items()}
        out = {}
        for name, fut in futures.items():
            result = self._handle(name).result(fut)
            out[name] = result["steps"]
            self._trained[name] = result["version"]
        return out

    def to_driver(self, name: str, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Load policy ``name``'s newest weights into the driver's copy, the one rollouts sample from (the copy step of
        :class:`~teamrl.trainer.weight_sync.WeightSync`): ``weights`` (a :meth:`snapshot`) when given, else the
        worker's weights now, fetched only when it trained since the last copy. Nothing to do when the driver's router
        is the worker's own (placement local, synchronous)."""
        if weights is not None:
            self.apply(name, weights)
        elif self.remote and not self.deferred and self._trained.get(name, self._synced[name]) != self._synced[name]:
            self.router.policies[name].load_named_state(self._handle(name).call("adapter_state", name))
            self._synced[name] = self._trained[name]

    def snapshot(self, name: str) -> dict[str, torch.Tensor]:
        """Policy ``name``'s trainable weights on its worker now, as CPU copies (``deferred``: what the trainer
        publishes after an update; the worker may train on while the copy waits for a rollout boundary)."""
        return self._handle(name).call("adapter_state", name)

    def apply(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        """Load ``weights`` (a :meth:`snapshot`) into the driver's copy of policy ``name``, the one rollouts sample from."""
        if not (self.remote or self.deferred):
            raise RuntimeError("PolicyPlacement.apply: the driver's router is the worker's own here (placement local, "
                               "not deferred); there is no separate copy to load")
        self.router.policies[name].load_named_state(weights)

    # ---- checkpoints (teamrl.trainer.checkpoint) --------------------------------------------------
    def policy_names(self) -> list[str]:
        """Every policy, in the router's order."""
        return list(self.router.policies)

    def policy_state(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(weights, optimizer state) of policy ``name``, from its worker."""
        h = self._handle(name)
        weights, optim = h.submit("adapter_state", name), h.submit("optimizer_state", name)
        return h.result(weights), h.result(optim)

    def load_policy_state(self, name: str, weights: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
        """Restore policy ``name`` on its worker (and the driver's copy, for rollouts)."""
        h = self._handle(name)
        version = h.call("load_adapter_state", name, weights)
        h.call("load_optimizer_state", name, optimizer)
        if self.remote or self.deferred:
            self.router.policies[name].load_named_state(weights)
        if self.remote:
            self._synced[name] = self._trained[name] = version

    def where(self) -> dict[str, dict[str, Any]]:
        """Worker name -> where it runs (:meth:`PolicyWorker.where`)."""
        return {w: h.call("where") for w, h in self.workers.items()}

    def shutdown(self) -> None:
        """Stop the Ray actors (the Ray runtime itself is left to whoever started it); nothing to do locally."""
        if not self.remote:
            return
        import ray

        for h in self.workers.values() if hasattr(self, "workers") else ():
            try:
                ray.kill(h.target)
            except ray.exceptions.RayError:  # already dead: nothing to stop
                pass


def _own_copy(router: PolicyRouter) -> PolicyRouter:
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


def _start_actors(cfg: Config, groups: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, tuple[Any, dict]]:
    """One Ray actor per worker (``groups``: its roles and role map), with the resources ``policy.resources``
    asks for; starts Ray if none runs in this process. Worker name -> (actor handle, the resources it asked for)."""
    import ray

    p = cfg.policy
    if not ray.is_initialized():
        ray.init(address=p.ray_address or None, include_dashboard=False, log_to_driver=False)
    actor_cls = ray.remote(RayPolicyWorker)
    actors = {}
    for worker, (roles, role_map) in groups.items():
        res = dict(p.resources.get(worker, DEFAULT_WORKER_RESOURCES))
        threads = cfg.threads or max(1, int(res.get("num_cpus", 1)))
        # Workers import this very teamrl (not another install) and keep to their CPU share.
        env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
        asked = {"num_cpus": res.pop("num_cpus", 1), **res}
        actors[worker] = (actor_cls.options(runtime_env={"env_vars": env}, max_restarts=0, **asked).remote(cfg, roles, role_map),
                          asked)
    return actors
