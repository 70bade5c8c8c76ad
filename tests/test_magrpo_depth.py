"""MAGRPO branches each role's first ``magrpo.num_turns`` calls, so every role that acts trains (issue 35 item 3);
a role's later calls are played with one untrained sample per call (kills the mutant magrpo.one_turn_too_many)."""

from teamrl.algorithms import MAGRPO, MAGRPOConfig, make_algorithm
from teamrl.core.config import load_config
from teamrl.tasks import make_task
from teamrl.tasks.task import Problem
from teamrl.workflows import Workflow
from tests.scripted import scripted_rollout

REF = "tests.test_magrpo_depth:"


def _answers(policy: str, prompt: str, n: int) -> list[str]:
    return [f"Answer: {j}" for j in range(n)]


async def two_rounds(ctx, task, problem, settings):
    """a, b, then a and b again (each seeing the texts so far); the final reward is 1 when the last b says 'Answer: 1'."""
    a = await ctx.generate("a", f"{problem.id} start")
    b = await ctx.generate("b", f"{problem.id} {a}")
    a2 = await ctx.generate("a", f"{problem.id} {a} {b}")
    b2 = await ctx.generate("b", f"{problem.id} {a} {b} {a2}")
    return 1.0 if b2 == "Answer: 1" else 0.0


TWO_ROUNDS = Workflow(two_rounds, ("a", "b"))


def test_every_role_of_a_sequential_workflow_trains_with_one_turn():
    # voting: the generators act together, then the aggregator (the workflow passes it turn=1): both are first calls.
    # Before: the aggregator was played untrained (2 samples, one per joint action) and never trained.
    cfg = load_config(None, ["algorithm=magrpo", "magrpo.num_turns=1", "rollout.group_size=2", "workflow.name=voting",
                             "task.name=math.solve", "task.num_problems=4", "task.test_size=1"])
    task = make_task(cfg.task)
    samples = scripted_rollout(make_algorithm(cfg, task), task.problems()[:1], task, _answers)
    assert all(s.trainable for s in samples)
    aggregator = [s for s in samples if s.role == "aggregator"]
    assert len(aggregator) == 4 and {s.tags["depth"] for s in aggregator} == {1}  # G under each of the G joint actions
    assert {s.turn for s in aggregator} == {1}  # the turn the workflow gave, as under grpo and at_grpo
    assert {len([s for s in aggregator if s.group == g]) for g in {s.group for s in aggregator}} == {2}


def test_later_calls_of_a_role_are_played_untrained_and_num_turns_two_trains_them():
    one = scripted_rollout(MAGRPO(MAGRPOConfig(num_turns=1), workflow=REF + "TWO_ROUNDS", group_size=2), [Problem("p")],
                           None, _answers)
    first = [s for s in one if s.trainable]
    assert sorted((s.role, s.tags["depth"]) for s in first) == sorted([("a", 0)] * 2 + [("b", 1)] * 4)
    played = [s for s in one if not s.trainable]
    assert sorted(s.role for s in played) == ["a"] * 4 + ["b"] * 4  # one a and one b per leaf (G x G leaves)
    assert all(s.tags.get("rollout") and "depth" not in s.tags for s in played)
    two = scripted_rollout(MAGRPO(MAGRPOConfig(num_turns=2), workflow=REF + "TWO_ROUNDS", group_size=2), [Problem("p")],
                           None, _answers)
    assert all(s.trainable for s in two) and len(two) == 2 + 4 + 8 + 16
    assert max(s.tags["depth"] for s in two) == 3
    # the b of the last level that says 'Answer: 1' is credited the final reward; its sibling 0
    last = sorted((s for s in two if s.tags["depth"] == 3 and s.tags["path"] == (0, 0, 0)), key=lambda s: s.branch)
    assert [s.reward for s in last] == [0.0, 1.0]


def test_calls_played_untrained_are_reported_once_naming_magrpo_num_turns(capsys):
    # before: a and b's second calls were sampled, logged trainable: false, and nothing said so
    algo = MAGRPO(MAGRPOConfig(num_turns=1), workflow=REF + "TWO_ROUNDS", group_size=2)
    scripted_rollout(algo, [Problem("p")], None, _answers)
    err = capsys.readouterr().err
    print(err)
    warnings = [line for line in err.splitlines() if line.startswith("warning: magrpo:")]
    assert len(warnings) == 1 and "magrpo.num_turns=1" in warnings[0] and "['a', 'b']" in warnings[0]
    scripted_rollout(algo, [Problem("p")], None, _answers)
    assert "warning:" not in capsys.readouterr().err  # once per run
    scripted_rollout(MAGRPO(MAGRPOConfig(num_turns=2), workflow=REF + "TWO_ROUNDS", group_size=2), [Problem("p")], None,
                     _answers)
    assert "warning:" not in capsys.readouterr().err  # every call trained: nothing to say
