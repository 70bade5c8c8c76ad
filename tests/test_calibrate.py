"""``teamrl calibrate`` (issue 55): why a run has no learning signal, and which settings give it one."""

from __future__ import annotations

import json
import math
from pathlib import Path

from teamrl.api import register_reward
from teamrl.cli import main
from teamrl.trainer.calibrate import Calibration, SettingResult, advice, setting_figures

TINY = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=6", "rollout.group_size=3", "run.progress=false",
        "policy.lora.r=4"]

PLUGIN = '''
from teamrl.api import register_workflow


@register_workflow("calibrate_test_pair", roles=("writer", "checker", "idle"), formats={"checker": lambda t: "e" in t})
async def pair(ctx, task, problem, settings):
    draft = await ctx.generate("writer", f"Write about {problem.id}")
    verdict = await ctx.generate("checker", f"Check: {draft}")
    ctx.reward(float(len(verdict) % 2), role="checker")  # the checker's own reward
    return float(len(draft) % 3) / 2  # the team's return; "idle" never acts
'''


@register_reward("calibrate_test_zero")  # every call scores 0: no group can vary
def _zero(sample, outcome):
    return 0.0


def _run(capsys, *args: str) -> tuple[int, str, str]:
    try:
        rc = main(["calibrate", *args])
    except SystemExit as e:  # argparse's one-line error
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _by_hand(episodes: list[dict], role: str | None) -> dict:
    """The figures of one table row recomputed from the saved episodes (``role`` None: the team row)."""
    calls = [(e, c) for e in episodes for c in e["calls"] if role is None or c["role"] == role]
    rewards = [c["reward"] for _, c in calls]
    mean = sum(rewards) / len(rewards)
    groups: dict = {}
    for e, c in calls:
        groups.setdefault((e["problem_id"], c["role"], c["turn"]), set()).add(c["reward"])
    judged = [c["valid"] for _, c in calls if c["valid"] is not None]
    return {"reward_mean": mean, "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
            "groups": len(groups), "groups_varied": sum(len(g) > 1 for g in groups.values()),
            "calls_per_episode": len(calls) / len(episodes),
            "truncated": sum(c["finish_reason"] == "length" for _, c in calls) / len(calls),
            "completion_tokens": sum(c["completion_tokens"] for _, c in calls) / len(calls),
            "valid": sum(judged) / len(judged) if judged else None}


def test_a_plugin_team_table_equals_the_figures_computed_by_hand_from_its_saved_episodes(capsys, tmp_path):
    plugin = tmp_path / "pair_plugin.py"
    plugin.write_text(PLUGIN)
    out_dir = tmp_path / "cal"
    rc, out, err = _run(capsys, *TINY, f"run.dir={tmp_path}", "workflow.name=calibrate_test_pair",
                        "workflow.reward=per_role", "--plugin", str(plugin), "--problems", "2", "--out", str(out_dir))
    assert rc == 0, err
    results = json.loads((out_dir / "calibration.json").read_text())
    # the run's temperature and a higher one x its max_new_tokens and twice that
    assert [s["label"] for s in results["settings"]] == [
        "as configured", "rollout.max_new_tokens=12", "rollout.temperature=1.2",
        "rollout.temperature=1.2 rollout.max_new_tokens=12"]
    for s in results["settings"]:
        episodes = [json.loads(line) for line in (out_dir / s["episodes_file"]).read_text().splitlines()]
        assert len(episodes) == 2 * 3 and {e["episode"] for e in episodes} == {0, 1, 2}
        for row, role in (("team", None), ("writer", "writer"), ("checker", "checker")):
            figures = s["figures"] if role is None else s["figures"]["roles"][role]
            hand = _by_hand(episodes, role)
            for key, value in hand.items():
                assert value is None if figures[key] is None else math.isclose(figures[key], value, abs_tol=1e-12), (
                    s["label"], row, key, figures[key], value)
            line = next(x for x in out.splitlines() if x.startswith(f"| {s['label']} (G=3) | {row} |"))
            assert f"| {hand['reward_mean']:.3f} +/- {hand['reward_std']:.3f} |" in line, line
            assert f"| {hand['groups_varied']} of {hand['groups']} (" in line, line
            assert f"| {hand['calls_per_episode']:.2f} |" in line and f"{100 * hand['truncated']:.0f}% |" in line, line
        # the checker's own reward is its training reward (per_role); the writer's is the episode's return
        assert all(c["reward"] == c["own_reward"] for e in episodes for c in e["calls"] if c["role"] == "checker")
        assert all(c["reward"] == e["team_return"] for e in episodes for c in e["calls"] if c["role"] == "writer")
        assert s["figures"]["roles"]["checker"]["valid"] is not None  # judged by the workflow's format
        assert s["figures"]["roles"]["idle"]["calls_per_episode"] == 0 and s["figures"]["silent_roles"] == ["idle"]
    # the role that never acts is named, with the figure it follows from
    assert "role idle never acted: 0 calls in 24 episodes" in out
    assert results["advice"] == [line[2:] for line in out.splitlines() if line.startswith("- ")]


def test_an_all_zero_reward_says_the_task_is_too_hard(capsys, tmp_path):
    rc, out, err = _run(capsys, *TINY, f"run.dir={tmp_path}", "name=zero", "workflow.reward=calibrate_test_zero",
                        "--problems", "2", "--set", "rollout.temperature=1.0", "--group-size", "2")
    assert rc == 0, err
    assert "0 of 4 groups varied at 2 settings: every reward 0 -> the task is too hard for this model" in out
    (written,) = (tmp_path / "zero" / "calibrate").iterdir()  # run.dir/<name>/calibrate/<timestamp>
    data = json.loads((written / "calibration.json").read_text())
    assert all(s["figures"]["groups_varied"] == 0 and s["figures"]["reward_mean"] == 0 for s in data["settings"])
    assert sorted(p.name for p in written.iterdir()) == ["calibration.json", "setting0.jsonl", "setting1.jsonl"]


def _result(label: str, varied: int, groups: int = 4, truncated: float = 0.0, valid: float | None = None,
            rewards: tuple[float, ...] = (0.0, 1.0), reward_of=None) -> SettingResult:
    """A setting with ``groups`` groups of 2 calls, ``varied`` of them rewarded ``rewards``, the rest alike
    (``reward_of(group, k)``: each call's reward instead)."""
    episodes = []
    for g in range(groups):
        for k in range(2):
            reward = reward_of(g, k) if reward_of else rewards[k] if g < varied else rewards[0]
            call = {"role": "agent", "turn": 0, "reward": reward, "valid": valid, "completion_tokens": 4,
                    "finish_reason": "length" if k < 2 * truncated else "stop"}
            episodes.append({"problem_id": f"p{g}", "score": reward, "correct": None, "calls": [call], "episode": k})
    changes = tuple(label.split()) if label != "as configured" else ()
    return SettingResult(changes, changes, 2, setting_figures(episodes, ["agent"]), episodes)


def test_advice_names_the_figure_it_follows_from():
    only_hot = Calibration([_result("as configured", 0), _result("rollout.temperature=1.2", 3)], ("agent",), problems=4)
    lines = advice(only_hot)
    assert lines[0] == ("0 of 4 groups varied as configured; groups vary only at rollout.temperature=1.2 (3 of 4) -> "
                        "set rollout.temperature=1.2")
    cut = Calibration([_result("as configured", 2, truncated=0.5, valid=False)], ("agent",), problems=4)
    text = "\n".join(advice(cut))
    assert "50% of replies cut at max_new_tokens (as configured)" in text
    assert "format validity 0% (as configured) -> a warm start of the format" in text
    easy = Calibration([_result("as configured", 0, rewards=(1.0, 1.0))], ("agent",), problems=4)
    assert "every reward 1 (the task's maximum) -> the task is too easy" in advice(easy)[0]
    fine = Calibration([_result("as configured", 2)], ("agent",), problems=4)
    assert advice(fine) == ["2 of 4 groups varied (50%) as configured: the rewards give a learning signal"]
    rare = Calibration([_result("as configured", 1, groups=8)], ("agent",), problems=8)
    assert ("1 of 16 episodes scored 1.000 (the best) -> a warm start from the team's own successes: teamrl sft "
            "--self-play 8 --min-reward 1") in "\n".join(advice(rare))


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    run = tmp_path / "never_trained"  # a run folder with its config but no checkpoint
    run.mkdir()
    (run / "config.yaml").write_text("model: tiny-random\n")
    cases = [
        (["--set", "model=smollm2-135m"], "'model' cannot be swept; calibration sweeps keys under task., rollout., "),
        (["--set", "rollout.temperature"], "expected KEY=V1,V2,..."),
        (["--set", "rollout.temperature=-1"], "rollout.temperature"),
        (["--level", "task.min_size"], "expected space-separated KEY=VALUE overrides"),
        (["--checkpoint", str(run)], "holds neither checkpoints/step_N"),
        (["--problems", "0"], "out of range"),
    ]
    for args, says in cases:
        rc, out, err = _run(capsys, *TINY, f"run.dir={tmp_path}", *args)
        assert rc == 2, (args, out, err)
        assert len(err.strip().splitlines()) == 1 and says in err, (args, err)


def test_train_without_signal_points_to_calibrate(capsys, tmp_path):
    rc = main(["train", *TINY, "rollout.batch_size=2", "run.tensorboard=false", "run.log_episodes=false",
               "train.steps=1", f"run.dir={tmp_path}", "name=flat", "workflow.reward=calibrate_test_zero"])
    out = capsys.readouterr().out
    assert rc == 0 and "no learning signal: 0 of 2 groups varied" in out, out
    assert f"why, and what to change: teamrl calibrate --checkpoint {Path(tmp_path) / 'flat'}" in out
    # that command runs: the run's own config and its last checkpoint, written beside the run
    rc, out, err = _run(capsys, "--checkpoint", str(tmp_path / "flat"), "--problems", "1", "--set",
                        "rollout.max_new_tokens=4", "run.progress=false")
    assert rc == 0, err
    (written,) = (tmp_path / "flat" / "calibrate").iterdir()
    assert json.loads((written / "calibration.json").read_text())["checkpoint"] == str(tmp_path / "flat")


def test_a_gateway_team_s_calls_are_counted_and_saved(capsys, tmp_path):
    """examples/openai_team.py: a team written against the OpenAI API; its calls reach the gateway, not ctx.events."""
    root = Path(__file__).resolve().parents[1]
    rc, out, err = _run(capsys, str(root / "examples" / "openai_team.yaml"), "--plugin",
                        str(root / "examples" / "openai_team.py"), *TINY, f"run.dir={tmp_path}", "--problems", "1",
                        "--group-size", "2", "--set", "rollout.temperature=1.0", "--set", "rollout.max_new_tokens=6",
                        "--out", str(tmp_path / "cal"))
    assert rc == 0, err
    episodes = [json.loads(line) for line in (tmp_path / "cal" / "setting0.jsonl").read_text().splitlines()]
    for e in episodes:  # every call the episode function made, with its training reward (per_role)
        assert [c["role"] for c in e["calls"]] == ["solver", "reviewer"], e["calls"]
        assert e["calls"][1]["reward"] == e["team_return"]
    figures = json.loads((tmp_path / "cal" / "calibration.json").read_text())["settings"][0]["figures"]
    assert figures["roles"]["solver"]["calls_per_episode"] == 1 and figures["silent_roles"] == []


def _spread(label: str, low: float, truncated: float) -> SettingResult:
    """4 groups of 2 calls rewarded on a continuous scale (word_count's), every group varied, each best unique."""
    return _result(label, 4, truncated=truncated, reward_of=lambda g, k: low + 0.1 * g + 0.4 * k)


def test_a_continuous_reward_whose_groups_vary_is_called_a_signal_and_gets_no_self_play_advice():
    """Seen on SmolLM2 with grpo_word_count: every group varied (2 of 2) and calibrate still advised a warm start
    from the team's own successes (the best score, as any best of a continuous reward, was rare), and raising
    max_new_tokens, which lowered the reward (0.479 -> 0.375). Now: a signal line first, no self-play, and the
    truncation advice says what the longer setting did to the reward."""
    cal = Calibration([_spread("as configured", 0.2, truncated=0.5),
                       _spread("rollout.max_new_tokens=128", 0.0, truncated=0.0)], ("agent",), problems=4)
    lines = advice(cal)
    text = "\n".join(lines)
    assert lines[0] == "4 of 4 groups varied (100%) as configured: the rewards give a learning signal", lines
    assert "self-play" not in text, text
    assert ("50% of replies cut at max_new_tokens (as configured) (rollout.max_new_tokens=128: 0%, reward mean "
            "0.550 -> 0.350) -> the longer replies scored lower: ask for shorter replies (the prompt, a task option) "
            "rather than raise rollout.max_new_tokens") in text, text


def test_a_task_with_its_own_demonstrations_is_pointed_at_them():
    """Seen on SmolLM2: the six AT-GRPO configs and grpo_reverse_text all scored 0 in every group, and the advice named
    warm starts in general; each of those tasks has its own demonstrations, so the first step is one command."""
    zero = [_result("as configured", 0, rewards=(0.0, 0.0))]
    plain = advice(Calibration(zero, ("agent",), problems=4))[0]
    own = advice(Calibration(zero, ("agent",), problems=4, task_demonstrations=True))[0]
    assert "task's own demonstrations" not in plain and "every reward 0" in plain
    assert ("every reward 0 -> the task is too hard for this model untrained: a warm start from the task's own "
            "demonstrations first (teamrl sft CONFIG, then teamrl train CONFIG --resume)") in own, own
