"""A scripted engine for algorithm tests: the script chooses the text of each of a request's ``n`` completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from teamrl.policies.models import byte_tokenizer
from teamrl.rollout.engine import Completion, Engine, GenerationRequest, SamplingParams
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.tasks.task import Problem, TeamTask
from teamrl.workflows.context import EpisodeContext

TOK = byte_tokenizer()
Script = Callable[[str, str, int], list[str]]  # (policy, prompt text, n) -> the n completion texts


class ScriptedEngine(Engine):
    """Replies with scripted texts; ``prompts`` records every (policy, prompt text) it was sent."""

    def __init__(self, script: Script, tokenizer: Any = TOK) -> None:
        self.script = script
        self.tok = tokenizer  # encodes the scripted texts (the byte tokenizer of the tiny model by default)
        self.prompts: list[tuple[str, str]] = []

    def generate(self, policy: str, requests: Sequence[GenerationRequest], seed: int | None = None) -> list[list[Completion]]:
        out = []
        tok = self.tok
        for r in requests:
            prompt = tok.decode(r.prompt_ids, skip_special_tokens=True)
            self.prompts.append((policy, prompt))
            texts = self.script(policy, prompt, r.n)
            assert len(texts) == r.n, (policy, prompt, texts)
            out.append([Completion(tok.encode(t, add_special_tokens=False) or [tok.eos_token_id],
                                   [0.0] * max(1, len(tok.encode(t, add_special_tokens=False))), t, "eos") for t in texts])
        return out


def scripted_rollout(algorithm: Any, problems: Sequence[Problem], task: Any, script: Script) -> list:
    """``algorithm.rollout`` on ``problems`` with every role routed to a policy of its own name."""
    sched = GenerationScheduler(ScriptedEngine(script))
    params = SamplingParams(max_new_tokens=8)

    def make_ctx(problem: Problem, episode: int, tags: dict) -> EpisodeContext:
        return EpisodeContext(sched, lambda role: role, TOK, params, problem.id, episode, tags)

    return algorithm.rollout(problems, task, make_ctx, sched.run)


@dataclass
class ScriptedTeamOptions:
    name: str = "scripted_team"


class ScriptedTeam(TeamTask):
    """One role; the prompt shows the turn and the previous answer; the reward of a text is
    ``REWARDS[text]`` (0 for any other text)."""

    name = "scripted_team"
    roles = ("agent",)
    max_reward = 1.0
    Options = ScriptedTeamOptions
    REWARDS = {"solve": 1.0, "half": 0.5, "close": 0.9}

    def problems(self) -> list[Problem]:
        return [Problem("p0")]

    def prompt(self, problem, role, turn=0, history=(), feedback=""):
        return [{"role": "user", "content": f"turn {turn} after {history[-1][role] if history else '-'}"}]

    def reward(self, problem, outputs):
        return self.REWARDS.get(outputs["agent"], 0.0)
