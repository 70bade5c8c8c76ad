"""A researcher -> solver team in LangGraph (langgraph + langchain-openai), trained through teamrl's gateway unchanged.

Plain LangGraph code: the researcher reads the problem and hands it off to the solver with a note (a handoff tool,
routed by the graph); the solver has a calculator (LangGraph's ToolNode runs it) and streams its answers. The only
things that point it at teamrl are `base_url`, `api_key` and the model names, which name the roles: each role trains
its own LoRA adapter on one base (`policy.mode: lora_per_role`).

Train it:   teamrl train examples/langgraph_team.yaml --plugin examples/langgraph_team.py
            (needs `pip install -e ".[agents]"`: langgraph, langchain-openai)
Run it once against any OpenAI-compatible chat server (no teamrl involved):
            python examples/langgraph_team.py http://127.0.0.1:8000/v1 researcher-model solver-model
"""
import ast
import contextlib
import operator
import re
import sys

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg}


def evaluate(node):
    """Arithmetic only: numbers, + - * / and parentheses."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](evaluate(node.operand))
    raise ValueError("only numbers, + - * / and parentheses")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as (17 + 25) * 3."""
    try:
        return str(evaluate(ast.parse(expression, mode="eval")))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


@tool
def handoff_to_solver(note: str) -> str:
    """Hand the problem to the solver, with a short note on how to solve it."""
    return f"The solver takes over. Note: {note}"


def build_graph(base_url: str, api_key: str, models=("researcher", "solver")):
    """The team as a LangGraph graph: researcher -(handoff)-> solver <-> calculator."""
    researcher_llm = ChatOpenAI(model=models[0], base_url=base_url, api_key=api_key).bind_tools([handoff_to_solver])
    solver_llm = ChatOpenAI(model=models[1], base_url=base_url, api_key=api_key, streaming=True)
    solver_llm = solver_llm.bind_tools([calculator])

    def researcher(state: MessagesState):
        system = SystemMessage("Work out what the problem asks, then hand it off to the solver with a note.")
        return {"messages": [researcher_llm.invoke([system, *state["messages"]])]}

    def solver(state: MessagesState):
        system = SystemMessage("Solve the problem. Use the calculator for arithmetic. End with `Answer: <value>`.")
        return {"messages": [solver_llm.invoke([system, *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("researcher", researcher)
    graph.add_node("handoff", ToolNode([handoff_to_solver]))
    graph.add_node("solver", solver)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "researcher")
    graph.add_conditional_edges("researcher", tools_condition, {"tools": "handoff", END: END})
    graph.add_edge("handoff", "solver")
    graph.add_conditional_edges("solver", tools_condition, {"tools": "tools", END: END})
    graph.add_edge("tools", "solver")
    return graph.compile()


def last_number(text):
    found = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return found[-1] if found else None


def episode(problem, client, models=("researcher", "solver")):
    """One run of the graph; the reward is whether its last message's answer is right."""
    graph = build_graph(str(client.base_url), client.api_key, models)
    question = f"{problem['question']}\n{problem['answer_instruction']}"
    try:
        state = graph.invoke({"messages": [HumanMessage(question)]}, {"recursion_limit": 8})
    except GraphRecursionError:  # the agents kept calling tools: no answer
        return {"reward": 0.0, "correct": False}
    content = state["messages"][-1].content
    correct = last_number(content if isinstance(content, str) else "") == str(problem["data"]["answer"])
    return {"reward": float(correct), "correct": correct}


with contextlib.suppress(ImportError):  # registered when teamrl loads this file as a plugin; plain use needs no teamrl
    from teamrl.api import openai_workflow

    openai_workflow("langgraph_team", roles=("researcher", "solver"))(episode)

if __name__ == "__main__":
    url, researcher_name, solver_name = sys.argv[1:4]
    team = build_graph(url, "none", (researcher_name, solver_name))
    final = team.invoke({"messages": [HumanMessage("What is 17 * 25 + 3? End with one line `Answer: <value>`.")]},
                        {"recursion_limit": 8})
    print(final["messages"][-1].content)
