"""A vLLM server teamrl did not start for the run (``rollout.engine=http``) whose flags do not fit the run: each
mismatch is refused at start-up in one line naming the vLLM flag that would fix it.

One real server (vLLM 0.32.0, started here with teamrl's launcher but with the wrong flags on purpose: served name
``smollm2-135m``, ``--max-loras 1``, ``--max-lora-rank 8``) and three runs of configs/magrpo_writing_tldr.yaml
(two adapters, rank 16) against it.
"""

from __future__ import annotations

import pytest

from teamrl.core.config import VllmConfig, load_config
from teamrl.rollout.completions_api import ServerError
from teamrl.rollout.vllm_server import ManagedVLLMServer, served_model_path
from teamrl.trainer.trainer import Trainer
from tests_vllm.helpers import REPO, assert_server_gone


@pytest.fixture(scope="module")
def narrow_server(tmp_path_factory):
    """A real vLLM server with one LoRA slot of rank 8 (a user's own server, started without teamrl's flags)."""
    server = ManagedVLLMServer(VllmConfig(), "smollm2-135m", policies=1, lora_rank=8,
                               log_path=tmp_path_factory.mktemp("narrow") / "vllm_server.log")
    url = server.start()
    with pytest.MonkeyPatch.context() as mp:  # a server the user started with a key: the runs take it from here
        mp.setenv("TEAMRL_API_KEY", server.api_key)
        yield url
    server.stop()
    assert_server_gone(server.server_pid, server.port)


def _refusal(tmp_path, url: str, name: str, *more: str) -> str:
    overrides = [f"name={name}", f"run.dir={tmp_path}", "rollout.engine=http", f"rollout.server_url={url}",
                 "run.tensorboard=false", "run.progress=false", *more]
    with pytest.raises(ServerError) as e:
        Trainer(load_config(REPO / "configs" / "magrpo_writing_tldr.yaml", overrides))
    msg = str(e.value)
    print(f"[test-vllm] refused: {msg}", flush=True)
    assert "\n" not in msg
    return msg


def test_a_served_name_other_than_the_configs_model_names_served_model_name(tmp_path, narrow_server):
    folder = served_model_path("smollm2-135m")  # the same weights under another name: the folder
    msg = _refusal(tmp_path, narrow_server, "named", f"model={folder}")
    assert f"not the config's model {folder!r}: start vLLM with --served-model-name {folder}" in msg


def test_an_adapter_over_the_servers_rank_names_max_lora_rank(tmp_path, narrow_server):
    msg = _refusal(tmp_path, narrow_server, "rank")  # policy.lora.r is 16
    assert "max_lora_rank" in msg and msg.endswith("start vLLM with --max-lora-rank 16 or more (policy.lora.r is 16)")


def test_too_few_lora_slots_for_the_roles_names_max_loras(tmp_path, narrow_server):
    msg = _refusal(tmp_path, narrow_server, "slots", "policy.lora.r=8", "rollout.max_new_tokens=16")
    assert msg.endswith("was started with --max-loras 1, fewer than this run's 2 policies (tldr, summary), so their "
                        "requests would take turns; start it with --max-loras 2")
