"""A small run of bench/gateway_load.py: concurrent external episodes, some clients killed mid-call.

Every completed call of an episode that reported its reward is recorded exactly once under its
episode and role with the token ids its client received; killed clients' calls are withdrawn and
their episodes dropped and counted; the server keeps serving the next round.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gateway_load.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gateway_load", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sixteen_concurrent_episodes_are_recorded_exactly_once_with_two_clients_killed_mid_call():
    rounds = _bench().run(episodes=16, calls=3, tokens=4, kill_fraction=0.125, reward_timeout_s=8.0)
    reference, clean, killed, after = rounds
    assert reference["calls"] == 48 and reference["engine_batches"] == 3  # in process: one batch per step
    for r in (clean, after):
        assert r["exactly_once"] and r["recorded_calls"] == 48 and r["killed"] == r["dropped"] == r["withdrawn"] == 0, r
    assert killed["exactly_once"] and killed["killed"] == killed["dropped"] == killed["withdrawn"] == 2, killed
    assert killed["recorded_calls"] == 14 * 3 and killed["calls"] == 14 * 3 + 2 * 2, killed  # a dead client's episode trains nothing
