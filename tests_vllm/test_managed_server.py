"""Training through a real vLLM server that teamrl starts and stops (``rollout.engine=vllm``).

For GRPO (configs/grpo_word_count.yaml, one adapter) and MAGRPO (configs/magrpo_writing_tldr.yaml, one adapter per
role), 2 steps each: the samples of every group are distinct, the server returns token ids and log-probs equal to
the trainer's (recomputed before the update), every policy's adapter is reloaded and checked after each step, and
after the run no process of the server is left. Then a run interrupted with SIGINT, and one whose trainer is
SIGKILLed, leave no vLLM process. The printed lines ([test-vllm] ...) are the figures make test-vllm shows.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from teamrl.core.config import load_config
from teamrl.rollout.engine import Completion
from teamrl.trainer.trainer import Trainer
from tests_vllm.helpers import REPO, assert_server_gone, group_alive, run_overrides, vllm_processes


def _served_roots(trainer: Trainer) -> dict[str, str]:
    """policy -> the adapter folder the server has loaded for it now (``root`` in ``/v1/models``)."""
    cards = {c["id"]: c for c in trainer.engine.model_cards()}
    return {p: cards[name]["root"] for p, name in trainer.engine.served.items() if name in cards}


def _check_rollout(trainer: Trainer, step: int, samples: list) -> None:
    """Distinct samples in every group, token ids and log-probs returned, and the log-probs equal the trainer's."""
    groups: dict[str, list] = {}
    for s in samples:
        if s.trainable and not s.baseline:
            groups.setdefault(repr(s.group), []).append(s)
    distinct = [len({tuple(s.completion_ids) for s in g}) for g in groups.values()]
    sizes = [len(g) for g in groups.values()]
    gaps: list[float] = []
    for s in samples:
        assert s.completion_ids and len(s.sampling_logprobs) == len(s.completion_ids)
        mine = trainer._probe_logprobs(s.policy, s.prompt_ids, [Completion(s.completion_ids, [], "", "")], s.temperature,
                                       trainer.params.top_k, trainer.params.top_p)[0]
        gaps += [abs(a - b) for a, b in zip(s.sampling_logprobs, mine)]
    tol = trainer.cfg.rollout.server_check_tolerance
    print(f"[test-vllm] {trainer.cfg.name} step {step}: distinct samples per group: {min(distinct)}..{max(distinct)} of "
          f"{sizes[0]} ({len(groups)} groups, {len(samples)} samples); server vs trainer log-probs: max gap {max(gaps):.2e}, "
          f"mean {sum(gaps) / len(gaps):.2e} over {len(gaps)} tokens (tolerance {tol:g})", flush=True)
    assert all(d == n for d, n in zip(distinct, sizes)), f"identical samples in a group: {distinct} of {sizes}"
    assert max(gaps) <= tol


def _train_two_steps(config: str, tmp_path: Path, name: str) -> None:
    trainer = Trainer(load_config(REPO / "configs" / config, run_overrides(tmp_path, name)))
    server = trainer.vllm_server
    policies = list(trainer.router.policies)
    print(f"[test-vllm] {name}: server pid {server.server_pid} at {server.url} (vLLM {server.version}); policies "
          f"{policies} served as {trainer.engine.served}", flush=True)
    assert server.running and server.version == "0.32.0"
    rollout = trainer._rollout

    def checked_rollout(problems, make_ctx, scheduler):  # before the update: the weights that sampled
        samples = rollout(problems, make_ctx, scheduler)
        _check_rollout(trainer, trainer.step + 1, samples)
        return samples

    trainer._rollout = checked_rollout
    roots = [_served_roots(trainer)]
    try:
        for step in (1, 2):
            rec = trainer.train_step()
            roots.append(_served_roots(trainer))
            sync = {k: v for k, v in rec.items() if k.startswith("sync/")}
            print(f"[test-vllm] {name} step {step}: rollout {rec['rollout_s']:.1f} s, update {rec['update_s']:.1f} s; "
                  f"sync check after the update: {json.dumps(sync)}", flush=True)
            for p in policies:  # every policy's new adapter was loaded and checked against the trainer
                assert roots[-1][p] != roots[-2][p], f"policy {p}: the server still holds {roots[-2][p]}"
                gaps = {k: v for k, v in sync.items() if k.startswith(f"sync/{p}/") and "gap" in k}
                assert gaps and max(gaps.values()) <= trainer.cfg.rollout.server_check_tolerance, sync
    finally:
        trainer.shutdown()
    assert server.returncode is not None and not server.running
    assert_server_gone(server.server_pid, server.port)


def test_grpo_two_steps_through_a_managed_vllm_server(tmp_path):
    _train_two_steps("grpo_word_count.yaml", tmp_path, "vllm-grpo")


def test_magrpo_two_roles_two_steps_through_a_managed_vllm_server(tmp_path):
    _train_two_steps("magrpo_writing_tldr.yaml", tmp_path, "vllm-magrpo")


def test_grpo_full_weights_two_steps_through_a_managed_vllm_server_and_a_stale_reload_is_caught(tmp_path):
    """policy.lora: null: the server (in dev mode) reloads the whole model after each update from the folder the
    trainer wrote (vLLM's reload_weights); the sync check passes after each one, and a reload of the first version's
    weights after the updates fails the step in one line."""
    import shutil

    from teamrl.rollout.completions_api import ServerError

    overrides = [*run_overrides(tmp_path, "vllm-full"), "policy.lora=null", "train.lr=1e-5"]
    trainer = Trainer(load_config(REPO / "configs" / "grpo_word_count.yaml", overrides))
    server = trainer.vllm_server
    assert "--enable-lora" not in server.command() and server.environment()["VLLM_SERVER_DEV_MODE"] == "1"
    # issue 57 item 7: the dev endpoints are behind the server's key (vLLM's own check covers /v1/... only)
    import httpx

    key = {"Authorization": f"Bearer {server.api_key}"}
    refused = {path: httpx.request(method, server.url + path, json=body, timeout=30).status_code
               for method, path, body in (("POST", "/collective_rpc", {"method": "reload_weights"}),
                                          ("POST", "/v1/completions", {"model": "x", "prompt": "a", "max_tokens": 1}),
                                          ("GET", "/health", None))}
    print(f"[test-vllm] vllm-full without the key: {refused}; /health with it: "
          f"{httpx.get(server.url + '/health', headers=key, timeout=30).status_code}", flush=True)
    assert set(refused.values()) == {401} and httpx.get(server.url + "/health", headers=key, timeout=30).is_success
    first = tmp_path / "v1"
    trainer.router.policies["shared"].save_weights(first)
    tol = trainer.cfg.rollout.server_check_tolerance
    try:
        for step in (1, 2):
            rec = trainer.train_step()
            sync = {k: v for k, v in rec.items() if k.startswith("sync/")}
            print(f"[test-vllm] vllm-full step {step}: rollout {rec['rollout_s']:.1f} s, update {rec['update_s']:.1f} s; "
                  f"sync check after the full-weight reload: {json.dumps(sync)}", flush=True)
            assert sync["sync/shared/max_logprob_gap"] <= tol and sync["sync/shared/moved"] > tol, sync
        trainer.engine.save_weights = lambda name, folder: shutil.copytree(first, folder)
        with pytest.raises(ServerError) as e:
            trainer.train_step()
        print(f"[test-vllm] vllm-full stale reload: {e.value}", flush=True)
        assert "\n" not in str(e.value) and str(e.value).startswith("sync check: policy 'shared' version 4 (full weights")
    finally:
        trainer.shutdown()
    assert_server_gone(server.server_pid, server.port)


def _start_cli_run(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path, int, int]:
    """``teamrl train`` (MAGRPO, managed server) in a subprocess, returned once its server is ready: (process, stderr
    file, server pid, port)."""
    err = tmp_path / f"{name}.stderr"
    proc = subprocess.Popen([sys.executable, "-m", "teamrl.cli", "train", "configs/magrpo_writing_tldr.yaml",
                             *run_overrides(tmp_path, name, steps=3)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=err.open("w"),
                            # SIGINT's default action even where this process ignores it (a background job: nohup, CI)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300  # a bound on a broken start only
    while not (m := re.search(r"ready at http://127\.0\.0\.1:(\d+) after \d+ s \(pid (\d+);", err.read_text())):
        assert proc.poll() is None, err.read_text()
        assert time.monotonic() < deadline, "the managed server did not start"
        time.sleep(0.5)
    return proc, err, int(m.group(2)), int(m.group(1))


def test_sigint_of_a_managed_run_leaves_no_vllm_process(tmp_path):
    proc, err, pid, port = _start_cli_run(tmp_path, "vllm-sigint")
    time.sleep(5)  # into the start-up check
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    stopped = [ln for ln in err.read_text().splitlines() if "vLLM server (pid" in ln]
    print(f"[test-vllm] SIGINT: teamrl exited with {proc.returncode}; {stopped}", flush=True)
    assert stopped and "processes of its group left: none" in stopped[-1]
    assert_server_gone(pid, port)


def test_sigkill_of_the_trainer_leaves_no_vllm_process(tmp_path):
    proc, _, pid, port = _start_cli_run(tmp_path, "vllm-sigkill")
    proc.kill()
    proc.wait(timeout=60)
    t0 = time.monotonic()
    # the guard's SIGTERM, 20 s of grace at most, then SIGKILL; then the guard itself (its command line names the port)
    while (group_alive(pid) or any(f"--port {port}" in ln for ln in vllm_processes())) and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    print(f"[test-vllm] SIGKILL of the trainer: its vLLM server's process group and guard gone {time.monotonic() - t0:.1f} s "
          "later", flush=True)
    assert_server_gone(pid, port)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
