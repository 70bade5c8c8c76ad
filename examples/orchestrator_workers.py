"""A dynamic orchestrator on math word problems (math.solve), written against teamrl's public API.

The orchestrator reads the problem and decides how many workers to call (1 to 4) and what each does, one
`Worker: <job>` line per worker; the workers (`worker0` .. `worker3`, instances of the declared `worker` role: one
policy) answer at once; the orchestrator reads their reports and gives the final `Answer:`. The team reward is 1 when
that answer is right, else 0: a job done well but combined wrongly is still a wrong answer.

Train it: teamrl train examples/orchestrator_workers.yaml --plugin examples/orchestrator_workers.py
"""
import asyncio
import re

from teamrl.api import EpisodeOutcome, register_workflow

MAX_WORKERS = 4
PLAN = (f"You lead up to {MAX_WORKERS} workers. Decide how many you need and give each one job, one line per worker: "
        "`Worker: <job>` (e.g. `Worker: compute 9 * 9`).")


def jobs_in(plan: str, question: str) -> list[str]:
    """The `Worker:` lines of the plan (at most MAX_WORKERS); none written: one worker gets the whole problem."""
    jobs = [job.strip() for job in re.findall(r"^\W*Worker\s*\d*\s*:(.+)$", plan, re.MULTILINE | re.IGNORECASE)]
    return [job for job in jobs if job][:MAX_WORKERS] or [question]


def orchestrator_valid(text: str) -> bool:
    """A readable plan (a `Worker:` line) or a final answer (an `Answer:` line); the workers are not judged."""
    return re.search(r"^\W*(Worker\s*\d*|Answer)\s*:", text, re.MULTILINE | re.IGNORECASE) is not None


@register_workflow("orchestrator_workers", roles=("orchestrator", "worker"),
                   formats={"orchestrator": orchestrator_valid, "worker": None})
async def orchestrator_workers(ctx, task, problem, settings):
    question = task.question(problem)
    plan = await ctx.generate("orchestrator", f"{question}\n{PLAN}")
    jobs = jobs_in(plan, question)
    reports = await asyncio.gather(*(  # one generation step: the workers answer side by side
        ctx.generate(f"worker{i}", f"{question}\nYour job: {job}\nDo it and end with `Result: <value>`.")
        for i, job in enumerate(jobs)))
    notes = "\n".join(f"Worker {i} ({job}): {report}" for i, (job, report) in enumerate(zip(jobs, reports)))
    final = await ctx.generate("orchestrator", f"{question}\nYour workers reported:\n{notes}\n"
                                               f"Combine their results. {task.answer_instruction}")
    answer = task.extract(final)
    (correct,) = task.correct_many(problem, [answer])
    return EpisodeOutcome(final, answer, correct, stats={"workers": float(len(jobs))})
