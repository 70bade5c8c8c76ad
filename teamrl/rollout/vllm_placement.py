"""Several managed vLLM servers (``rollout.vllm.servers``, a pool: :mod:`teamrl.rollout.pool`), in this process or
on Ray actors (``policy.placement: ray``).

:func:`start_servers` launches them all from the main thread, then waits for them (they load at once), each
with its own port and log ``RUN_DIR/vllm_server_<i>.log``; with ``policy.placement: ray`` each runs on a
:class:`VLLMServerActor` on the node Ray picks (:func:`start_ray_servers`), and the driver holds a
:class:`RayManagedServer`. One server is a :class:`~teamrl.rollout.vllm_server.ManagedVLLMServer`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

from teamrl.core.config import Config, ConfigError
from teamrl.core.ray_cluster import start_ray
from teamrl.rollout.completions_api import ServerError
from teamrl.rollout.vllm_server import STOP_GRACE_S, ManagedVLLMServer, free_port



def start_servers(
    cfg: Config, run_dir: str | Path, policies: int, log: Callable[[str], Any] | None = None
) -> list[Any]:
    """The managed servers ``cfg`` asks for, started and answering: ``rollout.vllm.servers`` of them, in this process
    (each under its guard, all loading at once) or, with ``policy.placement: ray``, each on a Ray actor
    (:func:`start_ray_servers`). Each has ``url``, ``stop(quiet, log)`` and ``exit_reason()``. One server in this
    process is started exactly as before the pool existed (log ``RUN_DIR/vllm_server.log``). Nothing is left
    running when an error is raised."""
    if cfg.policy.placement == "ray":
        return start_ray_servers(cfg, run_dir, policies, log)
    n = cfg.rollout.vllm.servers
    if n == 1:
        server = ManagedVLLMServer.from_config(cfg, run_dir, policies)
        server.start(log=log)
        return [server]
    servers = [ManagedVLLMServer.from_config(cfg, run_dir, policies, index=i) for i in range(n)]
    ports: set[int] = {s.port for s in servers if s.port}
    for s in servers:  # free ports picked before any server binds one, so no two servers get the same
        while not s.port:
            port = free_port(s.host)
            if port not in ports:
                s.port = port
                ports.add(port)
    launched: list[ManagedVLLMServer] = []
    try:
        for s in servers:
            s.launch(log)
            launched.append(s)
        for s in servers:
            s.wait_ready(log)
    except BaseException:
        for s in launched:
            s.stop(log=log)
        raise
    return servers


class VLLMServerActor:
    """A Ray actor that runs one :class:`ManagedVLLMServer` on its node (``policy.placement: ray``). On the driver's
    machine the server binds ``rollout.vllm.host``; on another it binds that node's address, so the driver can
    reach it. Its server runs under the guard, so it goes down when the actor's process dies (``ray.kill``)."""

    def __init__(self, cfg: Config, run_dir: str, policies: int, index: int | None, driver_ip: str) -> None:
        self.cfg, self.run_dir, self.policies, self.index, self.driver_ip = cfg, run_dir, policies, index, driver_ip
        self.server: ManagedVLLMServer | None = None

    def where(self) -> dict[str, Any]:
        """The actor's node id and address, its process id (also proves that it was placed)."""
        import threading

        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "main_thread": threading.current_thread() is threading.main_thread()}

    def start(self) -> dict[str, Any]:
        """Start the server; returns its ``url``, ``pid``, ``api_key`` and the ``lines`` it printed while starting."""
        import ray

        node_ip = ray.util.get_node_ip_address()
        host = None if node_ip == self.driver_ip else node_ip
        lines: list[str] = []
        self.server = ManagedVLLMServer.from_config(self.cfg, self.run_dir, self.policies, index=self.index, host=host)
        url = self.server.start(log=lines.append)
        return {"url": url, "pid": self.server.server_pid, "api_key": self.server.api_key, "lines": lines}

    def exit_reason(self) -> str | None:
        return self.server.exit_reason() if self.server is not None else None

    def stop(self) -> list[str]:
        """Stop the server; returns the line it said."""
        lines: list[str] = []
        if self.server is not None:
            self.server.stop(log=lines.append)
        return lines


class RayManagedServer:
    """The driver's handle of a server on a :class:`VLLMServerActor`: ``url``, ``stop`` (the server, then the actor)."""

    def __init__(self, actor: Any, index: int, url: str = "", pid: int | None = None, node: dict | None = None,
                 placement_group: Any = None, api_key: str = "") -> None:
        self.actor, self.index, self.url, self.server_pid, self.api_key = actor, index, url, pid, api_key
        self.node = node or {}
        self.placement_group = placement_group  # removed by the last server's stop

    def exit_reason(self) -> str | None:
        """None: the pool learns of a server on another node dying from its requests (refused) and /health probes."""
        return None

    @property
    def running(self) -> bool:
        import ray

        try:
            return ray.get(self.actor.exit_reason.remote(), timeout=10) is None
        except ray.exceptions.RayError:
            return False

    def stop(self, quiet: bool = False, log: Callable[[str], Any] | None = None) -> None:
        """Stop the server (in order, on its actor), then kill the actor; safe to call twice."""
        import ray

        if self.actor is None:
            return
        try:
            lines = ray.get(self.actor.stop.remote(), timeout=STOP_GRACE_S + 30)
            if not quiet:
                for line in lines:
                    (log or (lambda x: print(x, file=sys.stderr, flush=True)))(f"{line} (Ray actor {self.index})")
        except ray.exceptions.RayError:  # the actor is dead or stuck: killing it ends its server (the guard)
            pass
        try:
            ray.kill(self.actor)
        except ray.exceptions.RayError:
            pass
        self.actor = None
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None


def check_shared_adapter_dir(adapter_dir: str, driver_ip: str, server_ips: list[str]) -> None:
    """A server on another machine reads the adapters the trainer writes: ``rollout.adapter_dir`` must be an absolute
    folder of a file system every node shares; refuse (one line) the default or a relative folder there."""
    others = sorted({ip for ip in server_ips if ip != driver_ip})
    if others and not (adapter_dir and Path(adapter_dir).is_absolute()):
        raise ConfigError(
            f"rollout.adapter_dir: {adapter_dir or '(empty: RUN_DIR/served_adapters)'!r} cannot be read by "
            f"the vLLM servers on other machines ({', '.join(others)}): give an absolute folder on a file "
            "system every node mounts at the same path, e.g. rollout.adapter_dir=/shared/teamrl_adapters"
        )


def start_ray_servers(cfg: Config, run_dir: str | Path, policies: int, log: Callable[[str], Any] | None = None
                      ) -> list[RayManagedServer]:
    """``rollout.vllm.servers`` servers, each on a :class:`VLLMServerActor` with ``rollout.vllm.resources`` (with
    ``rollout.vllm.spread``: one per node, a STRICT_SPREAD placement group); Ray is started if none runs in this
    process. Fails in one line naming what the cluster could not give; nothing is left running then."""
    import ray

    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    v, p = cfg.rollout.vllm, cfg.policy
    start_ray(p.ray_address)
    res = dict(v.resources)
    asked = {"num_cpus": res.pop("num_cpus", 1), **res}
    # the actors import this very teamrl (its checkout on their PYTHONPATH), as the policy workers do
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    driver_ip = ray.util.get_node_ip_address()
    n = v.servers
    pg = None
    options: list[dict[str, Any]] = [dict(asked) for _ in range(n)]
    if v.spread:
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        names = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}
        bundle = {names[k]: x for k, x in asked.items() if k in names and x}
        bundle.update({k: x for k, x in asked.get("resources", {}).items() if x})
        pg = placement_group([dict(bundle or {"CPU": 0.01}) for _ in range(n)], strategy="STRICT_SPREAD")
        ready, _ = ray.wait([pg.ready()], timeout=p.ray_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise ServerError(
                f"rollout.vllm.spread: Ray could not place {n} vLLM servers on {n} different nodes, each "
                f"asking for {asked} (rollout.vllm.resources), within policy.ray_timeout_s={p.ray_timeout_s:g} s; "
                "`ray status` shows the nodes and what they offer"
            )
        options = [{**o, "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}
                   for i, o in enumerate(options)]
    actor_cls = ray.remote(VLLMServerActor)
    handles = []
    for i in range(n):
        actor = actor_cls.options(runtime_env={"env_vars": env}, max_restarts=0, **options[i]).remote(
            cfg, str(run_dir), policies, i if n > 1 else None, driver_ip)
        handles.append(RayManagedServer(actor, i + 1, placement_group=pg if i == n - 1 else None))
    try:
        wheres = [h.actor.where.remote() for h in handles]
        for h, w in zip(handles, wheres):
            try:
                h.node = ray.get(w, timeout=p.ray_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ServerError(f"vLLM server actor {h.index} of {n} was not placed within policy.ray_timeout_s="
                                  f"{p.ray_timeout_s:g} s; it asks Ray for {asked} (rollout.vllm.resources): does the "
                                  "cluster offer that (ray status)?") from None
        check_shared_adapter_dir(cfg.rollout.adapter_dir, driver_ip, [h.node["node_ip"] for h in handles])
        say(f"teamrl: starting {n} vLLM server{'s' if n > 1 else ''} on Ray actors (nodes "
            f"{', '.join(h.node['node_ip'] for h in handles)}; {asked} each)")
        starts = [h.actor.start.remote() for h in handles]
        for h, f in zip(handles, starts):
            try:
                got = ray.get(f, timeout=v.startup_timeout_s + 120)
            except ray.exceptions.GetTimeoutError:
                raise ServerError(
                    f"vLLM server actor {h.index} of {n} did not answer within rollout.vllm.startup_timeout_s"
                    f"={v.startup_timeout_s:g} s (+120 s)"
                ) from None
            except ray.exceptions.RayTaskError as e:  # the server's own one-line error, raised on its actor
                cause = getattr(e, "cause", None)
                if isinstance(cause, (ServerError, ConfigError)):
                    raise type(cause)(f"{cause} (Ray actor {h.index} of {n}, node {h.node.get('node_ip')})") from None
                raise
            except ray.exceptions.RayActorError as e:
                raise ServerError(f"vLLM server actor {h.index} of {n} died while starting its server "
                                  f"({type(e).__name__})") from None
            h.url, h.server_pid, h.api_key = got["url"], got["pid"], got["api_key"]
            for line in got["lines"]:
                say(f"{line} (Ray actor {h.index} of {n}, node {h.node['node_ip']})")
    except BaseException:
        for h in handles:
            h.stop(quiet=True)
        raise
    return handles
