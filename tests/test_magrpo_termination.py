"""MAGRPO early termination: a joint action that reaches the threshold is not punished for stopping."""

import pytest
import torch

from teamrl.algorithms.magrpo import MAGRPO, MAGRPOConfig
from teamrl.losses import group_advantages, group_ids_from_keys
from teamrl.tasks.task import Problem
from teamrl.workflows import Workflow
from tests.scripted import ScriptedTeam, scripted_rollout


def _script(policy, prompt, n):
    # turn 0: sample 0 solves (stops), sample 1 half-solves (continues); turn 1: both children are close
    return ["solve", "half"] if "turn 0" in prompt else ["close"] * n


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_a_terminated_success_is_credited_for_every_remaining_turn(gamma):
    algo = MAGRPO(MAGRPOConfig(num_turns=2, gamma=gamma, termination_threshold=1.0), group_size=2)
    samples = scripted_rollout(algo, [Problem("p0")], ScriptedTeam(), _script)
    first = sorted((s for s in samples if s.turn == 0), key=lambda s: s.branch)
    assert [s.text for s in first] == ["solve", "half"]
    # the solved joint action stopped: only the continuing one has children
    assert {s.tags["path"] for s in samples if s.turn == 1} == {(1,)}
    solved, continued = first
    assert solved.reward == pytest.approx(1.0 + gamma * 1.0)  # its reward for each of the 2 turns
    assert continued.reward == pytest.approx(0.5 + gamma * 0.9)
    adv = group_advantages(torch.tensor([s.reward for s in first]), group_ids_from_keys([s.group for s in first]))
    assert adv[0] > 0 > adv[1]  # solving early is better than not solving
    assert solved.tags["turn_reward"] == 1.0 and solved.tags["normalised_reward"] == 1.0


def test_every_joint_action_sums_the_same_number_of_turns_whether_it_stops_or_not():
    # 3 turns, gamma 1, threshold 0.5: "half" (0.5) stops too, so nothing expands and each is credited 3 times
    algo = MAGRPO(MAGRPOConfig(num_turns=3, gamma=1.0, termination_threshold=0.5), group_size=2)
    samples = scripted_rollout(algo, [Problem("p0")], ScriptedTeam(), _script)
    assert {s.turn for s in samples} == {0}
    assert sorted(s.reward for s in samples) == pytest.approx([1.5, 3.0])


REF = "tests.test_magrpo_termination:"
PER_CALL = {"solve": 1.0, "close": 0.9}


async def propose_critique_judge(ctx, task, problem, settings):
    """A sequential team (one call per step, so one branched level per role); each call's text is a team reward."""
    history = problem.id
    for role in ("proposer", "critic", "judge"):
        text = await ctx.generate(role, f"{role}: {history}")
        ctx.reward(PER_CALL.get(text, 0.0))
        history += " " + text
    return None


def _solve_or_close(policy, prompt, n):
    # the proposer's sample 0 solves, sample 1 comes close; every later call comes close
    return ["solve", "close"] if policy == "proposer" else ["close"] * n


SEQUENTIAL = Workflow(propose_critique_judge, ("proposer", "critic", "judge"))


def _proposals(threshold):
    algo = MAGRPO(MAGRPOConfig(num_turns=1, gamma=0.9, termination_threshold=threshold),
                  workflow=REF + "SEQUENTIAL", group_size=2)
    samples = scripted_rollout(algo, [Problem("p0")], None, _solve_or_close)
    first = sorted((s for s in samples if s.role == "proposer"), key=lambda s: s.branch)
    adv = group_advantages(torch.tensor([s.reward for s in first]), group_ids_from_keys([s.group for s in first]))
    return samples, first, adv


def test_a_terminated_solve_in_a_sequential_workflow_is_credited_for_every_level_below_it():
    # Audit of d3e8a20: each role's first call is its own level, so num_turns - call position left 1 "turn" at every
    # level: a terminated "solve" got R=1.000 (A=-0.707) under its continuing sibling's R=2.439 (A=+0.707).
    _, (solve, close), adv = _proposals(None)
    print(f"no threshold: solve R={solve.reward:.3f} A={adv[0]:+.3f}, close R={close.reward:.3f} A={adv[1]:+.3f}")
    assert solve.reward == pytest.approx(1.0 + 0.9 * 0.9 + 0.81 * 0.9) and close.reward == pytest.approx(2.439)
    samples, (solve, close), adv = _proposals(1.0)
    print(f"threshold 1.0: solve R={solve.reward:.3f} A={adv[0]:+.3f}, close R={close.reward:.3f} A={adv[1]:+.3f}")
    assert {s.tags["path"][:1] for s in samples if s.role != "proposer"} == {(1,)}  # only "close" goes on
    assert close.reward == pytest.approx(2.439)
    assert solve.reward == pytest.approx(1.0 * (1 + 0.9 + 0.81))  # absorbing over the proposer, critic and judge levels
    assert adv[0] > 0 > adv[1]
