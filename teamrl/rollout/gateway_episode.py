"""An episode as the training gateway sees it (:class:`GatewayEpisode`), what the gateway reads of its context
(:class:`EpisodeHost`) and :class:`ClientGone`: shared by the gateway's table of episodes
(:mod:`teamrl.rollout.gateway`) and its HTTP routes (:mod:`teamrl.rollout.gateway_app`), so that neither
imports the other for them."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol

from teamrl.core.sample import Sample
from teamrl.rollout.engine import SamplingParams
from teamrl.rollout.scheduler import GenerationScheduler


class EpisodeHost(Protocol):
    """What the gateway reads of an episode's context; ``teamrl.workflows.context.EpisodeContext`` is one.

    Declared here, structurally, so that this layer (rollout) never imports the workflows above it."""

    tokenizer: Any  # encodes the prompt (the chat template applied here), decodes token ids
    scheduler: GenerationScheduler  # the rollout's batch: every call of every episode in flight joins it
    route: Callable[[str], str]  # role -> policy name
    problem_id: Hashable
    episode: int
    tags: dict[str, Any]
    params: SamplingParams  # the rollout's sampling settings (a request may only shorten max_tokens)


class ClientGone(Exception):
    """The client disconnected before its answer was ready: nothing is recorded and nothing sent."""


@dataclass
class GatewayEpisode:
    """One episode as the gateway sees it. ``committed``: the Samples of calls whose answer was written."""

    id: str
    ctx: EpisodeHost
    loop: asyncio.AbstractEventLoop  # the scheduler's: calls run there
    roles: tuple[str, ...]
    problem: dict[str, Any]
    external: bool = False
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # this episode's credential (no other's)
    active: bool = True  # its caller may send calls (function running, or claimed by an external client)
    closed: bool = False
    queued: int = 0  # calls waiting for their batch or being generated
    committed: list[Sample] = field(default_factory=list)
    reward: asyncio.Future | None = None  # external episodes: resolved by POST /reward
    rewarded: bool = False
    sampled: dict[str, str] = field(default_factory=dict)  # tool call id -> the text it was parsed from
    # role -> its last answered chat call: (message keys, prompt ids, each choice's completion ids)
    last_call: dict[str, tuple[list[tuple], list[int], list[list[int]]]] = field(default_factory=dict)
