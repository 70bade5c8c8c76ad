"""The HTTP engine against `teamrl serve --strict`: the behaviours of vLLM 0.33.0 and SGLang 0.5.23 that
break RL training silently (issue 19). Each behaviour the strict server imitates was read in that
version's source, not run: see teamrl/rollout/strict_server.py."""

import contextlib
import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from teamrl.core.config import LoraConfig, load_config
from teamrl.policies.chat import encode_chat
from teamrl.policies.logprobs import build_token_batch, completion_logprobs
from teamrl.policies.router import PolicyRouter
from teamrl.rollout.completions_api import ServerError
from teamrl.rollout.engine import GenerationRequest, SamplingParams
from teamrl.rollout.http_engine import HTTPEngine
from teamrl.rollout.server import ModelServer, TeamrlHTTPServer
from teamrl.rollout.strict_server import StrictBehaviour

LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])


@contextlib.contextmanager
def strict_server(flavor="vllm", **behaviour):
    """`teamrl serve --strict FLAVOR` for tiny-random (seed 0) in a thread on a free port of 127.0.0.1."""
    if flavor == "sglang":
        behaviour.setdefault("max_stop_strings", None)
    httpd = TeamrlHTTPServer(ModelServer("tiny-random", seed=0, strict=StrictBehaviour(flavor, **behaviour)), "127.0.0.1", 0)
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(timeout=10)


@pytest.fixture(scope="module")
def vllm_server():
    with strict_server("vllm") as s:
        yield s


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _trainer_logprobs(model, prompt, completions, temperature):
    """The trainer's log-probs (softmax(logits / T), T = 1 for greedy) of each completion's tokens."""
    batch = build_token_batch([prompt] * len(completions), [c.token_ids for c in completions], pad_id=0)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, temperature or 1.0)
    return [lp[i, :len(c.token_ids)].tolist() for i, c in enumerate(completions)]


def _max_gap(completions, reference):
    return max(abs(a - b) for c, r in zip(completions, reference) for a, b in zip(c.logprobs, r))


# ---- finding 1: one seed per request -------------------------------------------------------------

def test_vllm_identical_prompts_of_a_group_give_distinct_samples(vllm_server):
    """vLLM 0.33.0 seeds every prompt of a request with the request's seed: GRPO's G copies of one prompt (n=1 each)
    came back as G copies of one completion."""
    tok = vllm_server.model_server.tokenizer
    prompt = encode_chat(tok, "Tell me a story.")
    group = [GenerationRequest(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), n=1) for _ in range(8)]
    out = HTTPEngine(vllm_server.url, tok).generate("tiny-random", group, seed=3)
    assert len({tuple(c[0].token_ids) for c in out}) == 8


def test_vllm_no_two_sequences_of_one_call_share_a_seed(vllm_server):
    """vLLM 0.33.0 gives sample j of every prompt of a request the seed seed + j: two agents' j-th samples were
    drawn with the same noise (correlated agents in MAGRPO)."""
    ms = vllm_server.model_server
    prompts = [encode_chat(ms.tokenizer, "planner says"), encode_chat(ms.tokenizer, "coder says")]
    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=4, ignore_eos=True), n=4) for p in prompts]
    ms.row_seeds.clear()
    HTTPEngine(vllm_server.url, ms.tokenizer).generate("tiny-random", reqs, seed=7)
    assert len(ms.row_seeds) == 8 and None not in ms.row_seeds
    assert len(set(ms.row_seeds)) == 8, ms.row_seeds


# ---- finding 2: generation_config defaults -------------------------------------------------------

def test_vllm_generation_config_defaults_do_not_reach_sampling():
    """vLLM 0.33.0 (--generation-config auto) fills unset penalties and min_p from generation_config.json: the
    server sampled from another distribution than the trainer's softmax(logits / T)."""
    with strict_server("vllm", logprobs_mode="processed_logprobs",
                       generation_defaults={"repetition_penalty": 1.5, "min_p": 0.05, "presence_penalty": 0.5}) as s:
        ms = s.model_server
        prompt = encode_chat(ms.tokenizer, "Say it again and again.")
        out = HTTPEngine(s.url, ms.tokenizer).generate(
            "tiny-random", [GenerationRequest(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), n=3)], seed=1)[0]
        gap = _max_gap(out, _trainer_logprobs(ms.base, prompt, out, 1.0))
    assert gap < 1e-4, f"server and trainer log-probs differ by up to {gap:.4f}"


# ---- finding 3: SGLang's API ---------------------------------------------------------------------

def _perturb(policy, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    policy.version += 1


def test_sglang_adapters_load_at_its_paths_and_are_selected(tmp_path):
    """SGLang 0.5.23: LoRA load/unload at /load_lora_adapter (no /v1); a request picks an adapter by `base:adapter`,
    and an unknown model name silently samples from the base."""
    router = PolicyRouter("lora_per_role", ["planner", "coder"], "tiny-random", LORA, lr=1e-2, seed=0)
    for i, name in enumerate(("planner", "coder")):
        _perturb(router.policies[name], i + 1)
    with strict_server("sglang", logprobs_mode="processed_logprobs") as s:
        http = HTTPEngine(s.url, router.tokenizer, adapter_dir=tmp_path / "adapters",
                          save_adapter=lambda name, folder: router.policies[name].save_adapter(folder))
        http.check_base_model("tiny-random")
        for name in ("planner", "coder"):
            http.sync_weights(name)
        http.sync_weights("planner")  # a second version replaces the first
        assert set(s.model_server.adapters) == {"planner", "coder"}
        prompt = encode_chat(router.tokenizer, "plan it")
        req = [GenerationRequest(prompt, SamplingParams(max_new_tokens=8, temperature=0.8, ignore_eos=True), n=2)]
        for name in ("planner", "coder"):
            out = http.generate(name, req, seed=2)[0]
            with router.policies[name].generation_model() as m:
                own = _max_gap(out, _trainer_logprobs(m, prompt, out, 0.8))
            base = _max_gap(out, _trainer_logprobs(s.model_server.base, prompt, out, 0.8))
            assert own < 1e-4 < base, (name, own, base)


def test_sglang_token_ids_and_stop_strings():
    """SGLang 0.5.23 ignores return_tokens_as_token_ids and include_stop_str_in_output and reports the stop in
    matched_stop: token ids must come from return_token_ids, and a stop-string finish is `stop` with the
    stop string kept in the text (as the in-process engine keeps it)."""
    with strict_server("sglang") as s:
        tok = s.model_server.tokenizer
        prompt = encode_chat(tok, "count")
        http = HTTPEngine(s.url, tok)
        free = http.generate("tiny-random", [GenerationRequest(prompt, SamplingParams(max_new_tokens=30, temperature=0))])[0][0]
        assert free.token_ids and free.finish_reason == "length"
        stop = tok.decode(free.token_ids[:12], skip_special_tokens=True)[-2:]
        (c,) = http.generate("tiny-random", [GenerationRequest(prompt, SamplingParams(max_new_tokens=30, temperature=0, stop=(stop,)))])[0]
    assert c.finish_reason == "stop" and c.text.endswith(stop)
    assert c.token_ids == free.token_ids[:len(c.token_ids)] and len(c.token_ids) <= 12


# ---- finding 4: log-probs, greedy groups, limits -------------------------------------------------

def test_startup_check_refuses_raw_logprobs_below_temperature_1(vllm_server, tmp_path):
    """vLLM 0.33.0 returns raw log-probs (temperature 1) unless started with --logprobs-mode processed_logprobs:
    at temperature 0.7 the reported log-probs are not the sampling distribution's. The start-up check refuses."""
    ms = vllm_server.model_server
    prompt = encode_chat(ms.tokenizer, "probe")

    def logprobs_of(policy, prompt_ids, completions, temperature):
        return _trainer_logprobs(ms.base, prompt_ids, completions, temperature)

    http = HTTPEngine(vllm_server.url, ms.tokenizer)
    figures = http.startup_check("tiny-random", [], SamplingParams(max_new_tokens=8, temperature=1.0), 4, prompt, logprobs_of)
    assert figures["distinct"] == 4 and figures["logprob_gap"] < 1e-4
    with pytest.raises(ServerError, match=r"log-probs .* differ .* processed_logprobs") as e:
        http.startup_check("tiny-random", [], SamplingParams(max_new_tokens=8, temperature=0.7), 4, prompt, logprobs_of)
    assert "\n" not in str(e.value)
    with strict_server("vllm", logprobs_mode="processed_logprobs") as s:
        figures = HTTPEngine(s.url, ms.tokenizer).startup_check("tiny-random", [], SamplingParams(max_new_tokens=8, temperature=0.7),
                                                                4, prompt, logprobs_of)
    assert figures["distinct"] == 4 and figures["logprob_gap"] < 1e-4
    with pytest.raises(ServerError, match="start-up check: rollout.stop: 5 stop strings"):
        http.startup_check("tiny-random", [], SamplingParams(stop=tuple("abcde")), 4, prompt, logprobs_of)


def test_trainer_runs_the_startup_check(vllm_server, tmp_path):
    """Training through a vLLM-like server in its default (raw log-probs) mode at temperature 0.7 is refused at start."""
    from teamrl.trainer.trainer import Trainer

    cfg = load_config(None, ["model=tiny-random", "threads=1", "rollout.max_new_tokens=6", "rollout.group_size=2",
                             "rollout.temperature=0.7", "run.progress=false", "run.tensorboard=false", f"run.dir={tmp_path}",
                             "policy.lora.r=4", "rollout.engine=http", f"rollout.server_url={vllm_server.url}"])
    with pytest.raises(ServerError, match="start-up check: the server's log-probs"):
        Trainer(cfg)


def test_startup_check_refuses_identical_samples_in_a_group(vllm_server):
    """A server that gives a group G copies of one completion is refused before training (here: an engine that
    sends the group as G prompts with one seed, the old way)."""
    ms = vllm_server.model_server
    http = HTTPEngine(vllm_server.url, ms.tokenizer)
    http.merge_groups = False  # the engine's old request shape
    with pytest.raises(ServerError, match="identical"):
        http.startup_check("tiny-random", [], SamplingParams(max_new_tokens=8), 4, encode_chat(ms.tokenizer, "probe"),
                           lambda *a: [list(c.logprobs) for c in a[2]])


def test_vllm_greedy_group_is_served(vllm_server, tiny_engine):
    """vLLM 0.33.0 refuses n > 1 at temperature 0 (MAGRPO/AT-GRPO greedy with G > 1)."""
    tok = vllm_server.model_server.tokenizer
    prompt = encode_chat(tok, "greedy")
    req = [GenerationRequest(prompt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), n=3)]
    out = HTTPEngine(vllm_server.url, tok).generate("tiny-random", req, seed=0)[0]
    assert len(out) == 3 and len({tuple(c.token_ids) for c in out}) == 1
    assert out[0].token_ids == tiny_engine.generate("x", req, seed=0)[0][0].token_ids


def test_vllm_caps_on_stop_strings_prompts_and_context():
    """vLLM 0.33.0: at most 4 stop strings and 1024 prompts per request (here 2), and max_tokens silently cut at
    max_model_len. The engine splits prompts under the cap, and refuses too many stop strings or a completion
    that cannot fit, naming the limit, instead of a 400 or a silently short completion."""
    with strict_server("vllm", max_prompts=2) as s:
        tok = s.model_server.tokenizer
        http = HTTPEngine(s.url, tok)
        prompts = [encode_chat(tok, f"prompt {i}") for i in range(5)]
        out = http.generate("tiny-random", [GenerationRequest(p, SamplingParams(max_new_tokens=3, ignore_eos=True)) for p in prompts], seed=0)
        assert [len(o) for o in out] == [1] * 5
        with pytest.raises(ValueError, match="5 stop strings.*at most 4"):
            http.generate("tiny-random", [GenerationRequest(prompts[0], SamplingParams(stop=tuple("abcde")))], seed=0)
        limit = s.model_server.max_model_len
        long_prompt = [65] * (limit - 4)
        with pytest.raises(ValueError, match=f"max_model_len {limit}"):
            http.generate("tiny-random", [GenerationRequest(long_prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))], seed=0)


# ---- finding 5: the strict server itself ---------------------------------------------------------

def test_strict_server_answers_like_vllm(vllm_server, tmp_path):
    """teamrl serve --strict vllm: unknown fields ignored, greedy n > 1 refused, LoRA only under /v1 with vLLM's
    plain-text answer, no `version` field, owned_by vllm."""
    url = vllm_server.url
    status, body = _post(url + "/v1/completions", {"model": "tiny-random", "prompt": [5, 6], "max_tokens": 2, "best_of": 1,
                                                   "some_future_field": True})
    assert status == 200, body
    status, body = _post(url + "/v1/completions", {"model": "tiny-random", "prompt": [5, 6], "temperature": 0, "n": 2})
    assert status == 400 and "n must be 1 when using greedy sampling" in body
    router = PolicyRouter("shared", ["agent"], "tiny-random", LORA, lr=1e-2, seed=0)
    folder = router.policies["shared"].save_adapter(tmp_path / "a")
    assert _post(url + "/load_lora_adapter", {"lora_name": "a", "lora_path": str(folder)})[0] == 404
    status, body = _post(url + "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(folder)})
    assert status == 200 and body == "Success: LoRA adapter 'a' added successfully."
    assert _post(url + "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(folder)})[0] == 400
    models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"]
    assert "a" in [m["id"] for m in models] and {m["owned_by"] for m in models} == {"vllm"}
    assert all("version" not in m for m in models)
    assert _post(url + "/v1/unload_lora_adapter", {"lora_name": "a"})[0] == 200


# ---- acceptance: two GRPO steps through the strict server ----------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_through_strict_vllm_matches_in_process_in_distribution(tmp_path, temperature):
    """Two GRPO steps through a strict vLLM server (processed log-probs): every group's samples are distinct and the
    reported log-probs equal the trainer's to 1e-4, as they do in process."""
    from teamrl.trainer.trainer import Trainer

    common = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=10", "rollout.batch_size=2", "rollout.group_size=4",
              "run.progress=false", "run.tensorboard=false", "train.lr=5e-2", "policy.lora.r=4", "train.steps=2",
              f"run.dir={tmp_path}", "policy.mode=shared", f"rollout.temperature={temperature}", "rollout.ignore_eos=true"]
    with strict_server("vllm", logprobs_mode="processed_logprobs") as s:
        runs = {"local": Trainer(load_config(None, [*common, "name=local"])),
                "remote": Trainer(load_config(None, [*common, "name=remote", "rollout.engine=http", f"rollout.server_url={s.url}"]))}
        assert runs["remote"].engine.dialect == "vllm"
        for name, trainer in runs.items():
            seen = []
            rollout = trainer._rollout

            def recording(*args, _rollout=rollout, _trainer=trainer, _seen=seen):
                samples = _rollout(*args)
                with _trainer.router.policies["shared"].generation_model() as m:  # the weights that sampled them
                    for sample in samples:
                        ref = _trainer_logprobs(m, sample.prompt_ids, [_AsCompletion(sample)], temperature)[0]
                        _seen.append((sample.problem_id, tuple(sample.completion_ids), max(abs(a - b) for a, b in zip(sample.sampling_logprobs, ref))))
                return samples

            trainer._rollout = recording
            for _ in range(2):
                assert trainer.train_step()["grad_norm/shared"] > 0
            assert len(seen) == 2 * 2 * 4
            for step in (seen[:8], seen[8:]):
                groups = {}
                for problem, ids, _ in step:
                    groups.setdefault(problem, set()).add(ids)
                assert [len(g) for g in groups.values()] == [4, 4], (name, groups)
            gap = max(g for _, _, g in seen)
            assert gap < 1e-4, (name, gap)


class _AsCompletion:
    def __init__(self, sample):
        self.token_ids = sample.completion_ids


def test_engines_stop_at_generation_config_eos_ids(tiny):
    """vLLM 0.33.0 also stops at the EOS ids of generation_config (stop_reason: that id); the in-process engine and
    the trainer's loss mask now use the same ids (generation_eos_ids), so both engines end at the same token."""
    from teamrl.policies.models import generation_eos_ids
    from teamrl.rollout.hf_engine import HFEngine

    model, tok = tiny
    prompt = encode_chat(tok, "stop early")
    free = HFEngine(lambda p: contextlib.nullcontext(model), tok).generate(
        "x", [GenerationRequest(prompt, SamplingParams(max_new_tokens=12, temperature=0))])[0][0]
    extra = next(t for t in free.token_ids[2:] if t != tok.eos_token_id)
    model.generation_config.eos_token_id = [tok.eos_token_id, extra]
    ids = generation_eos_ids(model, tok)
    assert ids == [tok.eos_token_id, extra]
    req = [GenerationRequest(prompt, SamplingParams(max_new_tokens=12, temperature=0))]
    local = HFEngine(lambda p: contextlib.nullcontext(model), tok, extra_eos_ids=ids).generate("x", req)[0][0]
    with strict_server("vllm", extra_eos_ids=(extra,)) as s:
        remote = HTTPEngine(s.url, tok).generate("tiny-random", req, seed=0)[0][0]
    assert local.finish_reason == remote.finish_reason == "eos"
    assert local.token_ids == remote.token_ids == free.token_ids[:free.token_ids.index(extra) + 1]


def test_cli_strict_options_are_checked(capsys):
    from teamrl.cli import main

    assert main(["serve", "--model", "tiny-random", "--logprobs-mode", "processed_logprobs"]) == 2
    assert "need --strict" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny-random", "--strict", "vllm", "--override-generation-config", '{"bogus": 1}']) == 2
    assert "'bogus'" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny-random", "--strict", "vllm", "--override-generation-config", "[1]"]) == 2
    assert "JSON object" in capsys.readouterr().err
