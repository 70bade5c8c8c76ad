"""``reverse_text``: write a short text backwards, character by character (prime-rl's reverse-text task).

A seeded generator draws a few common English words; the answer is their exact reversal, written
between ``<reversed_text>`` tags as prime-rl's environment asks. The reward is the longest-common-
subsequence ratio of the answer and the reversal (``difflib.SequenceMatcher.ratio``, what prime-rl's
verifier computes): partial credit for a partly right reversal, 0 without the tags. An untrained
135M model rarely writes the tags; a warm start of a few hundred demonstrations (``teamrl sft``:
:meth:`ReverseText.demonstrations`) teaches the format and most of the skill, which makes the task a
test of whether RL keeps and adds to what a warm start taught.

``reverse_text.team`` is the same texts for a team of two acting at once (MAGRPO): ``head`` reverses the
first half of the words, ``tail`` the second half, each shown only its half; the team's answer is tail's
reversal, a space, then head's, scored by the same ratio against the whole reversal (each role's own
ratio on its half is its local reward).

The last ``test_size`` problems are held out (``split: test``), as the solve tasks do.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import ClassVar, Sequence

from teamrl.core.config import ConfigError, option
from teamrl.tasks.task import SPLITS, Problem, Task, TeamTask, split_problems

# Common short English words: the generator's vocabulary (lower case, no punctuation, so that a
# reversal is a matter of characters, not of tokenisation quirks of rare symbols).
WORDS = tuple("""
able acid aged also area army away baby back ball band bank base bath bear beat bell belt best bird blow blue boat
body bone book born boss both bowl burn busy cake call calm camp card care case cash cast cell chat chip city club
coal coat code cold come cook cool copy corn cost crew crop dark data date dawn deal dear deep desk diet dirt dish
door down draw drop drum dust duty earn east easy edge exit face fact fail fair fall farm fast fear feed feel file
fill film find fine fire firm fish five flag flat flow food foot form fort four free fuel full fund gain game gate
gift girl give glad goal gold golf good gray grow hair half hall hand hard head hear heat help hero high hill hold
hole home hope horn host hour huge idea iron item jazz join jump keep kind king knee lady lake lamp land lane last
late lead leaf left lens life lift line lion list live load loan lock long look lord loss love luck mail main make
male mark mass meal meat mild milk mind mine miss mode moon more most move much must name navy near neck need news
next nice nine none nose note open oven pack page pain pair palm park part pass path peak pick pine pink pipe plan
play plot pole pool poor port post pull pure push race rain rank rate read real rest rice rich ride ring rise risk
road rock role roof room root rope rose rule safe sail salt sand save seat seed self sell ship shoe shop shot show
side sign silk sing site size skin slow snow soft soil song sort soup spot star stay step stop suit sure swim tail
take talk tall tank tape task team tell tent term test text tide tile time tiny tone tool tour town tree trip true
tube tune turn type unit vast view vote wage wait walk wall warm wash wave weak wear week well west wide wife wild
wind wine wing wire wise wish wolf wood wool word work yard year zero zone
""".split())

TAG = "reversed_text"
_ANSWER = re.compile(rf"<{TAG}>(.*?)</{TAG}>", re.S)


@dataclass
class ReverseTextOptions:
    name: str = "reverse_text"
    num_problems: int = option(448, ge=2, doc="how many texts to generate (the last test_size are held out)")
    min_words: int = option(2, ge=1, doc="fewest words in a text")
    max_words: int = option(4, ge=1, doc="most words in a text")
    seed: int = option(0, doc="seed of the text generator")
    split: str = option("train", choices=SPLITS, doc="train: all but the last test_size problems; test: those")
    test_size: int = option(48, ge=0, doc="problems held out for evaluation")


def reverse_texts(opts: ReverseTextOptions, what: str) -> list[Problem]:
    """The generated texts of ``opts`` (their split), each with its reversal."""
    if opts.min_words > opts.max_words:
        raise ConfigError(f"task.min_words={opts.min_words} > task.max_words={opts.max_words}; "
                          "min_words must be at most max_words")
    rng = random.Random(opts.seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(opts.min_words, opts.max_words)))
             for _ in range(opts.num_problems)]
    problems = [Problem(f"rev{i}", {"text": t, "reversed": t[::-1]}) for i, t in enumerate(texts)]
    return split_problems(problems, opts.split, opts.test_size, what)


def reverse_prompt(text: str) -> list[dict[str, str]]:
    """The chat a reverser is shown for ``text``."""
    return [{"role": "user", "content": (
        "Reverse the text character by character (the last character first).\n"
        f"Text: {text}\n"
        f"Reply with the reversed text only, between <{TAG}> and </{TAG}>.")}]


def tagged(answer: str) -> str:
    """``answer`` written as the task asks (between the tags)."""
    return f"<{TAG}>{answer}</{TAG}>"


def lcs_ratio(answer: str, truth: str) -> float:
    """The similarity of two strings in [0, 1] by their longest matching blocks (``SequenceMatcher.ratio``:
    2 * matched characters / total characters), the reverse-text reward of prime-rl's verifier."""
    return SequenceMatcher(None, answer, truth).ratio()


def extract_reversed(text: str) -> str | None:
    """The text between the first ``<reversed_text>`` and its closing tag (stripped); None without both tags."""
    m = _ANSWER.search(text)
    return m.group(1).strip() if m else None


class ReverseText(Task):
    """Reward = the LCS ratio of the tagged answer and the exact reversal (0 without the tags)."""

    name: ClassVar[str] = "reverse_text"
    Options = ReverseTextOptions

    def __init__(self, opts: ReverseTextOptions | None = None) -> None:
        self.opts = opts or ReverseTextOptions()
        self._problems = reverse_texts(self.opts, "reverse_text")

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def prompt(self, problem: Problem) -> list[dict[str, str]]:
        return reverse_prompt(problem.data["text"])

    def reward(self, problem: Problem, text: str) -> float:
        answer = extract_reversed(text)
        return 0.0 if answer is None else lcs_ratio(answer, problem.data["reversed"])

    def rewards(self, problems: Sequence[Problem], texts: Sequence[str]) -> list[float]:
        return [self.reward(p, t) for p, t in zip(problems, texts)]

    def valid(self, problem: Problem, text: str) -> bool:
        """Format validity (``teamrl eval``): the reply holds a tagged answer."""
        return extract_reversed(text) is not None

    def demonstrations(self, problem: Problem) -> list[tuple[str, list[dict[str, str]], str]]:
        """Warm start (``teamrl sft``): the prompt and the exact reversal in its tags."""
        return [("agent", self.prompt(problem), tagged(problem.data["reversed"]))]


def halves(text: str) -> dict[str, str]:
    """``text`` cut between words into ``head`` (the first half, the shorter one for an odd count) and ``tail``."""
    words = text.split(" ")
    cut = len(words) // 2
    return {"head": " ".join(words[:cut]), "tail": " ".join(words[cut:])}


class ReverseTextTeam(TeamTask):
    """Two reversers at once (MAGRPO): ``head`` and ``tail`` each reverse their half; team reward = the LCS ratio of
    tail's reversal + " " + head's against the whole reversal (a missing tag leaves that half empty)."""

    name: ClassVar[str] = "reverse_text.team"
    roles: ClassVar[tuple[str, ...]] = ("head", "tail")
    Options = ReverseTextOptions

    def __init__(self, opts: ReverseTextOptions | None = None) -> None:
        self.opts = opts or ReverseTextOptions(name="reverse_text.team")
        if self.opts.min_words < 2:
            raise ConfigError(f"task.min_words={self.opts.min_words}: reverse_text.team splits each text between two "
                              "agents, so every text needs at least 2 words (min_words >= 2)")
        self._problems = reverse_texts(self.opts, "reverse_text.team")

    def problems(self) -> list[Problem]:
        return list(self._problems)

    def prompt(self, problem: Problem, role: str, turn: int = 0, history: Sequence[dict[str, str]] = (),
               feedback: str = "") -> list[dict[str, str]]:
        return reverse_prompt(halves(problem.data["text"])[role])

    def joint_answer(self, outputs: dict[str, str]) -> str:
        """The team's answer: tail's reversal, a space, head's (each "" without its tags)."""
        return f"{extract_reversed(outputs['tail']) or ''} {extract_reversed(outputs['head']) or ''}"

    def reward(self, problem: Problem, outputs: dict[str, str]) -> float:
        return lcs_ratio(self.joint_answer(outputs), problem.data["reversed"])

    def role_rewards(self, problem: Problem, outputs: dict[str, str]) -> dict[str, float]:
        parts = halves(problem.data["text"])
        return {r: lcs_ratio(extract_reversed(outputs[r]) or "", parts[r][::-1]) for r in self.roles}

    def valid(self, problem: Problem, text: str) -> bool:
        """Format validity (``teamrl eval``): a tagged answer."""
        return extract_reversed(text) is not None

    def single_prompt(self, problem: Problem) -> list[dict[str, str]]:
        """Baseline ``single``: one agent reverses the whole text."""
        return reverse_prompt(problem.data["text"])

    def split_single(self, text: str) -> dict[str, str]:
        """A ``single`` answer is the whole reversal: it stands as tail's part, head's is empty."""
        return {"tail": text, "head": ""}

    def demonstrations(self, problem: Problem) -> list[tuple[str, list[dict[str, str]], str]]:
        """Warm start (``teamrl sft``): each role's prompt and the exact reversal of its half."""
        parts = halves(problem.data["text"])
        return [(r, self.prompt(problem, r), tagged(parts[r][::-1])) for r in self.roles]
