"""A coder and a critic with a code-running tool, on math word problems (math.solve), written against teamrl's API.

The coder writes a Python program that prints the answer; the sandbox runs it (the tool); the critic sees the program
and what it printed and says what to fix; the coder revises once; the final program's printed value is the answer.
The team reward is 1 when that answer is right, else 0 (one number per problem: no partial credit to give).

Why math.solve and not code.solve: a 135M model passes almost no HumanEval test, so every group scores 0 and GRPO has
nothing to learn from; copying "16 - 3" into `print(16 - 3)` is within its reach, and the tool makes the arithmetic
exact. The workflow runs the tool itself rather than offering it as a tool call (`ctx.generate(..., tools=[...])`):
a model this small seldom writes a valid `<tool_call>`, and a call never made is a program never run.

Train it: teamrl train examples/coder_critic.yaml --plugin examples/coder_critic.py
"""
import asyncio

from teamrl.api import EpisodeOutcome, register_workflow
from teamrl.sandbox import run_program
from teamrl.tasks.code_data import extract_code, fenced_code

CODER = "Write a short Python program that computes the answer and prints it. Reply with one ```python block."


async def run_tool(task, reply):
    """Run the program in `reply` in the sandbox: (what the critic is shown, the answer it printed or None)."""
    program = extract_code(reply)  # the fenced block, else the whole reply
    result = await asyncio.to_thread(run_program, program)  # off the event loop: other episodes keep generating
    if result.status != "ok":
        return f"```python\n{program}\n```\nIt failed ({result.status}): {result.first_failure}", None
    printed = result.stdout.strip()[-200:] or "(nothing)"
    return f"```python\n{program}\n```\nIt printed: {printed}", task.extract(result.stdout)


# a valid coder reply has a fenced block; the critic writes free text (not judged). Without `formats`, calibrate and
# eval would judge both by math.solve's own format (an `Answer:` line) and call every reply invalid.
@register_workflow("coder_critic", roles=("coder", "critic"),
                   formats={"coder": lambda text: fenced_code(text) is not None, "critic": None})
async def coder_critic(ctx, task, problem, settings):
    question = task.question(problem)
    draft = await ctx.generate("coder", f"{question}\n{CODER}")
    shown, _ = await run_tool(task, draft)
    critique = await ctx.generate("critic", f"{question}\nA program for it:\n{shown}\n"
                                            "Is the printed value the answer? Say briefly what to fix, if anything.")
    final = await ctx.generate("coder", f"{question}\nYour program:\n{shown}\nA reviewer says: {critique}\n"
                                        f"Write the corrected program. {CODER}")
    shown, answer = await run_tool(task, final)
    (correct,) = task.correct_many(problem, [answer])
    return EpisodeOutcome(shown, answer, correct, stats={"final_ran": float(answer is not None)})
