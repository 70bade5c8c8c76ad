"""A proposer -> critic -> judge team on our own arithmetic problems, written against teamrl's public API.

Train it: teamrl train examples/proposer_critic_judge.yaml --plugin examples/proposer_critic_judge.py
"""
import random
import re
from dataclasses import dataclass

from teamrl.api import EpisodeOutcome, Problem, SolveTask, register_task, register_workflow


@dataclass
class ArithmeticOptions:
    name: str = "arithmetic"
    num_problems: int = 64
    seed: int = 0


@register_task("arithmetic")
class Arithmetic(SolveTask):
    """Sums and products of two small numbers; an answer is right when its last number is the value."""
    Options = ArithmeticOptions
    answer_instruction = "End with one line `Answer: <number>`."

    def __init__(self, opts: ArithmeticOptions) -> None:
        rng = random.Random(opts.seed)
        terms = [(rng.randint(2, 30), rng.choice("+*"), rng.randint(2, 30)) for _ in range(opts.num_problems)]
        self._problems = [Problem(f"a{i}", {"expr": f"{a} {op} {b}", "value": a + b if op == "+" else a * b})
                          for i, (a, op, b) in enumerate(terms)]

    def problems(self): return list(self._problems)
    def question(self, problem): return f"What is {problem.data['expr']}?"
    def extract(self, text): return (re.findall(r"-?\d+", text) or [None])[-1]
    def correct_many(self, problem, answers): return [a == str(problem.data["value"]) for a in answers]


@register_workflow("proposer_critic_judge", roles=("proposer", "critic", "judge"))
async def proposer_critic_judge(ctx, task, problem, settings):
    question = task.question(problem)
    proposal = await ctx.generate("proposer", f"{question}\n{task.answer_instruction}")
    critique = await ctx.generate("critic", f"{question}\nProposed solution:\n{proposal}\nPoint out any mistake.")
    verdict = await ctx.generate("judge", f"{question}\nSolution:\n{proposal}\nCritique:\n{critique}\n"
                                          f"Give the final answer. {task.answer_instruction}")
    answer = task.extract(verdict)
    return EpisodeOutcome(verdict, answer, task.correct_many(problem, [answer])[0])
