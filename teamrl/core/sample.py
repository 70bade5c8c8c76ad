"""The Sample: one LLM call of a rollout, the unit every algorithm works on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable


@dataclass(slots=True)
class Sample:
    """One LLM call in a rollout.

    Who acted (``role``, ``policy``), where (``problem_id``, ``episode``, ``turn``, ``branch``),
    what it saw and said (token ids, the sampling log-probs), and, once the episode ends,
    its ``reward``, comparison ``group`` and ``advantage``. ``turn`` is its call's turn under
    every algorithm: the ``turn=`` the workflow passed to ``ctx.generate``, else the role's call
    position in the episode (0 for its first call); MAGRPO's level in its tree is ``tags["depth"]``.

    The fields that steer training are typed, read by the trainer and the losses whatever
    algorithm wrote them:

    - ``trainable``: False keeps the sample out of the advantages and the update (it is still
      logged): a frozen agent's, a parallel candidate that never acted, a sub-trajectory an
      alignment dropped, a group with a non-finite reward under ``drop_group``.
    - ``baseline``: a greedy baseline episode's sample; never trained, its reward is its group's
      baseline for ``train.advantage: max``.
    - ``role_reward``: the sample's own reward, set by the workflow (``workflow.reward: per_role``
      uses it instead of the episode's outcome); None: the outcome.
    - ``trajectory``: samples with one trajectory key count once in their group's statistics
      (the turns of one rollout; one aligned sub-trajectory slot); None: the sample alone.

    ``policy_version`` is the version of the policy that sampled it: the number of weight updates
    of ``policy`` the engine had received when the sample was generated (the trainer publishes
    every policy once per training step, so it is the number of steps trained before the rollout
    that sampled it; see ``rollout.max_staleness``).

    ``tags`` holds free-form diagnostics (logged; metrics may read them, training never does);
    the old steering keys are refused there (:func:`check_steering_tags`). ``slots``: a misspelt field
    is an error.
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
    trainable: bool = True
    baseline: bool = False
    role_reward: float | None = None
    trajectory: Hashable | None = None
    tags: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0

    def __post_init__(self) -> None:
        check_steering_tags([self])

    def to_record(self) -> dict[str, Any]:
        """A JSON-friendly view for episode logs: the texts and the exact token ids (``teamrl sft --from-episodes``
        trains on those ids)."""
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
            "prompt_ids": list(self.prompt_ids),
            "completion_ids": list(self.completion_ids),
            "temperature": self.temperature,
            "reward": self.reward,
            "advantage": self.advantage,
            "group": repr(self.group),
            "trainable": self.trainable,
            "baseline": self.baseline,
            "role_reward": self.role_reward,
            "trajectory": None if self.trajectory is None else repr(self.trajectory),
            "policy_version": self.policy_version,
            **({"tags": self.tags} if self.tags else {}),
        }


def check_steering_tags(samples: Iterable[Sample]) -> None:
    """Raise :class:`ValueError` when a sample's ``tags`` hold a key that once steered training
    (it would be ignored silently), naming the typed field to set instead (``no_update`` is now
    ``trainable``; the others kept their names)."""
    for s in samples:
        for k in ("no_update", "baseline", "role_reward", "trajectory"):
            if k in s.tags:
                raise ValueError(
                    f"Sample tags[{k!r}] steers training and is no longer read from tags; "
                    f"set the field Sample.{'trainable' if k == 'no_update' else k} instead (tags are diagnostics only)"
                )
