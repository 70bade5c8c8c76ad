"""A player: a Python function that writes a role's replies instead of the model.

``player(role, messages) -> str`` (or an ``async def``) is given what ``ctx.generate(role, messages)`` was given, as
a list of ``{"role", "content"}`` messages (a string is one user message), and returns the reply.
:class:`PlayerContext` is the recording episode context with the player's roles answered by it: each reply becomes a
:class:`~teamrl.core.sample.Sample` whose prompt ids are rendered as every call's are (the policy's chat template,
:meth:`EpisodeContext.render`) and whose completion ids are the reply's tokens and EOS, so what is recorded is what
the policy would be trained on. ``teamrl sft --self-play N --player module:function`` samples with one: a scripted
solver, a rule, or a larger model behind an API writes the team's replies and the successful episodes become the
warm start of the policies.

Only calls made through ``ctx.generate`` reach a player; calls an OpenAI-API workflow makes through
the gateway go to the model (:func:`check_player_answered` says so in one line).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, Collection, Sequence

from teamrl.core.config import ConfigError, InputError
from teamrl.core.registry import import_reference, load_plugin
from teamrl.core.sample import Sample
from teamrl.policies.chat import Messages
from teamrl.policies.router import role_type
from teamrl.rollout.engine import SamplingParams
from teamrl.workflows.context import EpisodeContext

Player = Callable[[str, Any], "str | Awaitable[str]"]  # (role, messages) -> the reply text
PLAYER_TAG = "player"  # Sample.tags key of a call the player answered (diagnostics: which replies were scripted)


def load_player(spec: str) -> Player:
    """The function named by ``module:function`` or ``FILE.py:function``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"--player {spec!r}: write module:function or FILE.py:function, a function (role, messages) "
                          "-> str")
    if where.endswith(".py"):
        if not Path(where).is_file():
            raise InputError(f"--player {spec!r}: no such file {where!r}; give FILE.py:function or module:function")
        module = sys.modules[load_plugin(where)]
        if not hasattr(module, name):
            raise ConfigError(f"--player {spec!r}: {where} defines no {name!r}")
        player = getattr(module, name)
    else:
        player = import_reference(spec, "--player")
    if not callable(player):
        raise ConfigError(f"--player {spec!r} is a {type(player).__name__}, not a function (role, messages) -> str")
    return player


class PlayerContext(EpisodeContext):
    """An :class:`EpisodeContext` whose calls of ``roles`` (role names or role types; None: every role) the
    ``player`` answers; the other roles' calls go to the model as usual."""

    def __init__(self, *args: Any, player: Player, roles: Collection[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.player = player
        self.player_roles = None if roles is None else frozenset(roles)

    def plays(self, role: str) -> bool:
        """Whether the player answers ``role``'s calls."""
        return self.player_roles is None or role in self.player_roles or role_type(role) in self.player_roles

    async def sample(self, role: str, messages: Messages | str, n: int, turn: int, branch: int,
                     params: SamplingParams, tags: dict[str, Any],
                     tools: list[dict[str, Any]] | None = None) -> list[Sample]:
        """``n`` replies of the player (the model's, for a role it does not play), recorded as Samples."""
        if not self.plays(role):
            return await super().sample(role, messages, n, turn, branch, params, tags, tools=tools)
        try:
            policy = self.route(role)
        except KeyError:
            raise InputError(f"workflow {self.workflow or '?'!r}: ctx.generate({role!r}, ...): not a role of this run; "
                             "declare it in register_workflow(name, roles=(...))") from None
        prompt_text, prompt_ids = self.render(messages, tools)
        tok = self.tokenizer
        # one shape for every player, whichever ctx.generate was given: a string is one user message
        shown = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
        out = []
        for j in range(n):
            reply = self.player(role, shown)
            if inspect.isawaitable(reply):
                reply = await reply
            if not isinstance(reply, str):
                raise InputError(f"--player returned {reply!r:.60} ({type(reply).__name__}) for role {role!r}; "
                                 "it must return the reply text (str)")
            completion_ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # it stopped
            out.append(Sample(
                role=role, policy=policy, problem_id=self.problem_id, prompt_ids=prompt_ids,
                completion_ids=completion_ids, sampling_logprobs=[0.0] * len(completion_ids), text=reply,
                finish_reason="eos", episode=self.episode, turn=turn, branch=branch + j,
                temperature=params.temperature, prompt_text=prompt_text, tags={**tags, PLAYER_TAG: True},
            ))
        self.samples += out
        return out


def check_player_answered(ctx: PlayerContext, samples: Sequence[Sample]) -> None:
    """Refuse, in one line, an episode whose calls of a played role did not reach the player (a gateway workflow's
    calls go to the model through its OpenAI client, not through ``ctx.generate``)."""
    missed = sorted({s.role for s in samples if ctx.plays(s.role) and not s.tags.get(PLAYER_TAG)})
    if missed:
        raise InputError(f"--player: workflow {ctx.workflow or '?'!r} made its calls of {missed} without "
                         "ctx.generate (through the gateway), so the player could not answer them; --player answers "
                         "ctx.generate calls only (use --player-roles for the roles that call it, or no --player)")
