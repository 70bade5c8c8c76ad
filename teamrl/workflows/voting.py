"""Voting: several generators answer in parallel, an aggregator picks one of their answers.

Turn structure:

1. ``generator0 .. generator{n-1}`` (``workflow.options.num_generators``, default 3) answer the same
   prompt in parallel, in one engine batch (they are instances of one role type: under IP they
   share the ``generator`` adapter);
2. ``aggregator`` sees the problem and the numbered candidates and names one:
   ``Choice: <number>``.

The final answer is the chosen candidate. When the aggregator's reply names no candidate, the
fallbacks, in order, are (recorded in ``stats["choice_source"]``):

- ``parsed``: the last ``Choice: k`` (or ``Candidate k``) with 1 <= k <= n;
- ``answer``: the answer the reply states (``Answer:`` line) equals exactly one candidate's
  answer (the first such candidate);
- ``majority``: the most common candidate answer (ties to the lowest candidate number);
- ``first``: candidate 1, when no candidate has a readable answer.

Per-role reward (``workflow.reward: per_role``): the aggregator gets 1 when it picked a
correct candidate (its own parse, not a fallback; 0 when it named none); each generator gets
its own answer's correctness.
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections import Counter
from typing import Sequence

from teamrl.tasks.solve import SolveTask
from teamrl.tasks.task import Problem
from teamrl.workflows.context import EpisodeContext
from teamrl.workflows.outcome import DemoRow, EpisodeOutcome, StudyOptions, solved_reply, wrong_reply

ROLE_TYPES = ("generator", "aggregator")
CANDIDATE_CHARS = 1200  # of each candidate shown to the aggregator
_CHOICE = re.compile(r"(?:choice|candidate|choose|pick|select)\w*\s*(?:is\b)?\s*[:#=]?\s*\**\s*(\d+)", re.I)


def generator_roles(n: int) -> list[str]:
    return [f"generator{i}" for i in range(n)]


def parse_choice(text: str, n: int) -> int | None:
    """The 0-based candidate the aggregator named (the last valid ``Choice: k``), None if none."""
    valid = [int(k) - 1 for k in _CHOICE.findall(text) if 1 <= int(k) <= n]
    return valid[-1] if valid else None


def choice_readable(text: str) -> bool:
    """Whether an aggregator reply is in its format (``teamrl eval``'s valid replies): a ``Choice: k`` line."""
    return _CHOICE.search(text) is not None


#: the aggregator names a candidate (its fallbacks to a stated answer are leniency, not the format)
FORMATS = {"aggregator": choice_readable}


def choose(reply: str, answers: list[str | None], task: SolveTask) -> tuple[int, str]:
    """(chosen candidate, how it was chosen): the documented fallback order."""
    n = len(answers)
    parsed = parse_choice(reply, n)
    if parsed is not None:
        return parsed, "parsed"
    stated = task.extract(reply)
    if stated is not None:
        same = [i for i, a in enumerate(answers) if a is not None and a.strip() == stated.strip()]
        if same:
            return same[0], "answer"
    readable = [a for a in answers if a is not None]
    if readable:
        counts = Counter(readable)
        top = max(counts.values())
        return next(i for i, a in enumerate(answers) if a is not None and counts[a] == top), "majority"
    return 0, "first"


def aggregator_prompt(task: SolveTask, problem: Problem, candidates: list[str]) -> list[dict[str, str]]:
    shown = "\n\n".join(f"Candidate {i + 1}:\n{c[:CANDIDATE_CHARS]}" for i, c in enumerate(candidates))
    return [{"role": "user", "content": (
        f"{task.question(problem)}\n\n{len(candidates)} candidate solutions:\n\n{shown}\n\n"
        f"Which candidate is correct? Reply with one line `Choice: <number from 1 to {len(candidates)}>`.")}]


async def voting(ctx: EpisodeContext, task: SolveTask, problem: Problem, settings: StudyOptions) -> EpisodeOutcome:
    """Run one Voting episode; see the module docstring."""
    roles = generator_roles(settings.num_generators)
    prompt = task.prompt(problem)
    groups = await asyncio.gather(*[ctx.generate_group(r, prompt, n=1) for r in roles])
    gen_samples = [g[0] for g in groups]
    candidates = [s.text for s in gen_samples]
    (agg,) = await ctx.generate_group("aggregator", aggregator_prompt(task, problem, candidates), n=1, turn=1)
    answers = [task.extract(c) for c in candidates]
    chosen, source = choose(agg.text, answers, task)
    correct = task.correct_many(problem, answers)
    for s, c in zip(gen_samples, correct):
        s.role_reward = 1.0 if c else 0.0
    agg.role_reward = 1.0 if source == "parsed" and correct[chosen] else 0.0
    right = sum(correct)
    majority_right = right * 2 > len(correct)
    return EpisodeOutcome(candidates[chosen], answers[chosen], correct[chosen], stats={
        "agreement": "all_right" if right == len(correct) else "all_wrong" if right == 0 else "split",
        "oracle": right > 0,
        "miss": right > 0 and not correct[chosen],  # a correct candidate existed, the pick was wrong
        "recovery": correct[chosen] and not majority_right,  # right although most candidates were wrong
        "choice_source": source,
    })


def demonstrations(task: SolveTask, problem: Problem, settings: StudyOptions) -> list[DemoRow]:
    """Warm start (the study's format): a generator answering as the task demonstrates, and the aggregator naming
    the correct one of ``num_generators`` candidates (the others the same reply with a wrong integer answer; the
    correct one's place set by the problem id). Only the generator's row where the answer is not an integer."""
    right = solved_reply(task, problem)
    if right is None:
        return []
    rows: list[DemoRow] = [("generator", task.prompt(problem), right)]
    n = settings.num_generators
    offsets = [sign * k for k in range(1, n) for sign in (1, -1)][:n - 1]  # +1, -1, +2, ...
    candidates = [w for k in offsets if (w := wrong_reply(right, problem.data.get("answer"), k)) is not None]
    if len(candidates) == n - 1:
        pick = zlib.crc32(str(problem.id).encode()) % n
        candidates.insert(pick, right)
        rows.append(("aggregator", aggregator_prompt(task, problem, candidates), f"Choice: {pick + 1}"))
    return rows


def summary(outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """Voting's statistics over ``outcomes`` (registered as its ``Workflow.summary``): the share of
    episodes whose generators were all right, all wrong or split; oracle accuracy (any candidate
    correct); aggregator misses (a correct candidate existed, the pick was wrong) and recoveries
    (right although most candidates were wrong); the share of choices the aggregator stated itself."""
    n = len(outcomes)
    agreement = Counter(o.stats["agreement"] for o in outcomes)
    out = {f"voting/{k}": agreement[k] / n for k in ("all_right", "all_wrong", "split")}
    out["voting/oracle_accuracy"] = sum(o.stats["oracle"] for o in outcomes) / n
    out["voting/aggregator_miss"] = sum(o.stats["miss"] for o in outcomes) / n
    out["voting/aggregator_recovery"] = sum(o.stats["recovery"] for o in outcomes) / n
    out["voting/choice_parsed"] = sum(o.stats["choice_source"] == "parsed" for o in outcomes) / n
    return out
