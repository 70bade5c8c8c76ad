"""Warm starts from the team's own successes (``teamrl sft --self-play`` / ``--from-episodes``): only episodes
that reach the reward threshold are trained, each role's policy on its own calls, on exactly the token ids the
calls recorded; a scripted player writes the replies where rewards must be controlled."""

import json
from dataclasses import dataclass

import pytest
import torch

from teamrl.core.config import load_config
from teamrl.policies.chat import render_chat
from teamrl.tasks import make_task
from teamrl.trainer.self_play import KeepRound, from_episodes, round_seed, sample_episodes, self_play, train_round
from teamrl.trainer.sft import sft_router
from teamrl.workflows import WORKFLOWS, register_workflow

GOOD = {"writer": "good", "checker": "ok"}


@dataclass
class PairOptions:
    always_check: bool = False  # the checker acts in every episode (else only after a bad draft)


@pytest.fixture
def pair_workflow(monkeypatch):
    """``selfsft_pair``: the writer drafts (reward 1 for "good"); the checker acts after a bad draft, or always."""
    monkeypatch.setattr(WORKFLOWS, "_items", dict(WORKFLOWS._items))  # the library's registry stays as it was

    @register_workflow("selfsft_pair", roles=("writer", "checker"), options=PairOptions)
    async def pair(ctx, task, problem, settings):
        draft = await ctx.generate("writer", [{"role": "user", "content": f"write for {problem.id}"}])
        if settings.always_check or draft != "good":
            verdict = await ctx.generate("checker", [{"role": "user", "content": f"check {draft}"}])
            return float(draft == "good" and verdict == "ok")
        return 1.0


def _cfg(tmp_path, name="sp", *extra):
    return load_config(None, [f"name={name}", f"run.dir={tmp_path}", "model=tiny-random", "threads=1",
                              "task.name=math.solve", "task.source=generated_easy", "task.num_problems=12",
                              "task.test_size=3", "rollout.group_size=2", "rollout.batch_size=2",
                              "rollout.max_new_tokens=4", "train.steps=1", "run.progress=false",
                              "run.tensorboard=false", "policy.lora.r=4", "train.lr=1e-2", *extra])


def _pair_cfg(tmp_path, *extra):
    return _cfg(tmp_path, "pair", "workflow.name=selfsft_pair", "policy.mode=lora_per_role", *extra)


def _player_for(good_problems):
    def player(role, messages):
        if role == "writer":
            return "good" if messages[0]["content"].removeprefix("write for ") in good_problems else "bad"
        return "ok"
    return player


@pytest.mark.parametrize("always_check", [False, True])
def test_only_episodes_reaching_r_train_each_role_on_its_own_calls(tmp_path, pair_workflow, always_check):
    cfg = _pair_cfg(tmp_path, f"workflow.options.always_check={str(always_check).lower()}")
    router0, _ = sft_router(cfg)
    tok = router0.tokenizer
    ids = [p.id for p in make_task(cfg.task).problems()[:4]]
    good = {str(ids[0]), str(ids[2])}
    run_dir, (keep,) = self_play(cfg, 2, problems=4, min_reward=1.0, player=_player_for(good), epochs=2,
                                 progress=False)

    assert len(keep.episodes) == 8 and {e.reward for e in keep.episodes} == {0.0, 1.0}
    assert sorted(str(e.problem_id) for e in keep.kept) == sorted([*good, *good])  # 2 episodes of each good problem

    def rows(role, content):  # the call as ctx.generate renders it, and the reply's tokens + EOS
        prompt = tok(render_chat(tok, [{"role": "user", "content": content}]), add_special_tokens=False)["input_ids"]
        return (prompt, tok(GOOD[role], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])

    writer = sorted(rows("writer", f"write for {e.problem_id}") for e in keep.kept)
    assert sorted(keep.trained["writer"]) == writer
    state = torch.load(run_dir / "checkpoints" / "step_000000" / "trainer_state.pt", weights_only=False)
    saved = {n: torch.load(run_dir / "checkpoints" / "step_000000" / f"policy_{n}.pt") for n in GOOD}
    before = {n: router0.policies[n].named_state() for n in GOOD}
    assert all(saved[n] and saved[n].keys() == before[n].keys() for n in GOOD)
    moved = {n: any(not torch.equal(v, before[n][k]) for k, v in saved[n].items()) for n in GOOD}
    assert state["warm_start"] and state["trained_on"]["kept"] == 4 and state["trained_on"]["episodes"] == 8
    assert state["trained_on"]["min_reward"] == 1.0 and state["trained_on"]["temperature"] == 1.0
    if always_check:  # the checker's own kept calls, and nothing else, trained the checker's adapter
        assert sorted(keep.trained["checker"]) == [rows("checker", "check good")] * 4
        assert state["trained_on"]["calls_kept"] == {"writer": 4, "checker": 4}
        assert moved["writer"] and moved["checker"]
    else:  # the checker never acted in a kept episode: its adapter does not move, the writer's does
        assert "checker" not in keep.trained and state["trained_on"]["calls_kept"] == {"writer": 4}
        assert moved["writer"] and not moved["checker"]


def test_nothing_reaching_r_is_one_line_naming_the_best_reward(tmp_path, pair_workflow, capsys):
    from teamrl.cli import main

    player = tmp_path / "bad_player.py"
    player.write_text("def play(role, messages):\n    return 'bad' if role == 'writer' else 'ok'\n")
    args = ["name=pair", f"run.dir={tmp_path}", "model=tiny-random", "threads=1", "task.name=math.solve",
            "task.source=generated_easy", "task.num_problems=6", "task.test_size=2", "workflow.name=selfsft_pair",
            "policy.lora.r=4", "run.progress=false", "run.tensorboard=false"]
    assert main(["sft", "--self-play", "2", "--problems", "2", "--player", f"{player}:play", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "none of the 4 episodes sampled reached --min-reward 1" in err and "best normalised reward seen 0.000" in err
    assert "--player" in err and not (tmp_path / "pair" / "checkpoints").exists()
    assert main(["sft", "--self-play", "2", "--player", f"{player}:absent", *args]) == 2
    assert "defines no 'absent'" in capsys.readouterr().err


def test_rounds_2_samples_from_the_weights_round_1_trained(tmp_path):
    cfg = _cfg(tmp_path, "rounds", "workflow.name=single")
    run_dir, rounds = self_play(cfg, 2, problems=2, min_reward=0.0, rounds=2, epochs=3, progress=False)
    assert [len(r.episodes) for r in rounds] == [4, 4]

    def seen(episodes):
        return [(s.text, s.sampling_logprobs) for e in episodes for s in e.samples]

    def sample(router, k):
        task = make_task(cfg.task)
        return sample_episodes(cfg, router, task, task.problems()[:2], 2, 1.0, round_seed(cfg, k, 0),
                               first_episode=(k - 1) * 2)

    router, roles = sft_router(cfg)  # the same steps again, in this process: round 1, its training, round 2
    first = sample(router, 1)
    assert seen(first) == seen(rounds[0].episodes)
    train_round(cfg, router, roles, KeepRound(1, first, 0.0), 3, 8, False, 0)
    assert seen(sample(router, 2)) == seen(rounds[1].episodes)  # round 2 sampled the weights round 1 trained ...
    untrained, _ = sft_router(cfg)
    assert seen(sample(untrained, 2)) != seen(rounds[1].episodes)  # ... which sample differently from the base's


def test_from_episodes_of_a_runs_logs_trains_on_the_logged_token_ids(tmp_path, capsys):
    from teamrl.cli import main
    from teamrl.trainer.trainer import Trainer

    Trainer(_cfg(tmp_path, "source", "workflow.name=single")).train()
    logged = [json.loads(line) for line in (tmp_path / "source" / "episodes" / "step_000001.jsonl").open()]
    assert logged and all("prompt_ids" in r and "completion_ids" in r for r in logged)
    run_dir, keep, found = from_episodes(_cfg(tmp_path, "warm", "workflow.name=single"), tmp_path / "source",
                                         min_reward=0.0, epochs=1, progress=False)
    trained = [(r["prompt_ids"], r["completion_ids"]) for r in logged if r["trainable"] and not r["baseline"]]
    assert sorted(keep.trained["shared"]) == sorted(trained) and found.retokenised == 0
    assert (run_dir / "checkpoints" / "step_000000").is_dir()

    # logs without ids: the prompt is re-tokenised from its recorded rendering, the very ids ctx.generate had
    for r in logged:
        del r["prompt_ids"], r["completion_ids"]
    old = tmp_path / "old" / "episodes"
    old.mkdir(parents=True)
    (old / "step_000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
    (old / "outcomes_000001.jsonl").write_text((tmp_path / "source" / "episodes" / "outcomes_000001.jsonl").read_text())
    _, again, found = from_episodes(_cfg(tmp_path, "warm_old", "workflow.name=single"), tmp_path / "old",
                                    min_reward=0.0, epochs=1, progress=False)
    assert found.retokenised == len(trained)
    assert sorted(p for p, _ in again.trained["shared"]) == sorted(p for p, _ in trained)

    # every logged episode of the tiny random model scored 0: nothing reaches 1.0, in one line, exit 2
    assert main(["sft", "--from-episodes", str(tmp_path / "source"), "name=warm2", f"run.dir={tmp_path}",
                 "model=tiny-random", "task.name=math.solve", "task.source=generated_easy", "task.num_problems=12",
                 "task.test_size=3", "workflow.name=single", "run.progress=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "reached --min-reward 1" in err and "best normalised reward seen" in err


def test_from_episodes_of_an_eval_output_keeps_the_runs_workflow(tmp_path, pair_workflow):
    from teamrl.trainer.evaluate import evaluate, write_results

    cfg = _pair_cfg(tmp_path)
    rows = evaluate(cfg, ["untrained"], limit=2, progress=False)
    out = write_results(rows, tmp_path / "eval", cfg, ["teamrl", "eval"])
    records = [json.loads(line) for line in (out / "untrained.jsonl").open()]
    for r in records:  # score them by hand: what the run's reward threshold then reads
        r["score"] = 1.0 if r is records[0] else 0.0
    (out / "untrained.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "other.jsonl").write_text(json.dumps({**records[1], "workflow": "single", "score": 1.0}) + "\n")
    _, keep, found = from_episodes(_pair_cfg(tmp_path, "name=pair2"), out, min_reward=1.0, epochs=1, progress=False)
    assert found.skipped == {"workflow 'single', not the run's": 1} and len(keep.kept) == 1
    by_role = {}  # the untrained team's calls went to the base model: each trains its role's own adapter
    for c in records[0]["calls"]:
        by_role.setdefault(c["role"], []).append((c["prompt_ids"], c["completion_ids"]))
    assert keep.trained == by_role and set(by_role) == {"writer", "checker"}


def test_a_player_answers_only_its_roles(tmp_path, pair_workflow):
    cfg = _pair_cfg(tmp_path)
    router, _ = sft_router(cfg)
    task = make_task(cfg.task)
    episodes = sample_episodes(cfg, router, task, task.problems()[:2], 1, 1.0, 0, player=lambda r, m: "bad",
                               player_roles=["writer"])
    for e in episodes:
        by_role = {s.role: s for s in e.samples}
        assert by_role["writer"].text == "bad" and by_role["writer"].tags.get("player")
        assert "player" not in by_role["checker"].tags  # the model answered the checker


def test_a_player_is_given_a_list_of_messages_when_the_workflow_passed_a_string(tmp_path, monkeypatch):
    """Seen writing examples/coder_critic_player.py: the coder + critic workflow calls ctx.generate(role, "text"), and
    the player was handed the bare string, so ``messages[-1]["content"]`` (the docs' own example reads
    ``messages[0]["content"]``) raised TypeError. A player now always gets ``[{"role": "user", "content": ...}]``."""
    monkeypatch.setattr(WORKFLOWS, "_items", dict(WORKFLOWS._items))

    @register_workflow("selfsft_plain", roles=("writer",))
    async def plain(ctx, task, problem, settings):
        return float(await ctx.generate("writer", f"write for {problem.id}") == "good")

    seen = []

    def player(role, messages):
        seen.append(messages)
        return "good"

    cfg = _cfg(tmp_path, "plain", "workflow.name=selfsft_plain")
    router, _ = sft_router(cfg)
    task = make_task(cfg.task)
    problem = task.problems()[0]
    (episode,) = sample_episodes(cfg, router, task, [problem], 1, 1.0, 0, player=player)
    assert seen == [[{"role": "user", "content": f"write for {problem.id}"}]] and episode.reward == 1.0
