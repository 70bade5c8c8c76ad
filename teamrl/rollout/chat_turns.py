"""An agent's calls as one conversation: whether a call continues the agent's previous one, and whether its
prompt still holds the earlier turn's tokens as they were sampled (the prefix).

A chat template re-renders the whole conversation at every call. Where it renders an earlier sampled answer
differently from the tokens the model sampled (it strips or reformats the text, renders tool calls its own way,
drops reasoning), the new prompt is not the previous prompt + completion: a *prefix break*. Each sample is still
trained exactly as sampled; the break means the model is shown a history it did not write, and a framework or
template that causes it is worth fixing (docs/gateway.md). The gateway detects it per call (:func:`prefix_break`)
and counts it.

For templates without tool support, :func:`restore_sampled` puts back the exact text the model sampled for an
assistant message whose tool calls the gateway itself returned (matched by call id), so the fallback rendering
(:func:`teamrl.policies.chat.render_chat`) shows the model its own tokens.
"""

from __future__ import annotations

from typing import Any, Sequence


def message_key(message: dict[str, Any]) -> tuple:
    """What identifies a message when comparing conversations: its role, text and tool calls (name, arguments)."""
    calls = tuple((c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
                  for c in message.get("tool_calls") or () if isinstance(c, dict))
    return message.get("role"), message.get("content") or "", calls, message.get("tool_call_id")


def continues(previous: Sequence[tuple], messages: Sequence[dict[str, Any]]) -> bool:
    """Whether ``messages`` continue the conversation of an earlier call (its message keys ``previous``): they
    start with the same messages, followed by an assistant message (the earlier call's answer)."""
    n = len(previous)
    return (len(messages) > n and messages[n].get("role") == "assistant"
            and [message_key(m) for m in messages[:n]] == list(previous))


def prefix_break(prompt_ids: Sequence[int], previous_prompt: Sequence[int], completions: Sequence[Sequence[int]],
                 eos_ids: Sequence[int] = ()) -> int | None:
    """None when ``prompt_ids`` start with ``previous_prompt`` + one of the earlier call's ``completions`` (a
    completion's trailing end-of-sequence token may be rendered as the template's own end token); else the first
    token position where the new prompt differs from the closest of them."""
    first_diff = 0
    for completion in completions:
        done = list(completion)
        variants = [done]
        if done and done[-1] in eos_ids:
            variants.append(done[:-1])
        for expected in variants:
            want = [*previous_prompt, *expected]
            if list(prompt_ids[:len(want)]) == want:
                return None
            at = next((i for i, (a, b) in enumerate(zip(prompt_ids, want)) if a != b), min(len(prompt_ids), len(want)))
            first_diff = max(first_diff, at)
    return first_diff


def restore_sampled(messages: Sequence[dict[str, Any]], sampled: dict[str, str]) -> list[dict[str, Any]]:
    """``messages`` with each assistant message whose tool calls all came from the gateway (ids in ``sampled``, the
    text each was parsed from) rendered as that exact text: content = the sampled text, no ``tool_calls``."""
    out = []
    for m in messages:
        ids = [c.get("id") for c in m.get("tool_calls") or () if isinstance(c, dict)]
        texts = {sampled.get(i) for i in ids}
        if m.get("role") == "assistant" and ids and len(texts) == 1 and None not in texts:
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": sampled[ids[0]]}
        out.append(m)
    return out
