"""A warm-started run compares RL with its warm start, not only with the base weights (issue 55 item 1):
``teamrl sft`` -> ``teamrl train --resume`` keeps the warm start's weights and says what it gains, ``teamrl eval``
compares any two checkpoints, ``teamrl report`` shows the warm start, and held-out evaluation during training
measures the warm start once and keeps the best checkpoint."""

import json

import pytest
import torch


def _args(tmp_path, name="ws", *extra):
    return [f"name={name}", f"run.dir={tmp_path}", "model=tiny-random", "threads=1", "task.name=math.solve",
            "task.source=generated_easy", "task.num_problems=12", "task.test_size=3", "workflow.name=single",
            "rollout.group_size=2", "rollout.batch_size=1", "rollout.max_new_tokens=4", "run.progress=false",
            "run.tensorboard=false", "policy.lora.r=4", "train.lr=1e-2", *extra]


def _lines(out: str, start: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(start)]


def test_sft_then_train_names_the_warm_start_in_every_comparison(tmp_path, capsys):
    """The end-of-run eval, ``teamrl eval --checkpoint RUN`` and ``teamrl report`` each give
    "team - warm start" (RL's own effect) and "warm start - untrained" (the warm start's), paired over the
    same problems; the warm start's weights outlive the rotation of ``checkpoints/``."""
    from teamrl.cli import main

    assert main(["sft", *_args(tmp_path), "--problems", "2", "--epochs", "1"]) == 0
    capsys.readouterr()
    warm = tmp_path / "ws" / "warm_start" / "step_000000"
    saved = torch.load(warm / "policy_shared.pt")  # kept apart from checkpoints/, which RL rotates
    info = json.loads((tmp_path / "ws" / "warm_start.json").read_text())
    assert info["checkpoint"] == "warm_start/step_000000" and info["step"] == 0 and info["demonstrations"] == 2, info
    assert main(["train", *_args(tmp_path, "ws", "train.steps=3", "run.save_every=1", "train.final_eval_problems=2"),
                 "--resume"]) == 0
    out = capsys.readouterr().out
    assert [p.name for p in sorted((tmp_path / "ws" / "checkpoints").iterdir())] == ["step_000002", "step_000003"]
    kept = torch.load(warm / "policy_shared.pt")
    assert all(torch.equal(kept[k], v) for k, v in saved.items())
    assert "warm start: RL resumed from" in out and str(warm) in out, out
    for text in (out,):
        (rl,) = _lines(text, "team - warm start (RL's own effect): ")
        (ws,) = _lines(text, "warm start - untrained (the warm start's effect): ")
        assert "paired over the same 2 problems" in rl and "paired over the same 2 problems" in ws
    assert "| warm_start |" in out

    assert main(["eval", "--checkpoint", str(tmp_path / "ws"), "--limit", "2"]) == 0
    evaluated = capsys.readouterr().out
    assert len(_lines(evaluated, "team - warm start (RL's own effect): ")) == 1, evaluated
    assert len(_lines(evaluated, "warm start - untrained (the warm start's effect): ")) == 1
    results = sorted((tmp_path / "ws" / "eval").glob("*/results.json"), key=lambda p: p.stat().st_mtime)[-1]
    data = json.loads(results.read_text())
    pairs = [(c["trained"], c["untrained"]) for c in data["comparisons"]]
    assert pairs[:2] == [("team", "warm_start"), ("warm_start", "untrained")] and ("team", "untrained") in pairs
    team, warm_row = data["methods"]["team"]["scores"], data["methods"]["warm_start"]["scores"]
    first = data["comparisons"][0]
    assert first["difference"] == pytest.approx(sum(a - b for a, b in zip(team, warm_row)) / len(team))

    assert main(["report", str(tmp_path / "ws")]) == 0
    capsys.readouterr()
    md = (tmp_path / "ws" / "report" / "report.md").read_text()
    assert "Warm start: RL resumed from warm_start/step_000000" in md and "2 demonstrations" in md, md
    assert "team - warm start (RL's own effect): " in md and "warm start - untrained (the warm start's effect): " in md
    page = (tmp_path / "ws" / "report" / "index.html").read_text()
    assert 'id="warm-start"' in page and "team - warm start (RL&#x27;s own effect)" in page
