"""``word_count``: describe a thing in exactly N words.

A verifiable task that a 135M model improves on within minutes on a CPU: the reward is
dense (partial credit falls linearly with the distance from N) and the skill it needs,
controlling length, is one a small instruct model already half has.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from teamrl.core.config import ConfigError, option
from teamrl.tasks.task import Problem, Task

TOPICS = (
    "a cat", "the sea", "a forest", "the moon", "a city", "rain", "a river", "coffee", "a library", "the wind",
    "a mountain", "winter", "a garden", "bread", "a train", "the sun", "music", "a bird", "snow", "a bridge",
    "the night", "a candle", "a market", "the desert", "a horse", "autumn", "a lighthouse", "tea", "a storm", "a clock",
)


@dataclass
class WordCountOptions:
    name: str = "word_count"
    num_problems: int = option(64, ge=1, doc="how many (topic, N) problems to generate")
    min_words: int = option(3, ge=1, doc="smallest target N")
    max_words: int = option(8, ge=1, doc="largest target N")
    seed: int = option(0, doc="seed of the problem generator")


def count_words(text: str) -> int:
    """Whitespace-separated words."""
    return len(text.split())


class WordCountTask(Task):
    """Reward = max(0, 1 - |words - N| / N): 1 for exactly N words, 0 at distance N or more."""

    name = "word_count"
    Options = WordCountOptions

    def __init__(self, opts: WordCountOptions | None = None) -> None:
        self.opts = opts or WordCountOptions()
        if self.opts.min_words > self.opts.max_words:
            raise ConfigError(f"task.min_words={self.opts.min_words} > task.max_words={self.opts.max_words}")
        rng = random.Random(self.opts.seed)
        self._problems = [
            Problem(f"wc{i}", {"topic": rng.choice(TOPICS), "n": rng.randint(self.opts.min_words, self.opts.max_words)})
            for i in range(self.opts.num_problems)
        ]

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def prompt(self, problem: Problem) -> list[dict[str, str]]:
        n, topic = problem.data["n"], problem.data["topic"]
        return [{"role": "user", "content": f"Describe {topic} in exactly {n} words. Reply with the {n} words only."}]

    def reward(self, problem: Problem, text: str) -> float:
        n = problem.data["n"]
        return max(0.0, 1.0 - abs(count_words(text) - n) / n)
