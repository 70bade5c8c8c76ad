"""``research``: multi-hop questions over an offline corpus, for a main agent with a tool-using sub-agent (M-GRPO).

The corpus is a set of pages (id, title, text, links). Generated (the default, seeded) it
holds people, companies and cities whose facts chain: a company page names its founder, the
founder's page names the city of birth, the city's page names the country. Questions need two
or three hops (``In which city was the founder of X born?``) or a hop plus arithmetic
(``How old was the founder of X when X was founded?``); answers are exact strings or integers.
A user's own corpus and questions load from two JSONL files (:func:`load_corpus`,
:func:`load_questions`).

Agents and actions (one tag per reply; the last tag in a reply counts):

main (team)
    ``<subtask>what to find</subtask>`` calls the sub-agent (at most ``max_sub_calls`` times),
    ``<answer>...</answer>`` ends the episode.
sub
    ``<search>words</search>``, ``<open>page id</open>``, ``<python>code</python>`` (run in the
    sandbox, never in this process) or ``<result>finding</result>``, which returns the finding
    to the main agent; ``max_sub_turns`` replies at most.
main (single agent, the baseline)
    the sub-agent's three tools plus ``<answer>``, ``max_sub_turns`` replies at most.

Rewards (options): main ``reward_correct`` (1.0) for a correct answer, ``reward_wrong`` (0.1)
for a well-formed wrong one, ``reward_invalid`` (0.0) when a reply has no action tag, the main
agent asks for one sub-agent call more than allowed, or no answer came within the turns. A sub-trajectory is
*format-valid* when every reply had exactly one known action
tag and it ended with ``<result>``; how that gates the main outcome is M-GRPO's
``m_grpo.sub_reward`` (see :func:`sub_reward`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from teamrl.core.config import ConfigError, option
from teamrl.sandbox import SandboxLimits, run_program
from teamrl.tasks.task import Problem
from teamrl.tasks.jsonl import read_jsonl
from teamrl.tasks.tool_planner import describe_result, truncate

SUB_REWARD_MODES = ("gated", "outcome", "format")
SUB_TOOLS = ("search", "open", "python")
SEARCH_HITS = 3  # pages listed per search
PAGE_CHARS = 400  # of a page shown by open()
RESULT_CHARS = 300  # of a sub-agent result shown to the main agent
_TAG = re.compile(r"<(subtask|answer|search|open|python|result)>(.*?)</\1>", re.S | re.I)
_WORD = re.compile(r"[a-z0-9]+")

_SYLLABLES = ("ka", "lo", "mir", "ven", "ta", "dor", "sel", "ri", "an", "bel", "cor", "ith", "mo", "ras", "un", "zel")
_COUNTRIES = ("Oskaria", "Velmont", "Drussia", "Calder", "Peyrland")
_INDUSTRIES = ("Works", "Labs", "Foundry", "Mills", "Systems", "Press")


@dataclass
class ResearchOptions:
    name: str = "research"
    source: str = option("generated", choices=("generated", "files"),
                         doc="generated: a seeded corpus and questions; files: corpus_path + qa_path (JSONL)")
    corpus_path: str = option("", doc="files: JSONL of pages {id, title, text[, links]}")
    qa_path: str = option("", doc="files: JSONL of questions {question, answer[, id]}")
    num_problems: int = option(32, ge=1, doc="questions (generated), or the first N of qa_path")
    num_people: int = option(12, ge=2, doc="generated: people (companies and cities scale with it)")
    seed: int = option(0, doc="seed of the generated corpus and questions")
    kinds: str = option("city,country,age", doc="generated: the question kinds, comma-separated, asked in turn (a "
                        "difficulty knob): city (2 hops), country (3 hops), age (2 hops and a subtraction)")
    max_sub_calls: int = option(2, ge=0, doc="sub-agent calls the main agent may make per episode")
    max_sub_turns: int = option(
        3, ge=1, doc="replies per sub-agent call (tool loop length); also the single agent's limit"
    )
    reward_correct: float = option(1.0, doc="main reward for a correct answer")
    reward_wrong: float = option(0.1, doc="main reward for a well-formed wrong answer")
    reward_invalid: float = option(0.0, doc="main reward when a reply has no action or no answer came")
    wall_seconds: float = option(3.0, gt=0, doc="sandbox wall-clock (and CPU) limit of a python tool call")


@dataclass(frozen=True)
class Action:
    """One parsed reply: ``kind`` is a tag name (``subtask``, ``answer``, a tool, ``result``) or ``invalid``."""

    kind: str
    arg: str = ""


def parse_action(text: str, allowed: Sequence[str]) -> Action:
    """The last ``<tag>...</tag>`` of ``text`` whose tag is in ``allowed``; ``invalid`` when there is none.

    A reply with action tags of two different kinds is still read by its last tag (the model
    may think aloud with a tool name) but :func:`well_formed` reports it as not well-formed.
    """
    if not isinstance(text, str):
        raise ValueError(f"parse_action: expected a str, got {type(text).__name__}")
    hits = [(m.group(1).lower(), m.group(2).strip()) for m in _TAG.finditer(text) if m.group(1).lower() in allowed]
    if not hits:
        return Action("invalid")
    kind, arg = hits[-1]
    return Action(kind, arg)


def well_formed(text: str, allowed: Sequence[str]) -> bool:
    """Exactly one action tag, of an allowed kind."""
    hits = [m.group(1).lower() for m in _TAG.finditer(text)]
    return len(hits) == 1 and hits[0] in allowed


def normalise(answer: str) -> str:
    """Lower case, words and digits only, single spaces (``" Mirath."`` -> ``"mirath"``)."""
    return " ".join(_WORD.findall(str(answer).lower()))


def answers_match(given: str, truth: str) -> bool:
    """Exact match after :func:`normalise`; integers compare by value (``"035"`` == ``"35"``)."""
    a, b = normalise(given), normalise(truth)
    if a.isdigit() and b.isdigit():
        return int(a) == int(b)
    return bool(a) and a == b


def sub_reward(main_reward: float, format_valid: bool, mode: str) -> float:
    """A sub-trajectory's reward from its parent rollout's main reward.

    ``gated``: the main reward if the sub-trajectory is format-valid, else 0; ``outcome``: the
    main reward regardless of format; ``format``: 1 if format-valid, else 0.
    """
    if mode == "gated":
        return float(main_reward) if format_valid else 0.0
    if mode == "outcome":
        return float(main_reward)
    if mode == "format":
        return 1.0 if format_valid else 0.0
    raise ValueError(f"sub_reward mode {mode!r}: choose one of {list(SUB_REWARD_MODES)}")


# --- corpus ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    id: str
    title: str
    text: str
    links: tuple[str, ...] = ()


def _name(rng: random.Random, used: set[str], parts: int = 2) -> str:
    while True:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()
        if word not in used:
            used.add(word)
            return word


def generate_corpus(num_people: int, seed: int) -> tuple[dict[str, Page], list[dict[str, Any]]]:
    """(pages by id, facts per company) for a seeded world of people, companies and cities.

    Each company has one founder; each person a birth city and year; each city a country.
    """
    rng = random.Random(seed)
    used: set[str] = set()
    cities = [{"name": _name(rng, used), "country": rng.choice(_COUNTRIES), "population": rng.randrange(20, 900) * 1000}
              for _ in range(max(2, num_people // 2))]
    people = [{"name": f"{_name(rng, used)} {_name(rng, used)}", "city": rng.randrange(len(cities)),
               "born": rng.randrange(1930, 1990)} for _ in range(num_people)]
    companies = []
    for i, person in enumerate(people):
        companies.append({"name": f"{_name(rng, used)} {rng.choice(_INDUSTRIES)}", "founder": i,
                          "founded": person["born"] + rng.randrange(22, 50)})
    pages: dict[str, Page] = {}
    order = [("city", c) for c in cities] + [("person", p) for p in people] + [("company", c) for c in companies]
    rng.shuffle(order)  # page ids say nothing about the entity type
    ids = {id(e): f"p{i:03d}" for i, (_, e) in enumerate(order)}
    for kind, e in order:
        pid = ids[id(e)]
        if kind == "city":
            pages[pid] = Page(
                pid, e["name"], f"{e['name']} is a city in {e['country']} with {e['population']} inhabitants."
            )
        elif kind == "person":
            city = cities[e["city"]]
            pages[pid] = Page(
                pid,
                e["name"],
                f"{e['name']} was born in {e['born']} in {city['name']} (page {ids[id(city)]}).",
                (ids[id(city)],),
            )
        else:
            founder = people[e["founder"]]
            pages[pid] = Page(pid, e["name"], f"{e['name']} was founded in {e['founded']} by {founder['name']} "
                                              f"(page {ids[id(founder)]}).", (ids[id(founder)],))
    facts = [{"company": c["name"], "founded": c["founded"], "founder": people[c["founder"]]["name"],
              "born": people[c["founder"]]["born"], "city": cities[people[c["founder"]]["city"]]["name"],
              "country": cities[people[c["founder"]]["city"]]["country"]} for c in companies]
    return pages, facts


QUESTION_KINDS = ("city", "country", "age")


def generate_questions(
    facts: list[dict[str, Any]], n: int, seed: int, kinds: Sequence[str] = QUESTION_KINDS
) -> list[Problem]:
    """``n`` multi-hop questions with exact answers (city: 2 hops; country: 3; age at founding: 2 + arithmetic),
    of ``kinds`` in turn."""
    rng = random.Random(seed + 1)
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in QUESTION_KINDS]
    if bad or not kinds:
        raise ConfigError(f"task.kinds: {','.join(kinds)!r} is not a comma-separated list of question kinds; "
                          f"choose from {','.join(QUESTION_KINDS)} (e.g. city for the 2-hop questions only)")
    out = []
    for i in range(n):
        f = facts[rng.randrange(len(facts))]
        kind = kinds[i % len(kinds)]
        if kind == "city":
            q, a = f"In which city was the founder of {f['company']} born?", f["city"]
        elif kind == "country":
            q, a = f"In which country was the founder of {f['company']} born?", f["country"]
        else:
            q, a = (
                f"How old was the founder of {f['company']} in the year {f['company']} was founded?",
                str(f["founded"] - f["born"]),
            )
        out.append(Problem(f"research-{i:04d}", {"question": q, "answer": a, "kind": kind}))
    return out


def _read_jsonl(path: str, what: str) -> list[dict[str, Any]]:
    """:func:`read_jsonl`, its errors as config errors naming ``task.<what>``."""
    try:
        return read_jsonl(path, f"task.{what}", "give a JSONL file (source: files)")
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"task.{what}: {e}" if isinstance(e, ValueError) else str(e)) from None


def load_corpus(path: str) -> dict[str, Page]:
    """Pages from a JSONL file of ``{"id", "title", "text"[, "links"]}`` objects."""
    pages = {}
    for n, row in enumerate(_read_jsonl(path, "corpus_path"), 1):
        missing = [k for k in ("id", "title", "text") if not isinstance(row.get(k), str)]
        if missing:
            raise ConfigError(
                f"task.corpus_path: {path} row {n} lacks string field(s) {missing}; each page needs id, title, text"
            )
        pages[row["id"]] = Page(row["id"], row["title"], row["text"], tuple(row.get("links", ())))
    if not pages:
        raise ConfigError(f"task.corpus_path: {path} has no pages")
    return pages


def load_questions(path: str, limit: int) -> list[Problem]:
    """The first ``limit`` questions of a JSONL file of ``{"question", "answer"[, "id"]}`` objects."""
    out = []
    for n, row in enumerate(_read_jsonl(path, "qa_path"), 1):
        if not isinstance(row.get("question"), str) or "answer" not in row:
            raise ConfigError(f"task.qa_path: {path} row {n} needs a string 'question' and an 'answer'")
        out.append(
            Problem(str(row.get("id", f"qa-{n:05d}")), {"question": row["question"], "answer": str(row["answer"])})
        )
        if len(out) >= limit:
            break
    if not out:
        raise ConfigError(f"task.qa_path: {path} has no questions")
    return out


# --- tools (plain functions over the corpus) -------------------------------------------------


def search(pages: dict[str, Page], query: str, hits: int = SEARCH_HITS) -> str:
    """The ``hits`` pages sharing the most words with ``query`` (title words count double), one line each."""
    words = set(_WORD.findall(query.lower()))
    if not words:
        return "(empty query)"
    scored = []
    for p in pages.values():
        title, text = set(_WORD.findall(p.title.lower())), set(_WORD.findall(p.text.lower()))
        score = 2 * len(words & title) + len(words & text)
        if score:
            scored.append((-score, p.id))
    if not scored:
        return "(no pages match)"
    return "\n".join(f"{pid}: {pages[pid].title}" for _, pid in sorted(scored)[:hits])


def open_page(pages: dict[str, Page], page_id: str) -> str:
    """The page's title and text, or a message naming the bad id."""
    p = pages.get(page_id.strip())
    if p is None:
        return f"(no page {page_id.strip()!r}; ids look like {next(iter(pages))})"
    return truncate(f"{p.title}\n{p.text}", PAGE_CHARS)


# --- the environment -------------------------------------------------------------------------


class ResearchEnv:
    """The research environment: questions, the corpus, the tools, the action parsers and rewards.

    The episode itself (main turns, nested sub-agent calls) is the workflow
    :mod:`teamrl.workflows.research_team`; this class holds everything it reads.
    """

    name: ClassVar[str] = "research"
    roles: ClassVar[tuple[str, ...]] = ("main", "sub")
    Options = ResearchOptions
    max_reward: ClassVar[float] = 1.0

    def __init__(self, opts: ResearchOptions | None = None) -> None:
        self.opts = opts or ResearchOptions()
        o = self.opts
        if o.source == "files":
            self.pages = load_corpus(o.corpus_path)
            self._problems = load_questions(o.qa_path, o.num_problems)
        else:
            self.pages, facts = generate_corpus(o.num_people, o.seed)
            self._problems = generate_questions(facts, o.num_problems, o.seed, [k.strip() for k in o.kinds.split(",")])
        self.limits = SandboxLimits(wall_seconds=o.wall_seconds, cpu_seconds=o.wall_seconds)

    def problems(self) -> list[Problem]:
        """The questions, in a fixed order."""
        return list(self._problems)

    # -- prompts --------------------------------------------------------------------------
    def main_prompt(self, problem: Problem) -> list[dict[str, str]]:
        """The main agent's first message (team mode)."""
        return [
            {
                "role": "user",
                "content": (
                    "You are the main agent. Answer the question using a helper agent that can search and read an "
                    "encyclopedia. "
                    "Each reply holds one tag: <subtask>what the helper should find</subtask> (at most "
                    f"{self.opts.max_sub_calls} times) "
                    "or <answer>the final answer</answer>.\n"
                    "Example reply: <subtask>Find who founded Acme Works and where that person was born.</subtask>\n"
                    f"Question: {problem.data['question']}"
                ),
            }
        ]

    def sub_prompt(self, problem: Problem, subtask: str) -> list[dict[str, str]]:
        """The sub-agent's first message for one call."""
        return [
            {
                "role": "user",
                "content": (
                    "You are a research helper with an encyclopedia. Each reply holds one tag: <search>words</search>, "
                    "<open>page id</open>, <python>code that prints</python>, or <result>what you found</result> "
                    "to finish "
                    f"(within {self.opts.max_sub_turns} replies).\nExample reply: <search>Acme "
                    f"Works</search>\nTask: {subtask}"
                ),
            }
        ]

    def single_prompt(self, problem: Problem) -> list[dict[str, str]]:
        """The single agent's first message (the baseline: one agent with the tools)."""
        return [{"role": "user", "content": (
            "Answer the question with an encyclopedia. Each reply holds one tag: <search>words</search>, "
            "<open>page id</open>, <python>code that prints</python>, or <answer>the final answer</answer> "
            f"(within {self.opts.max_sub_turns} replies).\nExample reply: <search>Acme Works</search>\n"
            f"Question: {problem.data['question']}")}]

    # -- actions --------------------------------------------------------------------------
    def parse_main(self, text: str) -> Action:
        """The main agent's action: ``subtask``, ``answer`` or ``invalid``."""
        return parse_action(text, ("subtask", "answer"))

    def parse_sub(self, text: str) -> Action:
        """The sub-agent's action: a tool, ``result`` or ``invalid``."""
        return parse_action(text, (*SUB_TOOLS, "result"))

    def parse_single(self, text: str) -> Action:
        """The single agent's action: a tool, ``answer`` or ``invalid``."""
        return parse_action(text, (*SUB_TOOLS, "answer"))

    def valid(self, problem: Problem, text: str) -> bool:
        """Format validity (``teamrl eval``): exactly one action tag of any agent's (subtask, answer, a tool,
        result)."""
        return well_formed(text, ("subtask", "answer", *SUB_TOOLS, "result"))

    def sub_well_formed(self, text: str) -> bool:
        """Whether a sub-agent reply has exactly one known action tag."""
        return well_formed(text, (*SUB_TOOLS, "result"))

    def run_tool(self, action: Action) -> str:
        """What the agent is shown after a tool action; ``python`` runs only in the sandbox."""
        if action.kind == "search":
            return search(self.pages, action.arg)
        if action.kind == "open":
            return open_page(self.pages, action.arg)
        if action.kind == "python":
            return describe_result(run_program(action.arg, limits=self.limits))
        raise ValueError(f"run_tool: {action.kind!r} is not a tool; tools are {list(SUB_TOOLS)}")

    # -- rewards --------------------------------------------------------------------------
    def correct(self, problem: Problem, answer: str | None) -> bool:
        """Whether ``answer`` matches the question's answer exactly (after normalising)."""
        return answer is not None and answers_match(answer, problem.data["answer"])

    def demonstrations(self, problem: Problem) -> list[tuple[str, list[dict[str, str]], str]]:
        """Warm start (``teamrl sft``): one correct team episode of a generated question, in the
        tool protocol, with the environment's own prompts and tool outputs. The main agent asks
        for the founder, then for the founder's birth (and the city's country), then answers; the
        sub-agent searches and opens pages and returns a ``<result>``. Needs ``max_sub_calls`` >= 2
        and ``max_sub_turns`` >= 3; questions loaded from files have no known chain and no demonstrations."""
        o = self.opts
        if o.source != "generated":
            return []
        if o.max_sub_calls < 2 or o.max_sub_turns < 3:
            raise ConfigError(f"research demonstrations take two sub-agent calls of up to three replies; got "
                              f"task.max_sub_calls={o.max_sub_calls}, task.max_sub_turns={o.max_sub_turns}")
        company = re.search(r"founder of (.+?) (?:born\?|in the year)", problem.data["question"]).group(1)
        company_id = next(p.id for p in self.pages.values() if p.title == company)
        founder_id = self.pages[company_id].links[0]
        founder = self.pages[founder_id]
        demos: list[tuple[str, list[dict[str, str]], str]] = []

        def sub_call(subtask: str, replies: list[str]) -> str:
            """The sub-agent's replies with the tool outputs it sees; returns its result."""
            messages = self.sub_prompt(problem, subtask)
            for reply in replies:
                demos.append(("sub", messages, reply))
                action = self.parse_sub(reply)
                if action.kind == "result":
                    return action.arg
                messages = messages + [{"role": "assistant", "content": reply},
                                       {"role": "user", "content": f"Tool output:\n{self.run_tool(action)}"}]
            raise AssertionError("a sub-agent demonstration ends with <result>")

        asks = [f"Find who founded {company}, with that person's page id.",
                f"Open page {founder_id} ({founder.title}) and find when and where that person was born"
                + (", then the country of that city." if problem.data["kind"] == "country" else ".")]
        results = [sub_call(asks[0], [f"<search>{company}</search>", f"<open>{company_id}</open>",
                                      f"<result>{self.pages[company_id].text}</result>"])]
        second = [f"<open>{founder_id}</open>"]
        finding = founder.text
        if problem.data["kind"] == "country":
            city = self.pages[founder.links[0]]
            second.append(f"<open>{city.id}</open>")
            finding = f"{founder.text} {city.text}"
        results.append(sub_call(asks[1], [*second, f"<result>{finding}</result>"]))
        messages = self.main_prompt(problem)
        for ask, result in zip(asks, results):
            demos.append(("main", messages, f"<subtask>{ask}</subtask>"))
            messages = messages + [{"role": "assistant", "content": f"<subtask>{ask}</subtask>"},
                                   {"role": "user", "content": f"Helper result: {truncate(result, RESULT_CHARS)}"}]
        demos.append(("main", messages, f"<answer>{problem.data['answer']}</answer>"))
        return demos

    def main_reward(self, problem: Problem, answer: str | None, valid: bool) -> float:
        """``reward_correct`` / ``reward_wrong`` / ``reward_invalid`` (no answer, or a reply without an action)."""
        if not valid or answer is None:
            return self.opts.reward_invalid
        return self.opts.reward_correct if self.correct(problem, answer) else self.opts.reward_wrong
