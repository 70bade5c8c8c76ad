"""Teams written in agent frameworks (examples/agents_sdk_team.py, examples/langgraph_team.py) train unchanged through
the gateway: tool calls, hand-offs, one LoRA adapter per agent on one base.

Each trains 2 steps on the tiny random model in a subprocess (tests/framework_train.py; the plugin registers its
workflow there); some answers are scripted as Hermes tool calls (a random model writes none), the rest sampled. A
framework that is not installed skips its test (``pip install -e ".[agents]"``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


CALLED = '"name": "{}", "arguments"'  # in a prompt: the agent called it before (the tool listing has no arguments)
FRAMEWORKS = {
    # example, its roles, the module it needs, the scripted tool calls (policy, when its prompt holds, unless it holds)
    "agents_sdk": ("agents_sdk_team", ("triage", "solver"), "agents", [
        {"policy": "triage", "when": "transfer_to_solver", "text": call("transfer_to_solver")},
        {"policy": "solver", "when": '"calculator"', "unless": CALLED.format("calculator"), "text": call("calculator", expression="17 + 25")},
    ]),
    "langgraph": ("langgraph_team", ("researcher", "solver"), "langgraph", [
        {"policy": "researcher", "when": '"handoff_to_solver"', "unless": CALLED.format("handoff_to_solver"), "text": call("handoff_to_solver", note="add them")},
        {"policy": "solver", "when": '"calculator"', "unless": CALLED.format("calculator"), "text": call("calculator", expression="17 + 25")},
    ]),
}


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_framework_team_trains_two_steps_with_one_adapter_per_agent(framework, tmp_path):
    example, roles, module, rules = FRAMEWORKS[framework]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{framework}: the {module!r} package is not installed (pip install -e '.[agents]')")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "framework_train.py"), str(ROOT / "examples" / f"{example}.py"),
         str(ROOT / "examples" / f"{example}.yaml"), str(tmp_path), json.dumps(rules),
         "model=tiny-random", "train.steps=2", "rollout.group_size=4", "rollout.batch_size=2", "rollout.max_new_tokens=80",
         "workflow.reward=token_parity", "policy.device=cpu", "train.lr=0.01", "name=team", "run.progress=false",
         "run.tensorboard=false", "task.num_problems=16", "task.test_size=2", "policy.lora.r=4", "policy.lora.alpha=8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
             "OPENAI_AGENTS_DISABLE_TRACING": "1", "LANGSMITH_TRACING": "false"})
    assert done.returncode == 0, done.stderr[-3000:]
    trace = json.loads((tmp_path / "trace.json").read_text())
    recorded = trace["recorded"]
    # every call recorded once, with the engine's own tokens (tool-call parsing changed the answer, not the sample)
    assert sorted(map(tuple, (r["ids"] for r in recorded))) == sorted(map(tuple, trace["engine"]))
    assert {(r["role"], r["policy"]) for r in recorded} == {(role, role) for role in roles}  # one policy per agent
    calls = {r["role"]: r["tool_calls"] for r in recorded if r["tool_calls"]}
    assert set(calls) == set(roles)  # each agent's tool calls were returned as calls (the hand-off and the calculator)
    assert any(r["tool_result"] for r in recorded if r["role"] == "solver")  # the calculator ran; the solver saw 42
    (gateway,) = trace["gateway"]
    assert gateway["calls_recorded"] == len(recorded) and (framework != "langgraph" or gateway["calls_streamed"] > 0)
    records = [json.loads(line) for line in (tmp_path / "team" / "metrics.jsonl").read_text().splitlines()]
    norms = {role: [r.get(f"grad_norm/{role}", 0.0) for r in records] for role in roles}
    print(f"{framework}: grad norms per agent over 2 steps {norms}; tool_calls {[r.get('tool_calls') for r in records]},"
          f" malformed {[r.get('tool_calls_malformed') for r in records]}, prefix_breaks "
          f"{[r.get('prefix_breaks') for r in records]}; gateway {gateway}")
    assert [r["step"] for r in records] == [1, 2] and all(max(v) > 0 for v in norms.values()), norms
    assert sum(r["prefix_breaks"] for r in records) == 0 and sum(r["tool_calls"] for r in records) > 0


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_the_framework_example_is_plain_framework_code(framework):
    """teamrl appears only where the plugin registers the episode; the team itself imports the framework alone."""
    import ast
    example, _, module, _ = FRAMEWORKS[framework]
    tree = ast.parse((ROOT / "examples" / f"{example}.py").read_text())
    top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith("teamrl") for m in top) and any(m.split(".")[0] == module for m in top), top
    registering = [n for n in tree.body if isinstance(n, (ast.Try, ast.With))]
    assert len(registering) == 1 and "openai_workflow" in ast.unparse(registering[0])
