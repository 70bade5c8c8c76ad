"""AT-GRPO with parallel roles: each candidate is scored on the state it produces, and the episode goes on from it."""

import pytest

from teamrl.algorithms.at_grpo import ATGRPO, ATGRPOConfig
from teamrl.tasks.math_env import MathEnv, MathOptions
from tests.scripted import scripted_rollout


class CountingMathEnv(MathEnv):
    """The real math environment, counting the tool programs it runs in the sandbox."""

    def __init__(self, opts):
        super().__init__(opts)
        self.tool_runs = 0

    def run_tool(self, state, text):
        self.tool_runs += 1
        return super().run_tool(state, text)


@pytest.fixture(scope="module")
def env():
    return CountingMathEnv(MathOptions(num_problems=1, max_turns=2))


def test_parallel_candidates_are_scored_on_the_state_they_produce(env):
    problem = env.problems()[0]
    truth = problem.data["answer"]

    def script(policy, prompt, n):
        if policy == "reasoner":  # one right answer, one wrong
            return [f"Answer: {truth}", "Answer: 0"]
        return [f"```python\nprint({truth})\n```", "```python\nprint(0)\n```"]

    algo = ATGRPO(ATGRPOConfig(alpha=1.0, select="greedy"), k=2)
    samples = scripted_rollout(algo, [problem], env, script)
    # the chosen reasoner and tool answers agree on the truth at turn 0: the episode is solved and ends
    assert {s.turn for s in samples} == {0}
    assert all(s.tags["solved"] for s in samples)
    tool = sorted((s for s in samples if s.role == "tool"), key=lambda s: s.branch)
    # the tool's candidates saw the reasoner's chosen answer: agreeing on the truth gives the team reward
    assert [s.tags["team_reward"] for s in tool] == [1.0, 0.0]
    assert [s.reward for s in tool] == pytest.approx([1.0 + 1.0, 0.2])
    assert tool[0].tags.get("chosen") and not tool[1].tags.get("chosen")
    # every role still observed the state before the turn: the tool's prompt shows no reasoner answer yet
    assert all("previous answer" not in s.prompt_text for s in samples)
    # the episode continued from the scored state itself: no tool program ran again to rebuild it
    assert env.tool_runs == 2


def test_a_later_parallel_role_is_scored_after_the_earlier_roles_chosen_action(env):
    env.tool_runs = 0
    problem = env.problems()[0]
    truth = problem.data["answer"]

    def script(policy, prompt, n):
        if policy == "reasoner":  # only the second candidate is right: greedy chooses it
            return ["Answer: 0", f"Answer: {truth}"]
        return ["```python\nprint(0)\n```", f"```python\nprint({truth})\n```"]

    samples = scripted_rollout(ATGRPO(ATGRPOConfig(alpha=0.5, select="greedy"), k=2), [problem], env, script)
    tool = sorted((s for s in samples if s.role == "tool" and s.turn == 0), key=lambda s: s.branch)
    # print(0) agrees with nothing chosen (the reasoner chose the truth); print(truth) agrees: solved
    assert [s.tags["team_reward"] for s in tool] == [0.0, 1.0]
    assert [s.reward for s in tool] == pytest.approx([0.2, 1.0 + 0.5])
    assert all(s.tags["solved"] for s in samples) and {s.turn for s in samples} == {0}
    assert env.tool_runs == 2


def test_candidates_of_a_role_whose_turn_never_came_are_not_trained(env):
    problem = env.problems()[0]
    truth = problem.data["answer"]

    def script(policy, prompt, n):
        second_turn = "Turn 2 of 2" in prompt
        if policy == "reasoner":  # turn 1 wrong; turn 2 agrees with the tool's turn-1 answer: the episode ends
            return [f"Answer: {truth}", "Answer: 0"] if second_turn else ["Answer: 0", "Answer: 0"]
        return ["```python\nprint(3)\n```", "```python\nprint(4)\n```"] if second_turn else \
            [f"```python\nprint({truth})\n```", "```python\nprint(7)\n```"]

    samples = scripted_rollout(ATGRPO(ATGRPOConfig(alpha=1.0, select="greedy"), k=2), [problem], env, script)
    assert all(s.reward is not None for s in samples) and all(s.tags["solved"] for s in samples)
    late = [s for s in samples if s.role == "tool" and s.turn == 1]
    # the episode ended before the tool's turn-2 call: over the episode protocol it is never sampled
    # (before: its candidates were sampled with the reasoner's, tagged unused/no_update and not trained)
    assert late == [] and {(s.role, s.turn) for s in samples} == {("reasoner", 0), ("tool", 0), ("reasoner", 1)}
    assert all(s.trainable for s in samples)
