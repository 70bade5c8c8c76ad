"""``teamrl eval`` on a run trained with ``workflow.name``: the configured workflow is evaluated
(trained team, untrained team, single-agent baseline) with the workflow's own statistics."""

import pytest

from teamrl.core.config import load_config
from teamrl.trainer.evaluate import evaluate, format_table
from teamrl.trainer.trainer import Trainer
from teamrl.workflows import WORKFLOWS, EpisodeOutcome, Workflow

BASE = "__base__"


async def probe(ctx, task, problem, settings) -> EpisodeOutcome:
    """A two-role workflow whose stats say which weights its roles were routed to (and carry a text stat)."""
    draft = await ctx.generate("drafter", task.prompt(problem))
    final = await ctx.generate("checker", f"{task.question(problem)}\nDraft:\n{draft}\n{task.answer_instruction}")
    answer = task.extract(final)
    return EpisodeOutcome(final, answer, task.correct_many(problem, [answer])[0], stats={
        "base_weights": 1.0 if ctx.route("checker") == BASE else 0.0, "calls": 2, "note": "not a number"})


@pytest.fixture
def probe_workflow(monkeypatch):
    monkeypatch.setitem(WORKFLOWS, "probe", Workflow(probe, ("drafter", "checker")))


def _cfg(tmp_path, *extra):
    return load_config(None, ["name=wf", f"run.dir={tmp_path}", "model=tiny-random", "threads=1", "task.name=math.solve",
                              "task.source=generated_easy", "task.num_problems=12", "task.test_size=3",
                              "workflow.name=voting", "rollout.group_size=2", "rollout.batch_size=1",
                              "rollout.max_new_tokens=4", "train.steps=1", "run.progress=false", "run.tensorboard=false",
                              "policy.lora.r=4", *extra])


def test_eval_of_a_voting_run_runs_the_voting_workflow(tmp_path):
    cfg = _cfg(tmp_path)
    Trainer(cfg).train()
    held_out = _cfg(tmp_path, "task.split=test")
    rows = evaluate(held_out, ["team", "untrained", "single"], checkpoint=tmp_path / "wf", limit=3, progress=False)
    by = {r.method: r for r in rows}
    assert list(by) == ["team", "untrained", "single"]
    for m in ("team", "untrained"):  # the voting team: 3 generators + aggregator, with the study's diagnostics
        assert by[m].replies_per_problem == 4, (m, by[m].replies_per_problem)
        assert {"voting/oracle_accuracy", "voting/choice_parsed", "accuracy"} <= set(by[m].stats), by[m].stats
    assert by["single"].replies_per_problem == 1 and "voting/oracle_accuracy" not in by["single"].stats
    assert all(r.problems == 3 and r.pass_at_1 == r.stats["accuracy"] for r in rows)
    table = format_table(rows)
    assert "| untrained |" in table and "voting/oracle_accuracy" in table


def test_eval_of_a_users_workflow_routes_trained_and_base_weights_and_keeps_its_stats(tmp_path, probe_workflow):
    cfg = _cfg(tmp_path, "workflow.name=probe", "policy.mode=lora_per_role")
    Trainer(cfg).train()
    rows = evaluate(_cfg(tmp_path, "workflow.name=probe", "policy.mode=lora_per_role", "task.split=test"),
                    ["team", "untrained"], checkpoint=tmp_path / "wf", limit=2, progress=False)
    team, untrained = rows
    assert team.stats["base_weights"] == 0.0 and untrained.stats["base_weights"] == 1.0
    assert team.stats["calls"] == 2.0 and "note" not in team.stats  # numeric stats as means; text is not averaged
    assert team.replies_per_problem == 2


async def shaped(ctx, task, problem, settings) -> float:
    """A user workflow scored by its own reward (0.25 for trying), not the task's 1 / 0."""
    await ctx.generate("solver", task.prompt(problem))
    return 0.25


def test_eval_says_when_rows_are_scored_by_different_measures(tmp_path, monkeypatch):
    """The single baseline is scored by the task's reward, a user workflow by its own: the table and
    results.json name each row's measure and say that their returns do not compare."""
    import json

    from teamrl.trainer.evaluate import write_results

    monkeypatch.setitem(WORKFLOWS, "shaped", Workflow(shaped, ("solver",)))
    cfg = _cfg(tmp_path, "workflow.name=shaped", "task.split=test")
    rows = evaluate(cfg, ["untrained", "single"], limit=2, progress=False)
    by = {r.method: r for r in rows}
    assert by["untrained"].scores == [0.25, 0.25]
    assert "'shaped'" in by["untrained"].scored_by and "math.solve" in by["single"].scored_by
    table = format_table(rows)
    assert "| scored by |" in table and "different measures" in table, table
    from teamrl.trainer.evaluate import compare, format_comparison

    assert "not comparable" in format_comparison(compare(rows, "untrained", "single"))  # the paired difference says so too
    results = json.loads((write_results(rows, tmp_path / "ev", cfg, ["teamrl", "eval"]) / "results.json").read_text())
    assert results["methods"]["single"]["scored_by"] == by["single"].scored_by
    assert results["comparisons"][0]["same_measure"] is False and results["measures_differ"] is True
    from teamrl.trainer.report_html import _eval_table

    assert "<th>scored by</th>" in _eval_table(results) and "different measures" in _eval_table(results)  # the HTML report


def test_shipped_workflow_rows_share_one_measure(tmp_path):
    rows = evaluate(_cfg(tmp_path, "task.split=test"), ["untrained", "single"], limit=1, progress=False)
    assert rows[0].scored_by == rows[1].scored_by
    assert "different measures" not in format_table(rows) and "scored by" not in format_table(rows)


def test_cli_eval_of_a_workflow_run_defaults_to_team_untrained_single(tmp_path, capsys):
    from teamrl.cli import main

    Trainer(_cfg(tmp_path)).train()
    assert main(["eval", "--checkpoint", str(tmp_path / "wf"), "task.split=test", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    for method in ("team", "untrained", "single"):
        assert f"| {method} |" in out, out
