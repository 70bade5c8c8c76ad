"""Every key means the same under every algorithm (issue 35 item 5): workflow.reward, the early role of AT-GRPO,
MAGRPO's normalised return, ``turn``, a workflow's stats during training, and eval's held-out notice."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from teamrl.algorithms import ATGRPO, GRPO, MAGRPO, ATGRPOConfig, MAGRPOConfig
from teamrl.core.config import ConfigError, load_config
from teamrl.tasks.task import Problem, Task
from teamrl.trainer.evaluate import EvalRow, format_table, training_problems_note
from teamrl.trainer.trainer import Trainer
from teamrl.workflows import EpisodeOutcome, Workflow
from tests.scripted import scripted_rollout

REF = "tests.test_every_key:"
PROBLEMS = [Problem("p0"), Problem("p1")]


async def plan_code(ctx, task, problem, settings):
    """A planner, then a coder who sees the plan; only the outcome rewards (right when the plan was 'good' and the
    code 'ok'); the workflow's own statistics in ``stats``. The coder passes turn=2 (the workflow's own numbering),
    the planner none (its call position, 0)."""
    plan = await ctx.generate("planner", f"{problem.id} plan")
    code = await ctx.generate("coder", f"{problem.id} code for {plan}", turn=2)
    return EpisodeOutcome(code, code, plan == "good" and code == "ok", stats={"plan_words": len(plan.split()),
                                                                            "good_plan": plan == "good"})


PLAN_CODE = Workflow(plan_code, ("planner", "coder"))


def _script(policy: str, prompt: str, n: int) -> list[str]:
    return (["bad", "good"] if policy == "planner" else ["ok", "oops"])[:n]


def half_reward(sample, outcome) -> float:
    """A user's reward: 0.5 for every sample, 1 for the coder of a correct episode."""
    return 1.0 if (outcome.correct and sample.role == "coder") else 0.5


# ---- workflow.reward --------------------------------------------------------------------------------------------

def test_a_custom_reward_is_applied_by_grpo():
    samples = scripted_rollout(GRPO(2, workflow=REF + "PLAN_CODE", reward=REF + "half_reward"), PROBLEMS, None,
                               lambda policy, prompt, n: ["good" if policy == "planner" else "ok"] * n)
    assert {(s.role, s.reward) for s in samples} == {("planner", 0.5), ("coder", 1.0)}


@pytest.mark.parametrize("algorithm", ["magrpo", "at_grpo", "m_grpo"])
@pytest.mark.parametrize("reward", ["per_role", REF + "half_reward"])
def test_a_reward_an_algorithm_does_not_apply_is_refused_in_one_line(algorithm, reward):
    """Before: magrpo, at_grpo and m_grpo ignored workflow.reward silently (the same custom reward gave ~0.5 under
    grpo and 0.0 under the others)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"algorithm={algorithm}", f"workflow.name={REF}PLAN_CODE", f"workflow.reward={reward}"])
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"workflow.reward: {reward!r} is not applied by algorithm "
                                                      f"{algorithm} (it ")
    assert "workflow.reward=outcome" in message and "algorithm=grpo" in message
    assert load_config(None, [f"algorithm={algorithm}", "workflow.reward=outcome"]).workflow.reward == "outcome"


def test_the_cli_refuses_it_before_any_model_loads(tmp_path, capsys):
    from teamrl.cli import main

    rc = main(["train", "algorithm=magrpo", "workflow.reward=per_role", "model=no-such-model", f"run.dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("teamrl: config error: workflow.reward: 'per_role' is not applied by algorithm magrpo (it credits")
    assert not any(tmp_path.iterdir())


# ---- AT-GRPO: a role that gets no reward in its segment ----------------------------------------------------------

def test_at_grpo_plays_an_early_roles_candidates_out_to_credit_the_outcome():
    """The planner gets no reward before the coder acts: each candidate's episode is played to its end (one untrained
    sample per later call) and scored with its team return. Before: both planner candidates scored 0 (no gradient)."""
    samples = scripted_rollout(ATGRPO(ATGRPOConfig(alpha=1.0), workflow=REF + "PLAN_CODE", k=2), PROBLEMS[:1], None, _script)
    planner = sorted((s for s in samples if s.role == "planner"), key=lambda s: s.branch)
    assert [s.text for s in planner] == ["bad", "good"]
    assert [s.reward for s in planner] == [0.0, 1.0] and planner[1].tags.get("chosen")
    assert all(s.tags["scored_at"] == "episode_end" for s in planner)
    played = [s for s in samples if s.tags.get("rollout")]
    assert [(s.role, s.trainable) for s in played] == [("coder", False)] * 2  # one coder per planner candidate
    coder = sorted((s for s in samples if s.role == "coder" and s.trainable), key=lambda s: s.branch)
    assert all("code for good" in s.prompt_text for s in coder)  # the episode goes on from the chosen plan
    assert [s.reward for s in coder] == [1.0, 0.0] and "scored_at" not in coder[0].tags  # the outcome is in its segment


# ---- MAGRPO's normalised return ----------------------------------------------------------------------------------

def test_magrpo_normalised_return_is_the_team_return_the_workflow_reported():
    """Before: normalised_return was the first role's own segment reward (0.0 here, the outcome arrives later)."""
    algo = MAGRPO(MAGRPOConfig(), workflow=REF + "PLAN_CODE", group_size=2)
    samples = scripted_rollout(algo, PROBLEMS, None, _script)
    # per problem: (bad, ok) (bad, oops) (good, ok) (good, oops): one correct episode of four
    assert algo.metrics(samples) == {"normalised_return": 0.25, "normalised_return_last_turn": 0.25}
    assert sorted(s.reward for s in samples if s.role == "planner" and s.problem_id == "p0") == [0.0, 0.5]


# ---- turn ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("algo", [GRPO(2, workflow=REF + "PLAN_CODE"),
                                  MAGRPO(MAGRPOConfig(num_turns=2), REF + "PLAN_CODE", group_size=2),
                                  ATGRPO(ATGRPOConfig(), REF + "PLAN_CODE", k=2)], ids=["grpo", "magrpo", "at_grpo"])
def test_turn_is_the_calls_turn_under_every_algorithm(algo):
    """The planner's turn is its call position (0), the coder's the turn=2 the workflow gave; MAGRPO's level in its
    tree is tags['depth'] (before: MAGRPO wrote the depth into turn: the coder's was 1)."""
    samples = scripted_rollout(algo, PROBLEMS, None, _script)
    assert {(s.role, s.turn) for s in samples} == {("planner", 0), ("coder", 2)}


# ---- training: stats, the summary, the episode logs --------------------------------------------------------------

async def steady(ctx, task, problem, settings):
    """Two roles, a team reward of 0.6 reported at the end whatever they say, and the workflow's stats."""
    a = await ctx.generate("a", "Say something.")
    await ctx.generate("b", f"Reply to: {a}")
    ctx.reward(0.6)
    return EpisodeOutcome("", None, False, stats={"rounds": 2, "agreed": True, "note": "text is not averaged"},
                          team_reward=0.0)


STEADY = Workflow(steady, ("a", "b"))


@pytest.mark.parametrize("algorithm", ["grpo", "magrpo", "at_grpo"])
def test_training_logs_the_workflows_stats_and_the_reported_rewards(tmp_path, algorithm):
    """Before: the stats reached teamrl eval only, and magrpo logged normalised_return 0.0 next to reward_mean 0.6."""
    cfg = load_config(None, ["model=tiny-random", "threads=1", f"algorithm={algorithm}", "task.name=word_count",
                             f"workflow.name={REF}STEADY", "rollout.group_size=2", "rollout.batch_size=1",
                             "rollout.max_new_tokens=3", "policy.lora.r=2", "run.progress=false", "run.tensorboard=false",
                             f"run.dir={tmp_path}", "train.steps=1"])
    tr = Trainer(cfg)
    rec = tr.train_step()
    assert rec["rounds"] == 2.0 and rec["agreed"] == 1.0 and rec["accuracy"] == 0.0 and "note" not in rec
    if algorithm == "magrpo":
        assert rec["normalised_return"] == pytest.approx(0.6) and rec["reward_mean"] == pytest.approx(0.6)
    outcomes = [json.loads(line) for line in (tr.run_dir / "episodes" / "outcomes_000001.jsonl").read_text().splitlines()]
    expected = {"grpo": 2, "magrpo": 4, "at_grpo": 1}[algorithm]  # G episodes; G x G leaves; the chosen episode
    assert len(outcomes) == expected
    assert all(o["stats"] == {"rounds": 2, "agreed": True, "note": "text is not averaged"} and o["team_return"] == 0.6
               for o in outcomes)
    logged = [json.loads(line) for line in (tr.run_dir / "episodes" / "step_000001.jsonl").read_text().splitlines()]
    assert {(r["role"], r["turn"]) for r in logged} == {("a", 0), ("b", 0)}


# ---- eval: problems that are not held out --------------------------------------------------------------------------

@dataclass
class FixedSetOptions:
    name: str = "fixed_set"


class FixedSet(Task):
    """A task with neither a split nor a seed: it holds no problem out (every shipped task now has one or the other)."""

    name = "fixed_set"
    Options = FixedSetOptions

    def __init__(self, opts: FixedSetOptions | None = None) -> None:
        self.opts = opts or FixedSetOptions()

    def problems(self) -> list[Problem]:
        return PROBLEMS

    def prompt(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": problem.id}]

    def reward(self, problem: Problem, text: str) -> float:
        return 0.0


def test_eval_says_when_it_scores_the_training_problems(tmp_path):
    """Before: teamrl eval on a task without a held-out split scored the training problems without a word."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"task:\n  name: {REF}FixedSet\n")
    cfg = load_config(None, [f"task.name={REF}FixedSet"])
    note = training_problems_note(cfg, run)
    assert note == "no held-out split: scored on the training problems (the task holds none out)"
    (run / "config.yaml").write_text("task:\n  name: word_count\n  seed: 0\n")
    assert training_problems_note(load_config(None, ["task.name=word_count"]), run) == (
        "not held out: scored on the training problems (task.seed=0, as in training)")
    assert training_problems_note(load_config(None, ["task.name=word_count", "task.seed=1"]), run) == ""
    assert training_problems_note(cfg, None) == ""  # the base model: no training problems to speak of
    row = EvalRow("team", 0.5, 0.1, 2, 10.0, 1.0, note=note)
    assert format_table([row]).splitlines()[0] == note
