"""``teamrl eval`` over the one episode protocol: every method is a workflow, the baselines are the
ones declared for the run's workflow (``teamrl.workflows.eval_baselines``), the rest are refused."""

import pytest

from teamrl.core.config import ConfigError, load_config
from teamrl.tasks import TASKS
from teamrl.trainer.evaluate import default_methods, evaluate
from tests.test_magrpo import ToyTeam

TINY = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=4", "run.progress=false", "run.tensorboard=false"]


def test_default_methods_are_the_run_workflows_baselines(monkeypatch):
    monkeypatch.setitem(TASKS, "toy_team", ToyTeam)
    team = load_config(None, [*TINY, "algorithm=magrpo", "task.name=toy_team"])
    assert default_methods(team, has_checkpoint=False) == ["untrained", "single", "sequential", "discussion"]
    assert default_methods(team, has_checkpoint=True) == ["team", "untrained", "single", "sequential", "discussion"]
    assert default_methods(load_config(None, [*TINY, "task.name=word_count"]), has_checkpoint=True) == ["team", "untrained"]
    env = load_config(None, [*TINY, "algorithm=at_grpo", "task.name=plan_path"])
    assert default_methods(env, has_checkpoint=True) == ["team", "untrained", "single", "swapped"]
    voting = load_config(None, [*TINY, "task.name=math.solve", "workflow.name=voting"])
    assert default_methods(voting, has_checkpoint=False) == ["untrained", "single"]
    research = load_config(None, [*TINY, "algorithm=m_grpo", "task.name=research"])
    assert default_methods(research, has_checkpoint=False) == ["untrained", "single"]


def test_a_method_the_workflow_has_no_baseline_for_is_refused_in_one_line():
    cfg = load_config(None, [*TINY, "task.name=word_count"])
    with pytest.raises(ConfigError, match=r"^--method concat: workflow 'single' has no concat baseline; it takes "
                                          r"\['team', 'warm_start', 'untrained', 'baseline', 'single'\]$"):
        evaluate(cfg, ["concat"], progress=False)
    env = load_config(None, [*TINY, "algorithm=at_grpo", "task.name=plan_path"])
    with pytest.raises(ConfigError, match="workflow 'env' has no discussion baseline"):
        evaluate(env, ["discussion"], progress=False)


def test_a_solve_task_without_a_workflow_name_reports_pass_at_1_from_its_outcomes():
    cfg = load_config(None, [*TINY, "task.name=math.solve", "task.source=generated_easy", "task.num_problems=12", "task.test_size=3"])
    (row,) = evaluate(cfg, ["untrained"], limit=2, progress=False)
    assert row.problems == 2 and row.pass_at_1 is not None and row.pass_at_1 == row.stats["accuracy"]
    assert row.mean == pytest.approx(row.pass_at_1)  # a solve task's team return is 1/0 by correctness


def test_the_environment_single_baseline_is_the_last_role_alone(monkeypatch):
    cfg = load_config(None, [*TINY, "algorithm=at_grpo", "task.name=plan_path", "task.num_problems=2"])
    from teamrl.workflows import adapters

    seen = []
    real = adapters.env

    async def spy(ctx, environment, problem, settings, acting=()):
        out = await real(ctx, environment, problem, settings, acting)
        seen.extend(s.role for s in ctx.samples)
        return out

    monkeypatch.setattr(adapters, "env", spy)
    (row,) = evaluate(cfg, ["single"], limit=1, progress=False)
    from teamrl.tasks import make_task

    last = make_task(cfg.task).roles[-1]
    assert seen and set(seen) == {last} and row.pass_at_1 is not None


def test_a_team_task_with_a_passed_hook_reports_pass_at_1_for_its_team_and_prompt_baselines(monkeypatch):
    """A coding team task's pass@1 (its ``passed`` hook) comes from the workflow's outcome, for the team
    workflow and the scored prompt baselines alike; a task without the hook reports none."""
    monkeypatch.setitem(TASKS, "toy_team", ToyTeam)
    cfg = load_config(None, [*TINY, "algorithm=magrpo", "task.name=toy_team"])
    assert all(r.pass_at_1 is None for r in evaluate(cfg, ["untrained"], limit=2, progress=False))
    monkeypatch.setattr(ToyTeam, "passed", lambda self, problem, outputs: set(outputs) == {"short", "long"}, raising=False)
    rows = evaluate(cfg, ["untrained", "concat", "sequential"], limit=2, progress=False)
    assert [r.pass_at_1 for r in rows] == [1.0, 1.0, 1.0]


def test_untrained_is_the_runs_own_workflow_on_base_weights(monkeypatch):
    """An m_grpo.agents=single run trains research_single: its untrained row is research_single too
    (it was the main + sub team)."""
    from teamrl.workflows import WORKFLOWS, Workflow

    seen = []
    real = WORKFLOWS["research_single"]

    async def spy(ctx, env, problem, settings):
        out = await real.run(ctx, env, problem, settings)
        seen.append(ctx.workflow)
        return out

    monkeypatch.setitem(WORKFLOWS, "research_single", Workflow(spy, real.role_types, task_kind=real.task_kind))
    cfg = load_config(None, [*TINY, "algorithm=m_grpo", "task.name=research", "task.num_problems=4", "m_grpo.agents=single"])
    (row,) = evaluate(cfg, ["untrained"], limit=2, progress=False)
    assert seen == ["research_single"] * 2 and row.pass_at_1 is not None


def test_a_baseline_that_cannot_run_on_the_task_is_refused_before_any_model_loads(monkeypatch):
    """A user's workflow on a team task: its default ``single`` baseline (the ``single`` workflow) runs on
    one-role tasks only, so it is refused with the reason (it crashed inside the episode before)."""
    from teamrl.workflows import WORKFLOWS, Workflow

    async def pair(ctx, task, problem, settings):
        return 0.0

    monkeypatch.setitem(TASKS, "toy_team", ToyTeam)
    monkeypatch.setitem(WORKFLOWS, "pair", Workflow(pair, ("short", "long")))
    cfg = load_config(None, [*TINY, "task.name=toy_team", "workflow.name=pair"])
    with pytest.raises(ConfigError, match=r"^--method single \(workflow 'pair'\): workflow.name: 'single' runs on a one-role task"):
        evaluate(cfg, ["single"], progress=False)
