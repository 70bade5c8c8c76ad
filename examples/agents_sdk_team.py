"""A triage -> solver team in the OpenAI Agents SDK (openai-agents), trained through teamrl's gateway unchanged.

Plain Agents SDK code: the triage agent hands the problem off to the solver, which has a calculator tool. The only
things that point it at teamrl are the client (the gateway's base URL and token) and the model names, which name
the roles: each role trains its own LoRA adapter on one base (`policy.mode: lora_per_role`).

Train it:   teamrl train examples/agents_sdk_team.yaml --plugin examples/agents_sdk_team.py
            (needs `pip install -e ".[agents]"`: openai-agents)
Run it once against any OpenAI-compatible chat server (no teamrl involved):
            python examples/agents_sdk_team.py http://127.0.0.1:8000/v1 triage-model solver-model
"""
import ast
import asyncio
import operator
import re
import sys

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

set_tracing_disabled(True)  # no traces are sent anywhere

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg, ast.Pow: operator.pow}


def evaluate(expression: str) -> float:
    """Arithmetic only: numbers, + - * / ** and parentheses."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            right = ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 16:
                raise ValueError("exponent too large")
            return OPS[type(node.op)](ev(node.left), right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
    return ev(ast.parse(expression, mode="eval").body)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as (17 + 25) * 3.

    Args:
        expression: numbers, + - * / ** and parentheses.
    """
    try:
        return str(evaluate(expression))
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"


def build_team(client: AsyncOpenAI, models=("triage", "solver")) -> Agent:
    """The team: a triage agent that hands off to a solver with a calculator."""
    triage_model, solver_model = models
    solver = Agent(name="solver", instructions="Solve the problem. Use the calculator for arithmetic. "
                   "End with one line `Answer: <value>`.", tools=[calculator],
                   model=OpenAIChatCompletionsModel(model=solver_model, openai_client=client))
    return Agent(name="triage", instructions="Restate the problem briefly, then hand it off to the solver.",
                 handoffs=[solver], model=OpenAIChatCompletionsModel(model=triage_model, openai_client=client))


def last_number(text):
    found = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return found[-1] if found else None


async def episode(problem, client: AsyncOpenAI, models=("triage", "solver")):
    """One run of the team; the reward is whether its final answer is right (the solver's, when it was reached)."""
    question = f"{problem['question']}\n{problem['answer_instruction']}"
    try:
        result = await Runner.run(build_team(client, models), question, max_turns=4)
    except AgentsException:  # e.g. max turns exceeded: no answer
        return {"reward": 0.0, "correct": False}
    truth = str(problem["data"]["answer"])
    answer = last_number(result.final_output if isinstance(result.final_output, str) else "")
    correct = answer is not None and answer == truth
    return {"reward": float(correct), "correct": correct}


try:  # registered when teamrl loads this file as a plugin
    from teamrl.api import openai_workflow

    openai_workflow("agents_sdk_team", roles=("triage", "solver"))(episode)
except ImportError:  # plain Agents SDK use, without teamrl installed
    pass

if __name__ == "__main__":
    url, triage_name, solver_name = sys.argv[1:4]
    problem = {"question": "What is 17 * 25 + 3?", "answer_instruction": "End with one line `Answer: <value>`.",
               "data": {"answer": 428}}
    print(asyncio.run(episode(problem, AsyncOpenAI(base_url=url, api_key="none"), (triage_name, solver_name))))
