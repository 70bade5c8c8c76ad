"""Issue 57 item 6, Ray's part: Ray 2.60's gRPC servers listen on every interface whatever address they are given
(``ss -ltn`` shows ``*:PORT`` with ``_node_ip_address="127.0.0.1"`` too), so what keeps a stranger out of a run's
Ray cluster is Ray's token. teamrl's one way to start Ray (teamrl/core/ray_cluster.py) keeps the token on and the
token's file readable by its owner only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, os, pathlib, stat, sys
import grpc, ray
from teamrl.core.ray_cluster import start_ray

os.umask(0o022)  # the usual umask: Ray writes its token file readable by every local user
start_ray("")
gcs = ray.get_runtime_context().gcs_address
token_file = pathlib.Path(os.environ["HOME"]) / ".ray" / "auth_token"
call = grpc.insecure_channel(gcs).unary_unary("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
                                              request_serializer=lambda x: x, response_deserializer=lambda x: x)
answers = {}
for who, metadata in (("no token", ()), ("wrong token", (("authorization", "Bearer wrong"),)),
                      ("the token", (("authorization", "Bearer " + token_file.read_text().strip()),))):
    try:
        call(b"", timeout=20, metadata=metadata)
        answers[who] = "OK"
    except grpc.RpcError as e:
        answers[who] = e.code().name
ray.shutdown()
print(json.dumps({"answers": answers, "mode": oct(stat.S_IMODE(token_file.stat().st_mode))}))
"""


def test_a_local_ray_cluster_refuses_a_client_without_its_token_and_the_token_is_its_owners_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(got)
    assert got["answers"] == {"no token": "UNAUTHENTICATED", "wrong token": "UNAUTHENTICATED", "the token": "OK"}, got
    assert got["mode"] == "0o600", got
