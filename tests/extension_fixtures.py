"""Objects the extension-API tests name by ``package.module:object`` reference (nothing here registers)."""

from dataclasses import dataclass

from teamrl.api import EpisodeOutcome, Workflow


@dataclass
class EchoOptions:
    prefix: str = "Answer:"
    repeats: int = 1


async def echo(ctx, task, problem, settings: EchoOptions) -> EpisodeOutcome:
    """One agent answers ``settings.repeats`` times; the last answer counts."""
    text = ""
    for _ in range(settings.repeats):
        text = await ctx.generate("agent", f"{settings.prefix} {task.question(problem)}")
    answer = task.extract(text)
    return EpisodeOutcome(text, answer, task.correct_many(problem, [answer])[0])


ECHO = Workflow(echo, ("agent",), options=EchoOptions)


def forgot_return(sample, outcome):
    """A reward function that returns nothing."""
