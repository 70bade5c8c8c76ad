"""``teamrl serve`` and the HTTP engine: same tokens and log-probs as the in-process engine, over 127.0.0.1."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from teamrl.core.config import LoraConfig, load_config
from teamrl.policies.chat import encode_chat
from teamrl.policies.router import PolicyRouter
from teamrl.rollout.completions_api import ServerError, _completion
from teamrl.rollout.engine import GenerationRequest, SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.rollout.http_engine import HTTPEngine
from teamrl.rollout.server import ModelServer, TeamrlHTTPServer

REPO = Path(__file__).resolve().parents[1]
LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def server():
    """``teamrl serve`` for tiny-random (seed 0) in a thread on a free port of 127.0.0.1."""
    httpd = TeamrlHTTPServer(ModelServer("tiny-random", seed=0), "127.0.0.1", 0)
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    t.join(timeout=10)
    assert not t.is_alive()


def _post(url, body, raw=None):
    """(status, decoded JSON) of a POST, error statuses included."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _prompts(tok, n=3):
    return [encode_chat(tok, "word " * (i + 1)) for i in range(n)]


def _flat(out):
    return [(c.token_ids, c.logprobs, c.text, c.finish_reason) for r in out for c in r]


def _assert_same(a, b):
    assert [x[0] for x in _flat(a)] == [x[0] for x in _flat(b)]
    assert [x[2:] for x in _flat(a)] == [x[2:] for x in _flat(b)]
    for (_, la, _, _), (_, lb, _, _) in zip(_flat(a), _flat(b)):
        assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-5)


def test_http_engine_matches_in_process_engine(server, tiny, tiny_engine):
    _, tok = tiny
    http = HTTPEngine(server.url, tok)
    prompts = _prompts(tok)
    for params, n, seed in ((SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True), 1, 0),
                            (SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, ignore_eos=True), 3, 11),
                            (SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9), 2, 5),
                            (SamplingParams(max_new_tokens=6, min_new_tokens=4), 2, 3)):  # sent as vLLM's min_tokens
        reqs = [GenerationRequest(p, params, n=n) for p in prompts]
        remote = http.generate("tiny-random", reqs, seed=seed)
        local = tiny_engine.generate("tiny-random", reqs, seed=seed)
        assert [len(r) for r in remote] == [n] * len(prompts)
        _assert_same(remote, local)
    # sampling really depends on the seed over HTTP too
    reqs = [GenerationRequest(prompts[0], SamplingParams(max_new_tokens=10, ignore_eos=True), n=4)]
    assert _flat(http.generate("tiny-random", reqs, seed=1)) != _flat(http.generate("tiny-random", reqs, seed=2))


def test_stop_string_finish_and_text(server, tiny, tiny_engine):
    _, tok = tiny
    http = HTTPEngine(server.url, tok)
    p = _prompts(tok, 1)[0]
    free = tiny_engine.generate("x", [GenerationRequest(p, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))])[0][0]
    stop = free.text[5:7]
    req = GenerationRequest(p, SamplingParams(max_new_tokens=30, temperature=0, stop=(stop,), ignore_eos=True))
    (c,) = http.generate("tiny-random", [req], seed=0)[0]
    assert c.finish_reason == "stop" and c.text.endswith(stop) and len(c.token_ids) < 30
    _assert_same([[c]], tiny_engine.generate("x", [req], seed=0))
    # vLLM's default (include_stop_str_in_output false) drops the stop string and says which one matched
    status, body = _post(server.url + "/v1/completions", {"model": "tiny-random", "prompt": p, "max_tokens": 30, "temperature": 0,
                                                          "stop": [stop], "ignore_eos": True, "logprobs": 0})
    assert status == 200
    (ch,) = body["choices"]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop and ch["text"] == c.text[:-len(stop)]
    assert ch["logprobs"]["token_logprobs"] == pytest.approx(c.logprobs, abs=1e-6)


def test_completion_choice_mapping_follows_vllm():
    base = {"index": 0, "text": "ab", "logprobs": {"tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-0.5, -1.0]}}
    eos = _completion({**base, "finish_reason": "stop", "stop_reason": None})
    assert (eos.token_ids, eos.logprobs, eos.finish_reason) == ([5, 9], [-0.5, -1.0], "eos")
    assert _completion({**base, "finish_reason": "stop", "stop_reason": "b"}).finish_reason == "stop"
    assert _completion({**base, "finish_reason": "stop", "stop_reason": 2}).finish_reason == "eos"  # a stop token id
    assert _completion({**base, "finish_reason": "length", "stop_reason": None}).finish_reason == "length"
    assert _completion({**base, "token_ids": [7, 8], "finish_reason": "length"}).token_ids == [7, 8]  # newer vLLM field wins
    with pytest.raises(ServerError, match="token_id:N"):
        _completion({**base, "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1, -1]}, "finish_reason": "length"})
    with pytest.raises(ServerError, match="finish_reason"):
        _completion({**base, "finish_reason": "abort"})


def _perturb(policy, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    policy.version += 1


def test_adapters_load_per_role_and_new_versions_change_outputs(server, tmp_path):
    router = PolicyRouter("lora_per_role", ["planner", "coder"], "tiny-random", LORA, lr=1e-2, seed=0)
    tok = router.tokenizer
    local = HFEngine(lambda name: router.policies[name].generation_model(), tok)
    http = HTTPEngine(server.url, tok, adapter_dir=tmp_path / "adapters",
                      save_adapter=lambda name, folder: router.policies[name].save_adapter(folder))
    _perturb(router.policies["planner"], 1)
    _perturb(router.policies["coder"], 2)
    for name in ("planner", "coder"):
        http.sync_weights(name)
    models = {m["id"]: m for m in json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=30).read())["data"]}
    assert models["planner"]["parent"] == "tiny-random" and models["planner"]["version"] == 1
    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=8, temperature=0.8, ignore_eos=True), n=2) for p in _prompts(tok, 2)]
    outs = {}
    for name in ("planner", "coder", "tiny-random"):
        outs[name] = http.generate(name, reqs, seed=3)
        if name != "tiny-random":
            _assert_same(outs[name], local.generate(name, reqs, seed=3))
    # each role's adapter is its own model, and neither is the base
    assert len({json.dumps(_flat(o)) for o in outs.values()}) == 3
    # an update: a new version is saved and loaded; outputs change and match the in-process engine again
    _perturb(router.policies["planner"], 3)
    http.sync_weights("planner")
    after = http.generate("planner", reqs, seed=3)
    assert _flat(after) != _flat(outs["planner"])
    _assert_same(after, local.generate("planner", reqs, seed=3))
    assert [p.name for p in (tmp_path / "adapters" / "planner").iterdir()] == ["v000002"]  # old versions are removed
    models = {m["id"]: m for m in json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=30).read())["data"]}
    assert models["planner"]["version"] == 1  # unload + load (vLLM's way) starts the name afresh
    # load_inplace replaces an adapter under its name and bumps its version
    status, body = _post(server.url + "/v1/load_lora_adapter", {"lora_name": "coder", "lora_path": models["planner"]["root"],
                                                                 "load_inplace": True})
    assert status == 200 and body["version"] == 2
    _assert_same(http.generate("coder", reqs, seed=3), after)
    # unload: the name is gone
    assert _post(server.url + "/v1/unload_lora_adapter", {"lora_name": "coder"})[0] == 200
    with pytest.raises(ServerError, match="HTTP 404.*'coder' does not exist"):
        http.generate("coder", reqs, seed=3)
    assert _post(server.url + "/unload_lora_adapter", {"lora_name": "planner"})[0] == 200  # SGLang's spelling


def test_bad_requests_get_clear_json_errors(server, tmp_path):
    url = server.url
    cases = [
        ({"model": "nope", "prompt": [1, 2]}, 404, "model", "'nope' does not exist"),
        ({"model": "tiny-random", "prompt": [1, 2], "best_of": 2}, 400, "best_of", "unsupported field"),
        ({"model": "tiny-random", "prompt": [1, 2], "temperature": -1}, 400, "temperature", "temperature"),
        ({"model": "tiny-random", "prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ({"model": "tiny-random", "prompt": []}, 400, "prompt", "token ids"),
        ({"model": "tiny-random", "prompt": [[1, 2], "x", 3]}, 400, "prompt", "token ids"),
        ({"model": "tiny-random", "prompt": [10 ** 9]}, 400, "prompt", "outside the vocabulary"),
        ({"model": "tiny-random", "prompt": [1], "logprobs": 5}, 400, "logprobs", "not supported"),
        ({"model": "tiny-random", "prompt": [1], "stream": True}, 400, "stream", "only false"),
        ({"prompt": [1]}, 400, "model", "required"),
        ({"model": "tiny-random", "prompt": [1], "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens", "min_tokens=3"),
    ]
    for body, status, param, words in cases:
        got, err = _post(url + "/v1/completions", body)
        assert got == status, body
        assert err["error"]["code"] == status and err["error"]["param"] == param and words in err["error"]["message"], err
    assert _post(url + "/v1/completions", None, raw=b"{not json")[0] == 400
    status, err = _post(url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert status == 400 and "no adapter_config.json" in err["error"]["message"]
    status, err = _post(url + "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert status == 404 and "not loaded" in err["error"]["message"]
    status, err = _post(url + "/v1/chat/completions", {})
    assert status == 404 and "/v1/completions" in err["error"]["message"]
    # the client turns these into ServerError naming the status and the server's message
    with pytest.raises(ServerError, match="HTTP 404"):
        HTTPEngine(url).generate("nope", [GenerationRequest([1, 2])])
    with pytest.raises(ServerError, match="does not serve base model 'smollm2-135m'"):
        HTTPEngine(url).check_base_model("smollm2-135m")


def test_reload_weights_refuses_what_does_not_fit_the_base_model(server, tmp_path):
    """POST /collective_rpc reload_weights (vLLM's full-weight reload): a folder without safetensors, weights of
    another shape or name, another method: 400 naming the field; the base model is left as it was."""
    from safetensors.torch import save_file

    url, base = server.url + "/collective_rpc", server.model_server.base
    before = {n: p.clone() for n, p in base.named_parameters()}
    save_file({"model.not_a_layer.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    cases = [({"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "empty")}}, "weights_path",
              "not a folder holding *.safetensors"),
             ({"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}, "weights_path",
              "does not fit base model 'tiny-random' (unknown ['model.not_a_layer.weight']"),
             ({"method": "sleep"}, "method", "only reload_weights")]
    for body, param, words in cases:
        status, err = _post(url, body)
        assert status == 400 and err["error"]["param"] == param and words in err["error"]["message"], err
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())
    assert _post(server.url + "/reset_prefix_cache", {}) == (200, {"success": True})


def test_reload_weights_from_a_malformed_or_misshapen_safetensors_folder_is_a_400_like_load_lora_adapter(server,
                                                                                                      tmp_path):
    # old: 500 (SafetensorError from load_file; RuntimeError from copy_) where /v1/load_lora_adapter answers 400
    from safetensors.torch import save_file

    url, base = server.url + "/collective_rpc", server.model_server.base
    before = {n: p.clone() for n, p in base.named_parameters()}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 64)
    name, weight = next(iter(base.named_parameters()))
    (tmp_path / "shape").mkdir()
    full = {n: p.detach().clone() for n, p in base.named_parameters()}
    save_file({**full, name: torch.zeros(3, 5)}, str(tmp_path / "shape" / "model.safetensors"))
    for folder, words in (("bad", "did not load"), ("shape", f"{name} has shape [3, 5], the base model's is")):
        status, err = _post(url, {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / folder)}})
        assert status == 400 and err["error"]["param"] == "weights_path" and words in err["error"]["message"], err
    status, err = _post(server.url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "bad")})
    assert status == 400
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())


def test_unreachable_server_is_named():
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerError, match=f"could not reach the server.*127.0.0.1:{port}"):
        HTTPEngine(f"http://127.0.0.1:{port}", timeout=10).models()


def test_training_through_the_server_equals_training_in_process(server, tmp_path):
    from teamrl.trainer.trainer import Trainer

    common = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=12", "rollout.batch_size=2", "rollout.group_size=4",
              "run.progress=false", "run.tensorboard=false", "train.lr=5e-2", "policy.lora.r=4", "train.steps=2",
              f"run.dir={tmp_path}", "policy.mode=shared"]
    local = Trainer(load_config(None, [*common, "name=local"]))
    remote = Trainer(load_config(None, [*common, "name=remote", "rollout.engine=http", f"rollout.server_url={server.url}"]))
    assert type(remote.engine).__name__ == "HTTPEngine"
    for _ in range(2):
        a, b = local.train_step(), remote.train_step()
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-9)
        assert a["engine_calls"] == b["engine_calls"]
        assert a["grad_norm/shared"] > 0  # the adapter really changes, so step 2 tests the sync

    def episodes(name):
        return [(e["role"], e["completion"], e["completion_tokens"], e["finish_reason"]) for e in map(json.loads, (tmp_path / name / "episodes" / "step_000002.jsonl").read_text().splitlines())]

    assert episodes("local") == episodes("remote")  # step 2 sampled from the updated, synced adapters
    name = remote.engine.served["shared"]  # named per run and process: shared@remote-<6 hex>
    assert name.startswith("shared@remote-") and len(name) == len("shared@remote-") + 6
    served = {m["id"] for m in json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=30).read())["data"]}
    assert name in served
    assert [p.name for p in (tmp_path / "remote" / "served_adapters" / name).iterdir()] == ["v000003"]  # initial + 2 updates
    remote.shutdown()  # the end of a run unloads its adapters
    served = {m["id"] for m in json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=30).read())["data"]}
    assert served == {"tiny-random"}


def test_http_engine_full_weights_need_one_model_and_a_url():
    from teamrl.core.config import ConfigError

    assert load_config(None, ["rollout.engine=http", "policy.lora=null"]).policy.lora is None  # one model: reloaded
    with pytest.raises(ConfigError, match=r"^rollout.server_dialect: sglang cannot reload full weights"):
        load_config(None, ["rollout.engine=http", "policy.lora=null", "rollout.server_dialect=sglang"])
    with pytest.raises(ConfigError, match="rollout.server_url"):
        load_config(None, ["rollout.engine=http", "rollout.server_url=localhost:8000"])


def test_cli_serve_subprocess_answers_and_stops_cleanly(tmp_path):
    ready = tmp_path / "url"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "teamrl.cli", "serve", "--model", "tiny-random", "--port", "0",
                             "--threads", "1", "--ready-file", str(ready)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180  # only a bound on a broken start; the loop ends as soon as the file appears
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "teamrl serve did not start"
            time.sleep(0.1)
        url = ready.read_text()
        status, body = _post(url + "/v1/completions", {"model": "tiny-random", "prompt": [[5, 6, 7], [8]], "max_tokens": 3,
                                                       "temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": True})
        assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
        assert all(len(c["logprobs"]["tokens"]) == 3 and c["logprobs"]["tokens"][0].startswith("token_id:") for c in body["choices"])
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "listening on " + url in out and "stopped" in err
    with pytest.raises(ServerError, match="could not reach"):
        HTTPEngine(url, timeout=10).models()


def test_cli_serve_rejects_bad_arguments():
    from teamrl.cli import main

    assert main(["serve", "--model", "tiny-random", "--lora", "no-equals-sign"]) == 2
    if not torch.cuda.is_available():
        assert main(["serve", "--model", "tiny-random", "--device", "cuda"]) == 2


def test_an_api_key_guards_every_route_and_adapter_paths_stay_in_the_allowed_folders(tmp_path):
    """Issue 57 item 7: ``teamrl serve`` had no credential, and loaded an adapter or full weights from any path on
    the machine. Now with ``--api-key`` a request without the key is a 401 and with it a 200; a path outside the
    ``--allowed-path`` folders is a 403 naming the flag, a symlink out of them included."""
    router = PolicyRouter("lora_per_role", ["planner"], "tiny-random", LORA, lr=1e-2, seed=0)
    allowed, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    router.policies["planner"].save_adapter(allowed / "planner")
    router.policies["planner"].save_adapter(outside / "planner")
    (allowed / "link").symlink_to(outside / "planner")
    httpd = TeamrlHTTPServer(ModelServer("tiny-random", seed=0), "127.0.0.1", 0, api_key="k3y",
                             allowed_paths=[str(allowed)])
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()

    def post(path: str, body: dict, key: str | None) -> tuple[int, dict]:
        req = urllib.request.Request(httpd.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        load = {"lora_name": "planner", "lora_path": str(allowed / "planner")}
        for path, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", {"lora_name": "planner"}),
                           ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(allowed)}}),
                           ("/v1/completions", {"model": "tiny-random", "prompt": [1, 2], "max_tokens": 1})):
            for key in (None, "wrong"):
                status, err = post(path, body, key)
                print(f"{path} with key {key}: {status}")
                assert status == 401 and err["error"]["param"] == "authorization", (path, key, status, err)
        assert post("/v1/load_lora_adapter", load, "k3y")[0] == 200
        assert post("/v1/completions", {"model": "planner", "prompt": [1, 2], "max_tokens": 1}, "k3y")[0] == 200
        assert post("/v1/unload_lora_adapter", {"lora_name": "planner"}, "k3y")[0] == 200
        for path, body, field in (
                ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(outside / "planner")}, "lora_path"),
                ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(allowed / "link")}, "lora_path"),
                ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(allowed / ".." / "elsewhere")},
                 "lora_path"),
                ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/etc"}}, "weights_path")):
            status, err = post(path, body, "k3y")
            print(f"{path} {body}: {status} {err['error']['message']}")
            assert status == 403 and err["error"]["param"] == field, (status, err)
            assert "--allowed-path" in err["error"]["message"] and "\n" not in err["error"]["message"], err
        assert httpd.model_server.adapters == {}
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(timeout=10)


def test_teamrl_serve_reads_its_api_key_from_the_environment_and_refuses_paths_when_no_folder_is_allowed(
        monkeypatch):
    """``TEAMRL_API_KEY`` sets ``--api-key`` (as ``VLLM_API_KEY`` does for vLLM); without ``--allowed-path`` no
    folder may be loaded from over HTTP."""
    import teamrl.rollout.server as server_module
    from teamrl.cli import main

    seen = {}
    monkeypatch.setattr(server_module, "serve", lambda ms, *a, **kw: seen.update(kw))
    monkeypatch.setenv("TEAMRL_API_KEY", "from-env")
    assert main(["serve", "--model", "tiny-random", "--port", "0"]) == 0
    assert seen["api_key"] == "from-env" and seen["allowed_paths"] == []
    assert main(["serve", "--model", "tiny-random", "--port", "0", "--api-key", "flag", "--allowed-path", "/tmp"]) == 0
    assert seen["api_key"] == "flag" and seen["allowed_paths"] == ["/tmp"]
