"""What an OpenAI-compatible completions server speaks, as :class:`~teamrl.rollout.http_engine.HTTPEngine`
reads it: the **dialects** (what differs between vLLM, SGLang and ``teamrl serve``, read in vLLM 0.33.0's and
SGLang 0.5.23's source; the module docstring of :mod:`teamrl.rollout.http_engine` says how the engine sends each),
the errors a server gives (:class:`ServerError`; :class:`ServerUnreachable` and :class:`MalformedAnswer` count
as a failed endpoint), and reading a ``/v1/completions`` answer into :class:`~teamrl.rollout.engine.Completion` objects
(``finish_reason`` mapped back to teamrl's three).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from teamrl.rollout.engine import Completion


DIALECTS = ("auto", "vllm", "sglang", "teamrl")


@dataclass(frozen=True)
class Dialect:
    """What differs between the servers' APIs, as read in their source (versions in the module docstring)."""

    name: str
    lora_prefix: str           # where load_lora_adapter / unload_lora_adapter live
    one_group_per_request: bool  # True: seeds are per request (vLLM, SGLang); False: one stream per call (teamrl serve)
    send_seed: bool
    max_stop_strings: int | None
    max_prompts: int           # prompts per request
    explicit_fields: bool      # send penalties, min_p, return_token_ids ... (teamrl serve 400s on fields it lacks)
    # full weights reloaded in place from a model folder: POST /collective_rpc {"method": "reload_weights", ...}
    # (vLLM with VLLM_SERVER_DEV_MODE=1, teamrl serve), then POST /reset_prefix_cache (keys/values of old weights)
    reloads_weights: bool = False


DIALECT_SPECS = {
    "vllm": Dialect("vllm", "/v1", True, True, 4, 1024, True, reloads_weights=True),
    "sglang": Dialect("sglang", "", True, False, None, 1024, True),
    "teamrl": Dialect("teamrl", "/v1", False, True, None, 2**31, False, reloads_weights=True),
}
# Sampling fields that must not be left to the server's generation_config defaults.
NEUTRAL_FIELDS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
                  "min_tokens": 0, "skip_special_tokens": True, "return_token_ids": True}


class ServerError(RuntimeError):
    """The server answered with an error, or could not be reached; the message says which and why."""


class ServerUnreachable(ServerError):
    """The server could not be reached: connection refused or reset, or no answer within the timeout.
    ``reason``: the request and why, in a few words (``POST /v1/completions: [Errno 111] Connection refused``)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class MalformedAnswer(ServerError):
    """The server answered 200 with something that is not a completions answer (HTML from a proxy, missing or
    mistyped fields, token ids outside the vocabulary): the endpoint is broken, as one that cannot be reached is.
    ``reason``: the request and what was wrong, in a few words."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


def short_text(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def post_completions(resp: Any, expected: int, vocab_size: int | None) -> list[Completion]:
    """The ``expected`` choices of a ``/v1/completions`` answer, in index order; ValueError (a few words) for an
    answer that is not one: not a JSON object, choices missing, mistyped, not indexed 0..expected-1, or holding
    token ids outside [0, vocab_size)."""
    if not isinstance(resp, dict):
        raise ValueError(f"not a JSON object but {short_text(resp)}")
    choices = resp.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise ValueError(f"choices: expected a list of objects, got {short_text(choices)}")
    indices = [c.get("index") for c in choices]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices) or sorted(indices) != list(
        range(expected)
    ):
        raise ValueError(f"choices: expected {expected} indexed 0 to {expected - 1}, got indices {short_text(indices)}")
    out = []
    for c in sorted(choices, key=lambda c: c["index"]):
        try:
            completion = _completion(c)
        except ServerError as e:
            raise ValueError(f"choice {c['index']}: {e}") from None
        bad = [t for t in completion.token_ids if not (0 <= t < vocab_size if vocab_size is not None else 0 <= t)]
        if bad:
            raise ValueError(f"choice {c['index']}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        out.append(completion)
    return out


def _completion(choice: dict[str, Any]) -> Completion:
    """One OpenAI/vLLM/SGLang completion choice -> a :class:`Completion` (:class:`ServerError` for a malformed one)."""
    lp = choice.get("logprobs") or {}
    if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs") or [], list):
        raise ServerError(f"logprobs: expected an object with a list token_logprobs, got {short_text(lp)}")
    try:
        logprobs = [float(x) if x is not None else float("nan") for x in (lp.get("token_logprobs") or [])]
    except (TypeError, ValueError):
        raise ServerError(
            f"logprobs.token_logprobs: expected numbers, got {short_text(lp.get('token_logprobs'))}"
        ) from None
    ids = choice.get("token_ids")
    if ids is not None and not (
        isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise ServerError(f"token_ids: expected a list of integers, got {short_text(ids)}")
    if ids is None:
        tokens = lp.get("tokens")
        if tokens is None:
            raise ServerError("a completion choice has neither token_ids nor logprobs.tokens; the server must support "
                              "logprobs and return_token_ids (vLLM and SGLang do)")
        try:
            ids = [int(t.split("token_id:", 1)[1]) for t in tokens]
        except (IndexError, ValueError, AttributeError, TypeError):
            raise ServerError(
                f"logprobs.tokens are not 'token_id:N' strings (got {tokens[:3]}) and there are no token_ids; the "
                "server ignored return_tokens_as_token_ids and return_token_ids"
            ) from None
    if len(logprobs) != len(ids):
        raise ServerError(f"a completion has {len(ids)} tokens but {len(logprobs)} log-probs")
    reason = choice.get("finish_reason")
    # vLLM: stop_reason (None: EOS; int: a stop token id; str: a stop string); SGLang: matched_stop (the EOS id or
    # the string).
    stop_reason = choice["stop_reason"] if "stop_reason" in choice else choice.get("matched_stop")
    text = choice.get("text", "")
    if not isinstance(text, str):
        raise ServerError(f"text: expected a string, got {short_text(text)}")
    if reason == "length":
        finish = "length"
    elif reason in ("stop", "eos") and isinstance(stop_reason, str):
        finish = "stop"
        if not text.endswith(stop_reason):  # SGLang drops the stop string whatever include_stop_str_in_output says
            text += stop_reason
    elif reason in ("stop", "eos"):
        finish = "eos"  # stop_reason None (EOS) or a stop token id
    else:
        raise ServerError(f"unknown finish_reason {reason!r}; expected 'stop' or 'length'")
    return Completion(list(ids), logprobs, text, finish)
