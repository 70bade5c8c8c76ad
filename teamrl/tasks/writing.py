"""Writing tasks for a team of two agents, offline: ``writing.tldr`` and ``writing.expand``.

The data are the 250 ACL papers of the ``aclsum`` package (title, abstract, introduction,
conclusion and three one-sentence aspect summaries: challenge, approach, outcome), read from
the JSONL files inside the package through its own ``aclsum.ACLSum(split)`` loader, which
needs no network. :func:`load_papers` also reads a local JSONL file or, when ``datasets`` is
installed, a Hugging Face data set with the same fields.

- ``writing.tldr``: from the introduction and conclusion, agent ``tldr`` writes a one-sentence
  TL;DR and agent ``summary`` a detailed summary.
- ``writing.expand``: from the title and the aspect summaries, agent ``background`` writes the
  background/motivation half of an abstract and agent ``method`` the method/results half.

Rewards come in levels, as in the MAGRPO paper's writing tasks (Liu et al., 2025), scored on
words (runs of letters/digits, with inner ``'`` or ``-``; punctuation is not a word):

======  ================  ======  ==========================================================
level   key               points  what earns them
======  ================  ======  ==========================================================
1       structure         1.0     both outputs within their role's word bounds. A GATE: if
                                  either is out of bounds (an empty output always is), the
                                  reward is 0 and no later level is scored.
2       length_ratio      1.0     words(second role) / words(first role) inside
                                  [ratio_min, ratio_max]: full points; outside, linear
                                  partial credit reaching 0 at ratio_min / 2 and 2 * ratio_max.
3       vocabulary        1.0     0.5 per output: moving-average type-token ratio (MATTR,
                                  window 25 words; plain TTR for shorter texts), credit
                                  linear from 0 at <= 0.4 to full at >= 0.7.
4       style             1.0     0.5 transitions: 0.25 per distinct transition marker
                                  (fixed list) in the two outputs together, at most 2;
                                  0.5 overlap: share of the shorter output's content words
                                  that the other one also uses, full inside
                                  [overlap_min, overlap_max], linear to 0 at 0 and at 1.
5       abstract_overlap  2.0     ``expand`` only: the two halves joined vs. the true
                                  abstract, mean of a unigram F1 (content words) and a
                                  bigram F1 (bigrams that are not two stopwords), ROUGE-like.
======  ================  ======  ==========================================================

``max_reward`` is the sum of the level points (4.0 for ``tldr``, 6.0 for ``expand``) and is
reachable: a pair that meets every band scores it (the tests build one). The reference code
(CoMLRL) stops at any level that earns nothing; here only level 1 is a gate and levels 2-5
add up independently, so a group of samples still gets a graded signal when, say, the ratio
is far off but the vocabulary or the content improves.
"""

from __future__ import annotations

import importlib.util
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from teamrl.core.config import ConfigError, InputError, option
from teamrl.tasks.task import Problem, TeamTask
from teamrl.tasks.jsonl import read_jsonl_lines

FIELDS = ("id", "title", "abstract", "introduction", "conclusion", "summaries")
ASPECTS = ("challenge", "approach", "outcome")
ACLSUM_SPLITS = ("train", "val", "test")

# Level points: the keys are those of reward_breakdown, in level order.
TLDR_POINTS: dict[str, float] = {"structure": 1.0, "length_ratio": 1.0, "vocabulary": 1.0, "style": 1.0}
EXPAND_POINTS: dict[str, float] = {**TLDR_POINTS, "abstract_overlap": 2.0}

RATIO_FALLOFF = 2.0        # ratio credit reaches 0 at ratio_min / 2 and at ratio_max * 2
VOCAB_WINDOW = 25          # MATTR window: plain TTR falls with length, a moving window does not
VOCAB_ZERO, VOCAB_FULL = 0.4, 0.7  # normal prose sits above 0.7; a looping small model below 0.4
TRANSITIONS_FULL = 2       # distinct markers for full transition credit

# fmt: off
STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being
below between both but by can could did do does doing down during each either few for from further
had has have having he her here hers herself him himself his how i if in into is it its itself just
let me more most my myself no nor not now of off on once only or other our ours ourselves out over
own same she should so some such than that the their theirs them themselves then there these they
this those through to too under until up upon us very was we were what when where which while who
whom why will with would you your yours yourself yourselves one two also may might must shall
""".split())

# Discourse markers that link ideas (addition, contrast, cause, example, sequence, summary).
# Very common words that are markers only sometimes ("so", "then", "while", "as") are left out,
# so the level cannot be earned by ordinary filler.
TRANSITIONS = (
    "moreover", "furthermore", "additionally", "in addition", "besides", "likewise", "similarly",
    "however", "nevertheless", "nonetheless", "in contrast", "by contrast", "on the other hand",
    "conversely", "instead", "whereas", "although", "despite", "yet",
    "therefore", "thus", "hence", "consequently", "as a result", "accordingly", "because of this",
    "for example", "for instance", "in particular", "specifically", "notably", "namely",
    "first", "second", "third", "finally", "subsequently", "next",
    "overall", "in summary", "in conclusion", "in short", "to this end", "in other words",
)
# fmt: on

_WORD = re.compile(r"[^\W_]+(?:['’-][^\W_]+)*")
_TRANSITION_TUPLES = frozenset(tuple(t.split()) for t in TRANSITIONS)
_TRANSITION_MAX_LEN = max(len(t) for t in _TRANSITION_TUPLES)


# --------------------------------------------------------------------------- data


def _datasets_available() -> bool:
    return importlib.util.find_spec("datasets") is not None


def _detokenize(text: str) -> str:
    """Undo aclsum's tokenisation (``word , word ( x ) it 's``) so prompts read as prose."""
    text = re.sub(r" ([.,;:!?%)\]}])", r"\1", text)
    text = re.sub(r"([(\[{]) ", r"\1", text)
    return re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)


def _as_text(value: Any, key: str, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return " ".join(value)  # aclsum's own format: a list of sentences
    raise InputError(f"{where}: field {key!r} must be a string or a list of strings, got {type(value).__name__}")


def _record(row: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Check one paper record and return it with text fields as strings."""
    if not isinstance(row, Mapping):
        raise InputError(f"{where}: expected a JSON object with fields {list(FIELDS)}, got {type(row).__name__}")
    missing = [f for f in FIELDS if f not in row]
    if missing:
        raise InputError(f"{where}: missing field(s) {missing}; each record needs {list(FIELDS)}")
    summaries = row["summaries"]
    if not isinstance(summaries, Mapping):
        raise InputError(f"{where}: field 'summaries' must be an object with keys {list(ASPECTS)}")
    missing = [a for a in ASPECTS if a not in summaries]
    if missing:
        raise InputError(f"{where}: missing field(s) {['summaries.' + a for a in missing]}; "
                         f"'summaries' needs keys {list(ASPECTS)}")
    rec: dict[str, Any] = {"id": str(row["id"])}
    for key in ("title", "abstract", "introduction", "conclusion"):
        rec[key] = _as_text(row[key], key, where)
    rec["summaries"] = {a: _as_text(summaries[a], "summaries." + a, where) for a in ASPECTS}
    return rec


def _load_aclsum(split: str | None) -> list[dict[str, Any]]:
    try:
        from aclsum import ACLSum
    except ImportError as e:  # pragma: no cover - aclsum is a declared dependency
        raise ImportError("source 'aclsum' needs the aclsum package (pip install aclsum==0.1.2)") from e
    if split is not None and split not in ACLSUM_SPLITS:
        raise ConfigError(
            f"task.split: {split!r} is not an aclsum split; choose one of {list(ACLSUM_SPLITS)} or None for all "
            "250 papers"
        )
    out = []
    for s in ACLSUM_SPLITS if split is None else (split,):
        for doc in ACLSum(s):  # the package's loader reads the JSONL shipped inside it: offline
            row = {"id": doc.id, "title": doc.title, "summaries": doc.summaries,
                   **{k: _detokenize(" ".join(doc.sentences[k])) for k in ("abstract", "introduction", "conclusion")}}
            out.append(_record(row, f"aclsum {s} paper {doc.id}"))
    return out


def _load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [
        _record(row, f"{path} line {n}")
        for n, row in read_jsonl_lines(
            path, "task.source", "give 'aclsum', a .jsonl file of papers, or a Hugging Face data set name"
        )
    ]


def _load_hf(name: str, split: str | None) -> list[dict[str, Any]]:
    if not _datasets_available():
        raise ImportError(f"source {name!r} is neither 'aclsum' nor a path ending in .jsonl, so it is read as a "
                          f"Hugging Face data set, which needs the datasets package: pip install datasets, "
                          f"or give a local .jsonl file with fields {list(FIELDS)}")
    import datasets

    ds = datasets.load_dataset(name, split=split or "train")
    return [_record(row, f"{name} [{split or 'train'}] row {i}") for i, row in enumerate(ds)]


def load_papers(source: str = "aclsum", split: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Papers as dicts with ``id, title, abstract, introduction, conclusion`` (strings) and
    ``summaries`` (``{challenge, approach, outcome}``).

    ``source`` is ``"aclsum"`` (the package's 250 papers, offline; ``split`` is ``train`` (100),
    ``val`` (50), ``test`` (100) or None for all, in that order; its tokenised text is turned
    back into prose), a path ending in ``.jsonl`` (one record per line; section fields may be
    strings or lists of sentences; ``split`` must be None), or else a Hugging Face data set
    name (needs ``datasets``; ``split`` defaults to ``train``). ``limit`` keeps the first records.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} is not allowed; give a count >= 0 or None for all")
    if source == "aclsum":
        papers = _load_aclsum(split)
    elif source.lower().endswith(".jsonl"):
        if split is not None:
            raise ConfigError(
                f"task.split={split!r} applies to aclsum and Hugging Face sources, not to the JSONL file "
                f"{source!r}; leave it empty (task.split=)"
            )
        papers = _load_jsonl(Path(source))
    else:
        papers = _load_hf(source, split)
    return papers if limit is None else papers[:limit]


def _source_label(source: str) -> str:
    """The prefix of problem ids: ``aclsum``, a JSONL file's stem, or the data set name."""
    return Path(source).stem if source.lower().endswith(".jsonl") else source


def truncate_words(text: str, n: int) -> str:
    """The first ``n`` whitespace words of ``text``, with `` ...`` when something was cut."""
    words = text.split()
    return text.strip() if len(words) <= n else " ".join(words[:n]) + " ..."


# --------------------------------------------------------------------------- text statistics


def words_of(text: str) -> list[str]:
    """Lower-cased words: runs of letters/digits with inner ' or - (punctuation is not a word)."""
    return _WORD.findall(text.lower())


def mattr(words: Sequence[str], window: int = VOCAB_WINDOW) -> float:
    """Moving-average type-token ratio; plain TTR when the text is not longer than ``window``."""
    n = len(words)
    if n == 0:
        return 0.0
    if n <= window:
        return len(set(words)) / n
    counts = Counter(words[:window])
    distinct = total = len(counts)
    for i in range(window, n):  # slide: one word leaves, one enters
        out, new = words[i - window], words[i]
        counts[out] -= 1
        if counts[out] == 0:
            distinct -= 1
        if counts[new] == 0:
            distinct += 1
        counts[new] += 1
        total += distinct
    return total / ((n - window + 1) * window)


def _bigram_ok(a: str, b: str) -> bool:
    return not (a in STOPWORDS and b in STOPWORDS)  # "of the" says nothing about content


@dataclass(frozen=True)
class TextStats:
    """What the reward needs from one output, computed once per distinct text."""

    words: tuple[str, ...]
    content: frozenset[str]
    mattr: float
    transitions: frozenset[str]
    unigrams: Counter
    bigrams: Counter

    @property
    def n(self) -> int:
        return len(self.words)

    @classmethod
    def of(cls, text: str) -> "TextStats":
        w = words_of(text)
        found = set()
        for i in range(len(w)):
            for k in range(1, _TRANSITION_MAX_LEN + 1):
                t = tuple(w[i:i + k])
                if len(t) == k and t in _TRANSITION_TUPLES:
                    found.add(" ".join(t))
        content = [x for x in w if x not in STOPWORDS]
        return cls(words=tuple(w), content=frozenset(content), mattr=mattr(w), transitions=frozenset(found),
                   unigrams=Counter(content), bigrams=Counter(p for p in zip(w, w[1:]) if _bigram_ok(*p)))


def _f1(cand: Counter, ref: Counter) -> float:
    overlap = sum(min(c, ref[k]) for k, c in cand.items() if k in ref)
    if overlap == 0:
        return 0.0
    p, r = overlap / sum(cand.values()), overlap / sum(ref.values())
    return 2 * p * r / (p + r)


def abstract_f1(a: TextStats, b: TextStats, ref: TextStats) -> float:
    """Mean of unigram and bigram F1 of ``a`` then ``b`` (as one text) against ``ref``."""
    uni = a.unigrams + b.unigrams
    bi = a.bigrams + b.bigrams
    if a.words and b.words and _bigram_ok(a.words[-1], b.words[0]):
        bi[(a.words[-1], b.words[0])] += 1  # the bigram across the seam of the joined text
    return (_f1(uni, ref.unigrams) + _f1(bi, ref.bigrams)) / 2


def band_credit(x: float, lo: float, hi: float, zero_lo: float, zero_hi: float) -> float:
    """1 inside [lo, hi]; linear down to 0 at ``zero_lo`` below and ``zero_hi`` above."""
    if lo <= x <= hi:
        return 1.0
    if x < lo:
        return max(0.0, (x - zero_lo) / (lo - zero_lo)) if lo > zero_lo else 0.0
    return max(0.0, (zero_hi - x) / (zero_hi - hi)) if zero_hi > hi else 0.0


def vocab_credit(m: float) -> float:
    """Vocabulary credit of one output from its MATTR: 0 at <= VOCAB_ZERO, 1 at >= VOCAB_FULL."""
    return min(1.0, max(0.0, (m - VOCAB_ZERO) / (VOCAB_FULL - VOCAB_ZERO)))


def content_overlap(a: TextStats, b: TextStats) -> float:
    """Share of the smaller content-word set found in the other (0 when either has none)."""
    if not a.content or not b.content:
        return 0.0
    return len(a.content & b.content) / min(len(a.content), len(b.content))


# --------------------------------------------------------------------------- tasks


@dataclass
class WritingTLDROptions:
    name: str = "writing.tldr"
    source: str = option("aclsum", doc="'aclsum' (offline, 250 papers), a .jsonl path, or a Hugging Face data set name")
    split: str = option("", doc="aclsum: train, val or test ('' = all 250); Hugging Face: a split name ('' = train)")
    num_problems: int = option(0, ge=0, doc="papers to use, a seeded sample kept in data order; 0 = all")
    max_source_words: int = option(
        300, ge=10, doc="words of introduction + conclusion shown (the conclusion gets at most half)"
    )
    tldr_min_words: int = option(5, ge=1, doc="level 1: fewest words of the TL;DR")
    tldr_max_words: int = option(40, ge=1, doc="level 1: most words of the TL;DR")
    summary_min_words: int = option(60, ge=1, doc="level 1: fewest words of the summary")
    summary_max_words: int = option(250, ge=1, doc="level 1: most words of the summary")
    ratio_min: float = option(2.0, gt=0, doc="level 2: lower edge of the summary/TL;DR word ratio band")
    ratio_max: float = option(10.0, gt=0, doc="level 2: upper edge of the summary/TL;DR word ratio band")
    overlap_min: float = option(0.3, ge=0, le=1, doc="level 4: lower edge of the shared content-word band")
    overlap_max: float = option(0.9, ge=0, le=1, doc="level 4: upper edge of the shared content-word band")
    seed: int = option(0, doc="seed of the num_problems sample")


@dataclass
class WritingExpandOptions:
    name: str = "writing.expand"
    source: str = option("aclsum", doc="'aclsum' (offline, 250 papers), a .jsonl path, or a Hugging Face data set name")
    split: str = option("", doc="aclsum: train, val or test ('' = all 250); Hugging Face: a split name ('' = train)")
    num_problems: int = option(0, ge=0, doc="papers to use, a seeded sample kept in data order; 0 = all")
    max_source_words: int = option(300, ge=10, doc="words of the aspect summaries shown (a third each)")
    background_min_words: int = option(40, ge=1, doc="level 1: fewest words of the background half")
    background_max_words: int = option(150, ge=1, doc="level 1: most words of the background half")
    method_min_words: int = option(40, ge=1, doc="level 1: fewest words of the method half")
    method_max_words: int = option(150, ge=1, doc="level 1: most words of the method half")
    ratio_min: float = option(0.7, gt=0, doc="level 2: lower edge of the method/background word ratio band")
    ratio_max: float = option(1.4, gt=0, doc="level 2: upper edge of the method/background word ratio band")
    overlap_min: float = option(0.1, ge=0, le=1, doc="level 4: lower edge of the shared content-word band")
    overlap_max: float = option(0.5, ge=0, le=1, doc="level 4: upper edge of the shared content-word band")
    seed: int = option(0, doc="seed of the num_problems sample")


class _WritingTask(TeamTask):
    """Shared data loading and the level reward of a two-role writing task."""

    roles: ClassVar[tuple[str, str]]
    points: ClassVar[dict[str, float]]
    labels: ClassVar[dict[str, str]]  # role -> how messages name its output
    markers: ClassVar[dict[str, str]]  # role -> the heading of its part in a single-agent answer

    def __init__(self, opts: Any) -> None:
        self.opts = opts
        p = "task."
        self.bounds: dict[str, tuple[int, int]] = {}
        for role in self.roles:
            lo, hi = getattr(opts, f"{role}_min_words"), getattr(opts, f"{role}_max_words")
            if lo > hi:
                raise ConfigError(
                    f"{p}{role}_min_words={lo} > {p}{role}_max_words={hi}; the minimum must not exceed the maximum"
                )
            self.bounds[role] = (lo, hi)
        if opts.ratio_min > opts.ratio_max:
            raise ConfigError(f"{p}ratio_min={opts.ratio_min} > {p}ratio_max={opts.ratio_max}; give a band lo <= hi")
        if opts.overlap_min > opts.overlap_max:
            raise ConfigError(
                f"{p}overlap_min={opts.overlap_min} > {p}overlap_max={opts.overlap_max}; give a band lo <= hi"
            )
        papers = load_papers(opts.source, opts.split or None)
        if opts.num_problems > len(papers):
            raise ConfigError(
                f"{p}num_problems={opts.num_problems} but source {opts.source!r} has {len(papers)} papers; "
                f"give at most {len(papers)}, or 0 for all"
            )
        if 0 < opts.num_problems < len(papers):
            keep = sorted(random.Random(opts.seed).sample(range(len(papers)), opts.num_problems))
            papers = [papers[i] for i in keep]
        label = _source_label(opts.source)
        self._problems = [Problem(f"{label}:{r['id']}", self._problem_data(r)) for r in papers]
        self._ref_cache: dict[str, TextStats] = {}

    # -- data and prompts (per task)

    def _problem_data(self, rec: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _source_block(self, problem: Problem) -> str:
        raise NotImplementedError

    def _instruction(self, role: str) -> str:
        """What ``role`` writes, with its word bounds (one or two sentences)."""
        raise NotImplementedError

    def problems(self) -> list[Problem]:
        """The papers as problems, ids ``<source>:<paper id>``, in data order."""
        return list(self._problems)

    def prompt(self, problem: Problem, role: str, turn: int = 0, history: Sequence[dict[str, str]] = (),
               feedback: str = "") -> list[dict[str, str]]:
        """The role's local prompt: the source text and its own instruction; from turn 1 on also
        the last joint answer (its own and its teammate's part) and the feedback."""
        if role not in self.roles:
            raise ValueError(f"role {role!r} is not a role of {self.name}; choose one of {list(self.roles)}")
        other = self.roles[1] if role == self.roles[0] else self.roles[0]
        text = (f"{self._source_block(problem)}\n\n{self._instruction(role)} A teammate writes the "
                f"{self.labels[other]}. Reply with your {self.labels[role]} only.")
        if turn > 0 and history:
            last = history[-1]
            text += (f"\n\nYour previous {self.labels[role]}:\n{last.get(role, '')}\n\n"
                     f"Your teammate's {self.labels[other]}:\n{last.get(other, '')}")
            if feedback:
                text += f"\n\nFeedback: {feedback}"
            text += f"\n\nWrite an improved {self.labels[role]}. Reply with it only."
        return [{"role": "user", "content": text}]

    def single_prompt(self, problem: Problem) -> list[dict[str, str]]:
        """Baseline ``single``: one agent writes both parts under the role markers."""
        a, b = self.roles
        parts = "\n".join(
            f"{self.markers[r]}: <{self.labels[r]}, {self.bounds[r][0]}-{self.bounds[r][1]} words>" for r in self.roles
        )
        text = (
            f"{self._source_block(problem)}\n\nWrite two parts.\n1. {self._instruction(a)}\n2. "
            f"{self._instruction(b)}\n\n"
            f"Answer in exactly this format:\n{parts}"
        )
        return [{"role": "user", "content": text}]

    def split_single(self, text: str) -> dict[str, str]:
        """Split a ``single`` answer at its markers (``TL;DR:``/``SUMMARY:``, ``BACKGROUND:``/``METHOD:``;
        case-insensitive, ``**`` or ``#`` around them allowed, ``TLDR`` for ``TL;DR``); a marker
        at the start of a line wins over one inside a line; a missing part becomes ""."""
        found = []
        for role, marker in self.markers.items():
            name = re.escape(marker).replace(";", ";?")
            m = (re.search(rf"(?im)^[\s#*]*{name}[\s*]*:", text)
                 or re.search(rf"(?i)(?<![\w-]){name}[\s*]*:", text))
            if m:
                found.append((m.start(), m.end(), role))
        found.sort()
        out = {r: "" for r in self.roles}
        for i, (_, end, role) in enumerate(found):
            stop = found[i + 1][0] if i + 1 < len(found) else len(text)
            out[role] = text[end:stop].strip().strip("*#").strip()
        return out

    # -- reward

    @property
    def _levels(self) -> tuple[str, ...]:
        return tuple(self.points)

    def _ref(self, problem: Problem) -> TextStats | None:
        if "abstract_overlap" not in self.points:
            return None
        abstract = problem.data["abstract"]
        if abstract not in self._ref_cache:
            self._ref_cache[abstract] = TextStats.of(abstract)
        return self._ref_cache[abstract]

    def _texts(self, outputs: Mapping[str, str]) -> tuple[str, str]:
        missing = [r for r in self.roles if r not in outputs]
        if missing:
            raise ValueError(f"outputs lack role(s) {missing}; {self.name} needs {list(self.roles)}")
        return outputs[self.roles[0]], outputs[self.roles[1]]

    def _score(self, a: TextStats, b: TextStats, ref: TextStats | None) -> tuple[dict[str, float], dict[str, Any]]:
        """Level points and the diagnostics that :meth:`feedback` names."""
        o, P = self.opts, self.points
        pts = {k: 0.0 for k in P}
        stats = dict(zip(self.roles, (a, b)))
        diag: dict[str, Any] = {"n": {r: s.n for r, s in stats.items()}}
        # Level 1, the gate: a part out of bounds makes the whole answer worth 0.
        if not all(self.bounds[r][0] <= s.n <= self.bounds[r][1] for r, s in stats.items()):
            return pts, diag
        pts["structure"] = P["structure"]
        ratio = b.n / a.n  # a.n >= min_words >= 1 after the gate
        pts["length_ratio"] = P["length_ratio"] * band_credit(ratio, o.ratio_min, o.ratio_max,
                                                              o.ratio_min / RATIO_FALLOFF, o.ratio_max * RATIO_FALLOFF)
        vocab = {r: vocab_credit(s.mattr) for r, s in stats.items()}
        pts["vocabulary"] = P["vocabulary"] * sum(vocab.values()) / 2
        trans = min(1.0, len(a.transitions | b.transitions) / TRANSITIONS_FULL)
        overlap = content_overlap(a, b)
        ov_credit = band_credit(overlap, o.overlap_min, o.overlap_max, 0.0, 1.0)
        pts["style"] = P["style"] * (trans + ov_credit) / 2
        diag.update(ratio=ratio, mattr={r: s.mattr for r, s in stats.items()}, vocab=vocab, transitions=trans,
                    overlap=overlap, overlap_credit=ov_credit)
        if ref is not None:
            f1 = abstract_f1(a, b, ref)
            pts["abstract_overlap"] = P["abstract_overlap"] * f1
            diag["f1"] = f1
        return pts, diag

    def reward_breakdown(self, problem: Problem, outputs: Mapping[str, str]) -> dict[str, float]:
        """Points per level (keys in level order); their sum is :meth:`reward`."""
        a, b = self._texts(outputs)
        return self._score(TextStats.of(a), TextStats.of(b), self._ref(problem))[0]

    def reward(self, problem: Problem, outputs: dict[str, str]) -> float:
        """The sum of the level points, in [0, max_reward]."""
        return sum(self.reward_breakdown(problem, outputs).values())

    def rewards(self, problem: Problem, joint: Sequence[dict[str, str]]) -> list[float]:
        """Rewards of many joint actions; each distinct text is analysed once (the cross joint
        mode puts every completion into G joint actions)."""
        ref = self._ref(problem)
        cache: dict[str, TextStats] = {}

        def stats(t: str) -> TextStats:
            s = cache.get(t)
            if s is None:
                s = cache[t] = TextStats.of(t)
            return s

        out = []
        for outputs in joint:
            a, b = self._texts(outputs)
            out.append(sum(self._score(stats(a), stats(b), ref)[0].values()))
        return out

    def feedback(self, problem: Problem, outputs: dict[str, str], reward: float) -> str:
        """One sentence on the weakest level: the one that lost the largest share of its
        points (ties go to the lower level); the structure gate always comes first."""
        a, b = self._texts(outputs)
        pts, d = self._score(TextStats.of(a), TextStats.of(b), self._ref(problem))
        o = self.opts
        if pts["structure"] == 0:
            for r in self.roles:
                n, (lo, hi) = d["n"][r], self.bounds[r]
                if not lo <= n <= hi:
                    what = "empty" if n == 0 else ("too short" if n < lo else "too long")
                    return f"The {self.labels[r]} is {what}: {n} words, needs {lo}-{hi}."
        lost = {k: 1 - pts[k] / self.points[k] for k in self._levels}
        level = max(self._levels, key=lambda k: (lost[k], -self._levels.index(k)))
        if lost[level] <= 1e-9:
            return f"All checks passed ({reward:.2f} of {self.max_reward:g}). Keep the content and polish the wording."
        la, lb = (self.labels[r] for r in self.roles)
        if level == "length_ratio":
            return (f"The {lb} is {d['ratio']:.1f}x as long as the {la}; "
                    f"aim for {o.ratio_min:g}-{o.ratio_max:g}x.")
        if level == "vocabulary":
            r = min(self.roles, key=lambda r: d["vocab"][r])
            return (f"The {self.labels[r]} repeats itself (vocabulary richness {d['mattr'][r]:.2f}, "
                    f"needs {VOCAB_FULL:g}); use more varied wording.")
        if level == "style":
            if d["transitions"] <= d["overlap_credit"]:
                return "Link the ideas with transition words such as 'however', 'moreover' or 'as a result'."
            if d["overlap"] > o.overlap_max:
                return (
                    f"The two parts share {d['overlap']:.0%} of their content words; "
                    f"say new things instead of repeating each other (aim for {o.overlap_min:.0%}-{o.overlap_max:.0%})."
                )
            return (f"The two parts share only {d['overlap']:.0%} of their content words; "
                    f"keep both about the paper's key terms (aim for {o.overlap_min:.0%}-{o.overlap_max:.0%}).")
        return (f"The abstract covers little of the paper's content (overlap {d['f1']:.2f} of 1 with the real one); "
                f"use the key terms of the title and the summaries.")


class WritingTLDR(_WritingTask):
    """``writing.tldr``: a one-sentence TL;DR (role ``tldr``) and a detailed summary (role
    ``summary``) of a paper's introduction and conclusion. Levels 1-4 of the module docstring;
    max_reward 4.0."""

    name = "writing.tldr"
    roles = ("tldr", "summary")
    Options = WritingTLDROptions
    points = TLDR_POINTS
    max_reward = sum(TLDR_POINTS.values())
    labels = {"tldr": "TL;DR", "summary": "summary"}
    markers = {"tldr": "TL;DR", "summary": "SUMMARY"}

    def __init__(self, opts: WritingTLDROptions | None = None) -> None:
        super().__init__(opts or WritingTLDROptions())

    def _problem_data(self, rec: dict[str, Any]) -> dict[str, Any]:
        # The conclusion gets at most half the word budget and the introduction the rest.
        budget = self.opts.max_source_words
        conclusion = truncate_words(rec["conclusion"], budget // 2)
        used = min(len(rec["conclusion"].split()), budget // 2)
        return {"paper_id": rec["id"], "title": rec["title"], "abstract": rec["abstract"],
                "introduction": truncate_words(rec["introduction"], budget - used), "conclusion": conclusion}

    def _source_block(self, problem: Problem) -> str:
        d = problem.data
        return f"Paper: {d['title']}\n\nIntroduction:\n{d['introduction']}\n\nConclusion:\n{d['conclusion']}"

    def _instruction(self, role: str) -> str:
        lo, hi = self.bounds[role]
        if role == "tldr":
            return f"Write a one-sentence TL;DR of this paper ({lo}-{hi} words): its main contribution."
        return f"Write a detailed summary of this paper ({lo}-{hi} words): the problem, the method and the results."


class WritingExpand(_WritingTask):
    """``writing.expand``: from the title and aspect summaries, the background/motivation half
    (role ``background``) and the method/results half (role ``method``) of an abstract.
    Levels 1-5 of the module docstring; max_reward 6.0."""

    name = "writing.expand"
    roles = ("background", "method")
    Options = WritingExpandOptions
    points = EXPAND_POINTS
    max_reward = sum(EXPAND_POINTS.values())
    labels = {"background": "background and motivation half", "method": "method and results half"}
    markers = {"background": "BACKGROUND", "method": "METHOD"}

    def __init__(self, opts: WritingExpandOptions | None = None) -> None:
        super().__init__(opts or WritingExpandOptions())

    def _problem_data(self, rec: dict[str, Any]) -> dict[str, Any]:
        per = max(1, self.opts.max_source_words // 3)
        return {"paper_id": rec["id"], "title": rec["title"], "abstract": rec["abstract"],
                "summaries": {a: truncate_words(rec["summaries"][a], per) for a in ASPECTS}}

    def _source_block(self, problem: Problem) -> str:
        d = problem.data
        s = d["summaries"]
        return (f"Paper: {d['title']}\n\nChallenge: {s['challenge']}\nApproach: {s['approach']}\n"
                f"Outcome: {s['outcome']}")

    def _instruction(self, role: str) -> str:
        lo, hi = self.bounds[role]
        if role == "background":
            return (f"Write the first half of this paper's abstract ({lo}-{hi} words): the background and "
                    "motivation, i.e. the problem and why it matters.")
        return f"Write the second half of this paper's abstract ({lo}-{hi} words): the method and the results."


__all__ = ["WritingExpand", "WritingExpandOptions", "WritingTLDR", "WritingTLDROptions", "load_papers"]
