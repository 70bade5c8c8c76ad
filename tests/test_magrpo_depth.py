"""MAGRPO branches at most ``magrpo.num_turns`` steps deep; a workflow with more steps is rolled out past that depth
with one untrained sample per call (kills the mutant magrpo.one_turn_too_many)."""

from teamrl.algorithms import make_algorithm
from teamrl.core.config import load_config
from teamrl.tasks import make_task
from tests.scripted import scripted_rollout


def _answers(policy: str, prompt: str, n: int) -> list[str]:
    return [f"Answer: {j}" for j in range(n)]


def test_steps_past_num_turns_are_rolled_out_untrained():
    # voting: the generators act together (step 1), then the aggregator (step 2); one step of branching
    cfg = load_config(None, ["algorithm=magrpo", "magrpo.num_turns=1", "rollout.group_size=2", "workflow.name=voting",
                             "task.name=math.solve", "task.num_problems=4", "task.test_size=1"])
    task = make_task(cfg.task)
    samples = scripted_rollout(make_algorithm(cfg, task), task.problems()[:1], task, _answers)
    trained = [s for s in samples if s.trainable]
    assert trained and {s.turn for s in trained} == {0}
    assert "aggregator" not in {s.role for s in trained}
    tail = [s for s in samples if s.role == "aggregator"]
    assert len(tail) == 2 and not any(s.trainable for s in tail)  # one per joint action (G = 2, aligned), not G each
