"""The sharded learner: a worker's policies trained by N ranks of one ``torch.distributed`` group (``policy.ranks``).

Each rank is a Ray actor (:class:`ShardRank`, all of a worker's in one placement group, each with the resources
``policy.resources.<worker>`` asks for) that builds the worker's router, joins the group (gloo on CPU, NCCL on CUDA,
``policy.collective_timeout_s``) and shards every model with FSDP2: ``fully_shard`` on each decoder layer, then on the
model, so that each rank holds 1/N of the parameters, of their gradients and of the optimizer's state (full weights,
or LoRA adapters: several on one base included). On CUDA the layers compute in bf16 and gradients are reduced in fp32;
``policy.activation_checkpointing`` recomputes each layer's activations in the backward pass.

Data parallel, exactly: each rank gets a contiguous, disjoint share of every step's samples and runs
:func:`~teamrl.trainer.update.update_policy_steps` with :class:`GroupRanks`, so that the normalisers of every loss
aggregation (tokens, samples) are summed over the ranks before any loss is divided by them, the gradients are summed
(FSDP's division by N switched off), and the gradient norm (clipping, per role), loss, KL, clip share, entropy, tokens
and importance-weight statistics are those of all ranks' samples: N ranks give the step 1 rank gives. Every pass
gathers one module's parameters at a time (all-gather before it, freed after it) and every backward pass sums its
gradients into their shards (reduce-scatter), so the ranks must run as many passes as one another: with ranks, the
update packs plain micro-batches (no shared prompt pass, whose passes differ in kind) and, after each phase (old
log-probs, constant log-probs, each role type's passes), a rank that ran fewer passes runs empty 1-token ones until it
ran as many as the rank that ran most (a rank with no samples takes part so).

Checkpoints have the one-process format: :meth:`ShardedLearner.state` gathers the full weights and optimizer state
(the optimizer's by parameter index, as ``torch.optim`` keeps it), :meth:`ShardedLearner.load_state` gives each rank
its share of them, so a run saved with N ranks resumes with any number. A rank that dies or fails (a collective past
its timeout) is a one-line :class:`~teamrl.trainer.learner.WorkerFailed` naming worker, rank and process, and every
rank of every worker is stopped.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.tensor import DTensor

from teamrl.core.config import Config, ConfigError
from teamrl.core.memory import trim_freed_memory
from teamrl.core.ray_cluster import start_ray
from teamrl.policies.policy import Policy
from teamrl.policies.router import PolicyRouter
from teamrl.trainer.learner import (LearnBatch, PolicyState, RayPolicyWorker, StepStats, WorkerFailed,
                                    actor_options, roles_of, worker_groups)
from teamrl.trainer.update import check_sampling_logprobs, update_policy_steps

# Seconds to wait, after one rank failed, for the answers of the others: a dead rank (whose peers fail in the
# collective it left) is named rather than a peer.
FAILURE_GRACE_S = 5.0


def _fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def release(model: torch.nn.Module) -> None:
    """Free whatever parameters of ``model`` are gathered (local: no collective)."""
    for m in _fsdp_modules(model):
        m.reshard()


def _full(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t``, the whole tensor when it is a shard (a collective)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def _share_of(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's rows of ``full`` in ``like``'s layout (FSDP2: dim 0 in chunks of ceil(rows / N), the last ones
    shorter or empty), on its device and dtype."""
    local = like.to_local()
    mesh = like.device_mesh
    step = -(-full.shape[0] // mesh.size())
    start = mesh.get_local_rank() * step
    return full[start:start + local.shape[0]].to(device=local.device, dtype=local.dtype)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` of a decoder layer that keeps none of its activations for the backward pass (it recomputes them) in a
    pass without a KV cache. A pass with one (shared prompts) keeps them: the recomputation would write the cache a
    second time (transformers' own checkpointing drops the cache instead, which would lose the prompt)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))
        if cache is None and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


def shard_model(model: torch.nn.Module, mesh: Any, on_cuda: bool, checkpointing: bool) -> None:
    """FSDP2 on ``model``: each decoder layer (the classes in transformers' ``_no_split_modules``), then the model;
    on CUDA in bf16 with fp32 gradient reduction. Every pass gathers each module's parameters before it and frees them
    after it, and every backward pass sums (not averages) the gradients over the ranks into their shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kinds = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise ValueError(f"{type(base).__name__}: no decoder layers to shard (transformers' _no_split_modules "
                         f"names {sorted(kinds)}); policy.ranks above 1 needs a transformers decoder model")
    if checkpointing:
        for layer in layers:
            layer.forward = _checkpointed(layer.forward)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_cuda \
        else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in _fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)  # each rank's loss is already divided by every rank's count
        m.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)
    model.set_reshard_after_forward(True)  # the model too: one layer's parameters gathered at a time


class GroupRanks:
    """:class:`~teamrl.trainer.update.Ranks` over the default process group (``device``: where collectives' tensors
    live: CPU for gloo, the rank's GPU for NCCL)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def all_sum(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def all_max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def all_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def empty_passes(self, policy: Policy, passes: int, backward: bool) -> None:
        """Passes of one token and zero loss (they add nothing): their FSDP all-gathers (and reduce-scatters) pair up
        with another rank's real passes."""
        for _ in range(passes):
            ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            with torch.set_grad_enabled(backward):
                logits = policy.model(input_ids=ids, use_cache=False).logits
            if backward:
                (logits.float().sum() * 0.0).backward()

    def local_grads(self, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        return [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, local)]


class ShardRank(RayPolicyWorker):
    """One rank of a sharded worker, in its own Ray actor: the worker's router, sharded once :meth:`join` made the
    group; the :class:`~teamrl.trainer.learner.PolicyWorker` calls, each a collective that every rank must make."""

    def __init__(self, cfg: Config, roles: list[str], role_map: dict[str, str], rank: int, world: int) -> None:
        super().__init__(cfg, roles, role_map)
        self.rank, self.world = rank, world
        self.checkpointing = cfg.policy.activation_checkpointing
        self.ranks: GroupRanks | None = None
        self.store_socket: socket.socket | None = None  # rank 0's: where the group's rendezvous listens

    def node_ip(self) -> str:
        """The address of the node this rank runs on (Ray's)."""
        import ray

        return ray.util.get_node_ip_address()

    def address(self, loopback: bool) -> tuple[str, int]:
        """Where the group meets (rank 0's): a socket listening on a free port of 127.0.0.1 (``loopback``: every rank
        is on this machine) or of this node's address, never on every interface; :meth:`join` hands it to the
        rendezvous store (torch's own TCPStore listens on ``*`` whatever host it is given)."""
        host = "127.0.0.1" if loopback else self.node_ip()
        self.store_socket = socket.create_server((host, 0), backlog=128)
        return host, self.store_socket.getsockname()[1]

    def join(self, host: str, port: int, timeout_s: float) -> int:
        """Join the group at ``host:port`` (rank 0 hosts it) and shard every model; returns this process's id."""
        dev = self.router.device
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        timeout = timedelta(seconds=timeout_s)
        listen_fd = self.store_socket.fileno() if self.rank == 0 and self.store_socket is not None else None
        store = dist.TCPStore(host, port, self.world, self.rank == 0, timeout, master_listen_fd=listen_fd)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=self.rank,
                                world_size=self.world, timeout=timeout)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (self.world,))
        sharded: set[int] = set()
        for policy in self.router.policies.values():
            if id(policy.model) not in sharded:
                shard_model(policy.model, mesh, dev.type == "cuda", self.checkpointing)
                sharded.add(id(policy.model))
            policy.rebind_parameters()
        self.ranks = GroupRanks(dev)
        return os.getpid()

    def update(self, name: str, parts: Sequence[Sequence[Any]], params: Any, pad_id: int,
               eos_ids: Sequence[int]) -> dict[str, Any]:
        """This rank's shares of policy ``name``'s steps (every step, an empty share included)."""
        policy = self.policy(name)
        try:
            steps = update_policy_steps(policy, parts, params, pad_id, eos_ids, ranks=self.ranks)
        finally:
            release(policy.model)
        trim_freed_memory()
        return {"steps": steps, "version": policy.version}

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """Policy ``name``'s full trainable weights, CPU copies (gathered from every rank; rank 0 returns them, the
        others an empty dict: one copy crosses to the driver)."""
        full = {k: _full(v) for k, v in self.policy(name).named_state().items()}
        return full if self.rank == 0 else {}

    def load_adapter_state(self, name: str, state: dict[str, torch.Tensor]) -> int:
        """Take this rank's share of full weights ``state``; returns the policy's new version."""
        policy = self.policy(name)
        own = dict(policy.model.named_parameters())
        missing = sorted(set(state) - set(own))
        if missing:
            raise KeyError(f"policy {name!r}: checkpoint has weights the model lacks: {missing[:3]}")
        with torch.no_grad():
            for n, full in state.items():
                p = own[n]
                (p.to_local() if isinstance(p, DTensor) else p).copy_(_share_of(full, p) if isinstance(p, DTensor)
                                                                       else full)
        policy.version += 1
        return policy.version

    def optimizer_state(self, name: str) -> dict[str, Any]:
        """Policy ``name``'s optimizer state with full tensors (the format one process saves)."""
        sd = self.policy(name).optimizer.state_dict()
        sd["state"] = {i: {k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                       for i, st in sorted(sd["state"].items())}
        return sd if self.rank == 0 else {}

    def load_optimizer_state(self, name: str, state: dict[str, Any]) -> None:
        """Take this rank's share of an optimizer state with full tensors (saved by any number of ranks)."""
        policy = self.policy(name)
        params = policy.parameters()

        def share(v: Any, p: torch.nn.Parameter) -> Any:
            if not (isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.shape == p.shape and v.dim()):
                return v
            return DTensor.from_local(_share_of(v, p).clone(), p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())

        policy.load_optimizer_state({**state, "state": {i: {k: share(v, params[int(i)]) for k, v in st.items()}
                                                        for i, st in state["state"].items()}})

    def where(self) -> dict[str, Any]:
        return {**super().where(), "rank": self.rank}

    def memory(self) -> dict[str, float]:
        """Bytes this rank holds of its policies' parameters (of them: trainable; the gradients take as much during an
        update), and of their optimizer state; ``peak_rss``: this process's peak resident memory so far."""
        import resource

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        models = {id(p.model): p.model for p in self.router.policies.values()}
        params = [local(t) for m in models.values() for t in m.parameters()]
        trainable = [local(t) for p in self.router.policies.values() for t in p.parameters()]
        state = [local(v) for p in self.router.policies.values() for st in p.optimizer.state.values()
                 for v in st.values() if isinstance(v, torch.Tensor)]
        return {"parameters": float(sum(t.numel() * t.element_size() for t in params)),
                "trainable": float(sum(t.numel() * t.element_size() for t in trainable)),
                "optimizer": float(sum(t.numel() * t.element_size() for t in state)),
                "peak_rss": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}


class ShardedLearner:
    """Every worker's policies on its ranks (``policy.ranks``, module docstring); ``router`` is the driver's, whose
    initial weights every rank takes. A worker with one rank is one actor, as in
    :class:`~teamrl.trainer.learner.RayLearner`."""

    remote = True

    def __init__(self, cfg: Config, router: PolicyRouter, roles: Sequence[str]) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        p = cfg.policy
        self.timeout = p.ray_timeout_s
        groups = worker_groups(cfg, list(router.policies))
        self.worker_of = {name: w for w, names in groups.items() for name in names}
        self._names = list(router.policies)
        self._versions: dict[str, int] = {}
        self._weights: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}  # policy -> (version, full weights)
        self.ranks: dict[str, list[Any]] = {}
        self.pids: dict[str, list[int]] = {}
        self.groups: dict[str, Any] = {}  # worker -> its placement group
        start_ray(cfg.policy.ray_address)
        try:
            for w, names in groups.items():
                n = p.ranks.get(w, 1)
                options, asked = actor_options(cfg, w)
                bundle = {"CPU": asked.get("num_cpus", 1), "GPU": asked.get("num_gpus", 0),
                          "memory": asked.get("memory", 0), **asked.get("resources", {})}
                pg = self.groups[w] = placement_group([{k: v for k, v in bundle.items() if v}] * n, strategy="PACK")
                try:
                    ray.get(pg.ready(), timeout=self.timeout)
                except ray.exceptions.GetTimeoutError as e:
                    raise WorkerFailed(f"policy worker {w!r}: Ray could not place its {n} ranks within "
                                       f"policy.ray_timeout_s={self.timeout:g} s, each asking for {asked} "
                                       f"(policy.resources.{w}, policy.ranks.{w}): does the cluster offer that "
                                       "(ray status)?") from e
                rs, rm = roles_of(router, roles, dict(p.roles), names)
                self.ranks[w] = [
                    ray.remote(ShardRank).options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=r)).remote(cfg, rs, rm, r, n)
                    for r in range(n)]
            for w, actors in self.ranks.items():
                self.pids[w] = [d["pid"] for d in self._all(w, [a.where.remote() for a in actors])]
                if len(actors) > 1:
                    # one machine: the rendezvous on loopback; several: on rank 0's node address
                    loopback = len(set(self._all(w, [a.node_ip.remote() for a in actors]))) == 1
                    host, port = self._all(w, [actors[0].address.remote(loopback)])[0]
                    self._all(w, [a.join.remote(host, port, p.collective_timeout_s) for a in actors])
            for name in self._names:
                self._versions[name] = self._on(name, lambda a, *r: a.load_adapter_state.remote(*r), name,
                                               router.policies[name].named_state())
        except BaseException:
            self.shutdown()
            raise

    def _all(self, worker: str, futures: list[Any]) -> list[Any]:
        """The answers of ``worker``'s ranks (one future per rank, in rank order). A rank that dies, fails or stays
        silent past ``policy.ray_timeout_s`` stops every rank and raises :class:`WorkerFailed` naming it."""
        import ray

        pending = {f: r for r, f in enumerate(futures)}
        out: list[Any] = [None] * len(futures)
        deadline = time.monotonic() + self.timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(worker, min(pending.values()), None, f"no answer within policy.ray_timeout_s="
                                                                f"{self.timeout:g} s")
            r = pending.pop(ready[0])
            try:
                out[r] = ray.get(ready[0])
            except ray.exceptions.RayError as e:
                self._failed(worker, r, e, pending)
        return out

    def _failed(self, worker: str, rank: int, error: Exception, pending: dict[Any, int]) -> None:
        """Rank ``rank`` failed with ``error``: name a rank that died instead when one did (its peers fail in the
        collective it left), then stop everything."""
        import ray

        died = [(rank, error)] if isinstance(error, ray.exceptions.RayActorError) else []
        end = time.monotonic() + FAILURE_GRACE_S
        while pending and not died and time.monotonic() < end:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, end - time.monotonic()))
            for f in ready:
                r = pending.pop(f)
                try:
                    ray.get(f)
                except ray.exceptions.RayActorError as e:
                    died.append((r, e))
                except ray.exceptions.RayError:
                    pass
        if died:
            self._fail(worker, died[0][0], died[0][1], f"died ({type(died[0][1]).__name__})")
        cause = getattr(error, "cause", None) or error
        line = next((s for s in str(cause).splitlines() if s.strip()), type(cause).__name__)
        pids = self.pids.get(worker, [])
        silent = "".join(f"; rank {r} (pid {pids[r] if r < len(pids) else '?'}) gave no answer (hung?)"
                         for r in sorted(pending.values()))
        self._fail(worker, rank, error, f"failed: {type(cause).__name__}: {line}{silent}")

    def _fail(self, worker: str, rank: int, error: Exception | None, what: str) -> None:
        pids = self.pids.get(worker, [])
        pid = pids[rank] if rank < len(pids) else "?"
        n = len(self.ranks.get(worker, ()))
        self.shutdown()
        raise WorkerFailed(f"policy worker {worker!r} rank {rank} of {n} (pid {pid}) {what}; every rank was stopped: "
                           "restart the run with --resume to continue from the last checkpoint") from error

    def _on(self, policy: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(rank, *args)`` (a typed remote call, e.g. ``lambda a, *r: a.adapter_state.remote(*r)``) on every rank
        of ``policy``'s worker, the arguments stored once for all; rank 0's answer."""
        import ray

        w = self.worker_of[policy]
        refs = [ray.put(a) for a in args] if len(self.ranks[w]) > 1 else args
        return self._all(w, [call(a, *refs) for a in self.ranks[w]])[0]

    def policy_names(self) -> list[str]:
        return list(self._names)

    def update(self, batch: LearnBatch) -> dict[str, list[StepStats]]:
        """Every policy's steps, each step's samples split over its worker's ranks (contiguous shares, in order)."""
        mode = batch.params.loss.importance_correction
        futures = {}
        for name, parts in batch.parts.items():
            actors = self.ranks[self.worker_of[name]]
            n = len(actors)
            if n > 1:  # what one rank's update would refuse, refused before any rank waits for it
                parts = [list(p) for p in parts if any(s.completion_ids for s in p)]
                foreign = {s.policy for p in parts for s in p} - {name}
                if foreign:
                    raise ValueError(f"policy {name!r} was given samples of {sorted(foreign)}")
                if mode != "none":
                    check_sampling_logprobs([s for p in parts for s in p if s.completion_ids], mode)
            futures[name] = [a.update.remote(name, [p[len(p) * r // n:len(p) * (r + 1) // n] for p in parts],
                                             batch.params, batch.pad_id, list(batch.eos_ids))
                             for r, a in enumerate(actors)]
        out = {}
        for name, fs in futures.items():
            result = self._all(self.worker_of[name], fs)[0]
            out[name], self._versions[name] = result["steps"], result["version"]
        return out

    def version(self, name: str) -> int:
        return self._versions[name]

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """Policy ``name``'s full trainable weights (CPU), gathered once per version."""
        cached = self._weights.get(name)
        if cached is None or cached[0] != self._versions[name]:
            full = self._on(name, lambda a, *r: a.adapter_state.remote(*r), name)
            cached = self._weights[name] = (self._versions[name], full)
        return cached[1]

    def state(self, name: str) -> PolicyState:
        return self.weights(name), self._on(name, lambda a, *r: a.optimizer_state.remote(*r), name)

    def load_state(self, name: str, weights: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
        self._versions[name] = self._on(name, lambda a, *r: a.load_adapter_state.remote(*r), name, weights)
        self._on(name, lambda a, *r: a.load_optimizer_state.remote(*r), name, optimizer)

    def set_reference(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        raise ConfigError(f"train.loss.kl_reference: policy {name!r} is sharded (policy.ranks); a KL to the warm start "
                          "is not supported sharded yet: set train.loss.kl_reference=base or train.loss.kl_coef=0")

    def memory(self) -> dict[str, list[dict[str, float]]]:
        """Worker name -> each rank's bytes of parameters, trainable parameters, optimizer state and peak resident
        memory (:meth:`ShardRank.memory`)."""
        return {w: self._all(w, [a.memory.remote() for a in actors]) for w, actors in self.ranks.items()}

    def where(self) -> dict[str, dict[str, Any]]:
        """Worker name -> where its rank 0 runs, with ``ranks``: where each rank does."""
        out = {}
        for w, actors in self.ranks.items():
            ranks = self._all(w, [a.where.remote() for a in actors])
            out[w] = {**ranks[0], "ranks": ranks}
        return out

    def shutdown(self) -> None:
        """Stop every rank and free the placement groups (the Ray runtime is left to whoever started it)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actors in self.ranks.values():
            for a in actors:
                try:
                    ray.kill(a)
                except ray.exceptions.RayError:
                    pass
        for pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception:  # already removed, or Ray is down: nothing to free
                pass
        self.ranks, self.groups = {}, {}

