"""Starting Ray for a run, one way for every caller (Ray policy workers, sharded ranks, Ray-placed vLLM servers).

Ray 2.60's own gRPC servers (GCS, raylet, workers) listen on every interface whatever address Ray is given
(``ss -ltn`` shows ``*:PORT`` with ``ray.init(_node_ip_address="127.0.0.1")`` too): no setting binds them to
loopback. What keeps a stranger who reaches the machine out of the cluster is Ray's token authentication, on by
default for a cluster ``ray.init`` starts (a client without the token gets ``UNAUTHENTICATED``). So a cluster
teamrl starts keeps the token on, says in one line when the environment turned it off (``RAY_AUTH_MODE``), and
makes the token's file (``~/.ray/auth_token``, written readable by every local user) its owner's only.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path


def token_file() -> Path:
    """Where Ray keeps the cluster token (``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``)."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def start_ray(address: str = "") -> None:
    """Connect to the cluster at ``address`` (``policy.ray_address``; ``auto``: the one ``ray start`` began on this
    machine), else start a local cluster of this run's own, unless Ray runs in this process already."""
    import ray

    if ray.is_initialized():
        return
    # "local": a cluster of this run's own; ray.init() with no address joins a cluster already on the machine (another
    # run's, which ends when that run does)
    ray.init(address=address or "local", include_dashboard=False, log_to_driver=False)
    if address:  # someone else's cluster: its security is theirs
        return
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        print("teamrl: RAY_AUTH_MODE=disabled: this run's Ray cluster listens on every interface without a token; "
              "anyone who reaches this machine can run code in it (unset RAY_AUTH_MODE to keep Ray's token on)",
              file=sys.stderr, flush=True)
        return
    path = token_file()
    try:
        if path.is_file() and stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(0o600)
    except OSError as e:  # not ours to change: say so, the run goes on
        print(f"teamrl: Ray's token file {path} is readable by other users and could not be made private ({e})",
              file=sys.stderr, flush=True)
