"""The Sample: one LLM call of a rollout, the unit every algorithm works on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable


@dataclass
class Sample:
    """One LLM call in a rollout.

    Who acted (``role``, ``policy``), where (``problem_id``, ``episode``, ``turn``, ``branch``),
    what it saw and said (token ids, the sampling log-probs), and, once the episode ends,
    its ``reward``, comparison ``group`` and ``advantage``.
    """

    role: str
    policy: str
    problem_id: Hashable
    prompt_ids: list[int]
    completion_ids: list[int]
    sampling_logprobs: list[float]
    text: str = ""
    finish_reason: str = "length"
    episode: int = 0
    turn: int = 0
    branch: int = 0
    temperature: float = 1.0
    prompt_text: str = ""
    reward: float | None = None
    advantage: float | None = None
    group: Hashable | None = None
    tags: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        """A JSON-friendly view for episode logs (texts, not token ids)."""
        return {
            "role": self.role,
            "policy": self.policy,
            "problem_id": self.problem_id,
            "episode": self.episode,
            "turn": self.turn,
            "branch": self.branch,
            "prompt": self.prompt_text,
            "completion": self.text,
            "finish_reason": self.finish_reason,
            "completion_tokens": len(self.completion_ids),
            "reward": self.reward,
            "advantage": self.advantage,
            "group": repr(self.group),
            **({"tags": self.tags} if self.tags else {}),
        }
