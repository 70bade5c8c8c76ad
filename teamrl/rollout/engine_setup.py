"""Setting up the rollout engine a run asks for (``rollout.engine``): in process, a server, or a pool of servers.

:func:`make_engine` returns the in-process :class:`~teamrl.rollout.hf_engine.HFEngine`, or a client of a
``teamrl serve`` / vLLM / SGLang server (``http``), or of vLLM servers started for the run (``vllm``); several
servers make a pool (:class:`~teamrl.rollout.pool.EnginePool`), each endpoint checked and synced as one server is.
A server gets the initial weights (``send_initial``: the run's weight sync) before its start-up check compares its
log-probs with the trainer's (:func:`probe_logprobs`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from teamrl.core.config import Config, ConfigError
from teamrl.core.seeding import derive_seed
from teamrl.policies.chat import encode_chat
from teamrl.policies.logprobs import build_token_batch, completion_logprobs, to_device, truncated_token_logprobs
from teamrl.policies.multi_lora import SharedBaseAdapters
from teamrl.policies.router import PolicyRouter
from teamrl.rollout.engine import Engine, GenerationRequest, SamplingParams
from teamrl.rollout.hf_engine import HFEngine

# The prompt of the HTTP engine's start-up check (any prompt works: it only needs long, sampled completions).
STARTUP_PROBE = "Write a few words about the weather."
# The prompts of the sync check after every adapter load: fixed (each check also scores the last one's tokens) and
# short, without the chat template (any tokens exercise the adapter; the trainer's forward is most of the check's cost)
SYNC_PROBES = ("The weather today is", "Three colours I like are")

# The trainer's log-probs of completions under a policy's current weights: (policy, prompt_ids, completions,
# temperature, top_k, top_p) -> one list per completion (:func:`probe_logprobs`).
ProbeLogprobs = Callable[..., list[list[float]]]


def probe_logprobs(router: PolicyRouter, policy: str, prompt_ids: list[int] | list[list[int]], completions: list,
                   temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[list[float]]:
    """The log-probs of ``completions`` of ``prompt_ids`` (one prompt, or one per completion) under ``policy``'s
    current weights in ``router``, in one forward (the start-up and sync checks compare the server's with them); with
    ``top_k``/``top_p``, those of the truncated and renormalised distribution a server samples from
    (:func:`truncated_token_logprobs`)."""
    prompts = prompt_ids if prompt_ids and isinstance(prompt_ids[0], list) else [prompt_ids] * len(completions)
    batch = build_token_batch(prompts, [c.token_ids for c in completions], router.tokenizer.pad_token_id)
    with router.policies[policy].generation_model() as model, torch.no_grad():
        batch = to_device(batch, next(model.parameters()).device)
        if top_k <= 0 and top_p >= 1:
            lp, _ = completion_logprobs(model, batch, temperature or 1.0)
        else:
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                        use_cache=False, logits_to_keep=batch.completion_len + 1)
            # one row at a time: the sort of top-p over the vocabulary at every position is large
            lp = torch.stack([truncated_token_logprobs(out.logits[i, :-1], batch.completion_ids[i], temperature, top_k,
                                                       top_p) for i in range(len(completions))])
    return [lp[i, :len(c.token_ids)].tolist() for i, c in enumerate(completions)]


def make_engine(cfg: Config, router: PolicyRouter, eos_ids: list[int], run_dir: Path, params: SamplingParams,
                send_initial: Callable[[Engine], None], verify: ProbeLogprobs) -> tuple[Engine, list[Any]]:
    """The in-process engine, or (``rollout.engine=http``) a client of a ``teamrl serve`` / vLLM / SGLang server, or
    (``rollout.engine=vllm``) a client of vLLM servers started here for the run.
    Several servers (``rollout.server_urls``, ``rollout.vllm.servers``, or servers placed by Ray) make a pool
    (:class:`~teamrl.rollout.pool.EnginePool`), each endpoint checked and synced as one server is.
    Returns (engine, the vLLM servers started for the run: the caller stops them with :func:`stop_vllm_servers`;
    on an error here they are stopped before it is raised). ``send_initial(engine)`` uploads every policy's initial
    weights; ``verify`` gives the trainer's log-probs for the start-up and sync checks (:func:`probe_logprobs`)."""
    if cfg.rollout.engine == "hf":
        # LoRA policies on one base decode together through it, each row with its own adapter (no merged copies)
        return HFEngine(lambda name: router.policies[name].generation_model(), router.tokenizer, device=router.device,
                        extra_eos_ids=eos_ids, row_models=SharedBaseAdapters(router.policies)), []
    from tqdm import tqdm

    from teamrl.rollout.completions_api import ServerError
    from teamrl.rollout.http_engine import HTTPEngine
    from teamrl.rollout.pool import EnginePool
    from teamrl.rollout.vllm_server import check_lora_slots, check_served_model, explain_lora_error

    r = cfg.rollout
    adapter_dir = (Path(r.adapter_dir) if r.adapter_dir else run_dir / "served_adapters").resolve()
    # adapters named per process (<policy>@<run>-<id>): a second run, a resume or another run on the same server
    # never meets a name already loaded there
    urls, dialect = list(r.server_urls) or [r.server_url], r.server_dialect
    # separate full-weight policies: a server holds one model, so each policy has its own server (PolicyRoutes)
    full = [name for name, p in router.policies.items() if p.adapter is None]
    own_server = len(full) > 1
    if own_server and r.engine == "vllm" and r.vllm.servers not in (1, len(full)):
        raise ConfigError(f"rollout.vllm.servers: {r.vllm.servers}; the {len(full)} full-weight policies "
                          f"({', '.join(full)}) need one server each: give {len(full)} (or 1)")
    if own_server and r.engine == "http" and len(urls) != len(full):
        raise ConfigError(f"rollout.server_urls: {len(urls)} server(s) for {len(full)} full-weight policies "
                          f"({', '.join(full)}); each needs its own server: give {len(full)} URLs, in that order")
    exited: list = [None] * len(urls)
    servers: list[Any] = []
    if r.engine == "vllm":
        from teamrl.rollout.vllm_placement import start_servers

        if own_server:  # one managed server per policy
            cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(r, vllm=dataclasses.replace(
                r.vllm, servers=len(full))))
        servers = start_servers(cfg, run_dir, len(router.policies), log=lambda line: tqdm.write(line, file=sys.stderr))
        urls, dialect = [s.url for s in servers], "vllm"
        exited = [s.exit_reason for s in servers]
    tag = f"{cfg.name}-{uuid.uuid4().hex[:6]}"
    # in a pool each endpoint has its own adapter names (and so its own adapter folders): _e1, _e2, ... (no "." or
    # "-": PEFT refuses dots in adapter names, and release_stale reads the run name up to the last "-")
    # token ids an answer may hold: the model's embedding rows (a padded vocabulary has more than the tokenizer)
    model = getattr(next(iter(router.policies.values()), None), "model", None)  # None: policies on workers
    vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else 0
    engines = [
        HTTPEngine(
            url,
            router.tokenizer,
            adapter_dir=adapter_dir,
            # a managed server's own key; a server the user started with --api-key (teamrl serve, vLLM): the same key,
            # from the same variable
            api_key=(servers[i].api_key if servers else os.environ.get("TEAMRL_API_KEY")) or None,
            dialect=dialect,
            request_deadline_s=r.request_deadline_s,
            vocab_size=max(vocab, len(router.tokenizer)),
            save_adapter=lambda name, folder: router.policies[name].save_adapter(folder),
            save_weights=lambda name, folder: router.policies[name].save_weights(folder),
            full_weights=[full[i]] if own_server else full,
            adapter_tag=tag if len(urls) == 1 else f"{tag}_e{i + 1}",
            verify_logprobs=verify if r.server_sync_check else None,
            verify_tolerance=r.server_check_tolerance,
            probe_prompts=[router.tokenizer(p, add_special_tokens=False)["input_ids"] for p in SYNC_PROBES],
            log=tqdm.write,
        )
        for i, url in enumerate(urls)
    ]
    engine: Engine
    if own_server:
        from teamrl.rollout.policy_routes import PolicyRoutes

        engine = PolicyRoutes(dict(zip(full, engines)))
    elif len(engines) == 1:
        engine = engines[0]
    else:
        engine = EnginePool(engines, names=urls, on_failure=r.on_endpoint_failure,
                            log=lambda line: tqdm.write(line, file=sys.stderr), exited=exited)
    # the policies each server serves: every one, or its own
    served_by = [[p] for p in full] if own_server else [list(router.policies)] * len(engines)
    try:
        for e in engines:
            if e.dialect == "vllm":
                check_served_model(e, cfg.model)  # one line naming --served-model-name
            e.check_base_model(cfg.model)
            stale = e.release_stale()
            if stale:
                print(f"teamrl: unloaded {len(stale)} adapter(s) an earlier process of this run left on {e.base_url}: "
                      f"{', '.join(stale)}", file=sys.stderr)
        send_initial(engine)  # the server holds none of this run's adapters yet
        if r.server_check:
            for e, policies in zip(engines, served_by):
                truncated = e.processed_logprobs and params.temperature > 0 and (r.top_k > 0 or r.top_p < 1)
                f = e.startup_check(cfg.model, policies, params, r.group_size,
                                    encode_chat(router.tokenizer, STARTUP_PROBE), verify,
                                    tolerance=r.server_check_tolerance, seed=derive_seed(cfg.seed, 0, 3))
                print(
                    f"teamrl: start-up check of {e.base_url} ({e.dialect}): {f['distinct']:.0f} of {f['group']:.0f} "
                    f"samples distinct (fewest over {len(policies)} policies); log-probs vs the trainer's under "
                    f"temperature {params.temperature}, top_k {params.top_k}, top_p {params.top_p}"
                    f"{' (truncated and renormalised as the server samples)' if truncated else ''}: "
                    f"max gap {f['logprob_gap']:.2e}, mean {f['logprob_mean_gap']:.2e} over {f['tokens']:.0f} tokens; "
                    f"tolerance {f['tolerance']:g}",
                    flush=True,
                )
        for e in engines if not full else ():  # full weights: no adapters, no LoRA slots
            if e.dialect == "vllm":  # one line naming --max-loras when the policies cannot all be served at once
                probe = [
                    GenerationRequest(encode_chat(router.tokenizer, STARTUP_PROBE), SamplingParams(max_new_tokens=1))
                ]
                check_lora_slots(e, list(router.policies), probe=lambda e=e: e.generate(cfg.model, probe))
    except ServerError as e:  # an adapter the server would not load: name the vLLM flag that would
        try:
            engine.close()
        finally:
            stop_vllm_servers(servers)
        lora = cfg.policy.lora
        raise explain_lora_error(e, lora.r if lora is not None else 0) from None
    except BaseException:
        try:
            engine.close()  # a failed check leaves nothing of this run on the server
        finally:
            stop_vllm_servers(servers)
        raise
    if own_server:
        print(f"teamrl: one rollout server per full-weight policy: "
              f"{', '.join(f'{p} at {u}' for p, u in zip(full, urls))}", file=sys.stderr)
    elif len(engines) > 1:
        print(f"teamrl: a pool of {len(engines)} rollout endpoints ({', '.join(urls)}); each policy's requests are "
              f"spread over them; on a failed endpoint: {r.on_endpoint_failure} (rollout.on_endpoint_failure)",
              file=sys.stderr)
    return engine, servers



def stop_vllm_servers(servers: list[Any]) -> None:
    """Stop the vLLM server(s) a run started (``rollout.engine=vllm``; on Ray: the servers, then their actors); every
    one is stopped even when one fails, and the first failure raised after."""
    from tqdm import tqdm

    errors = []
    for server in servers:
        try:
            server.stop(log=lambda line: tqdm.write(line, file=sys.stderr))
        except Exception as e:  # stop the others all the same
            errors.append(e)
    if errors:
        raise errors[0]
