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


def _episodes(results_dir, method):
    return [json.loads(line) for line in (results_dir / f"{method}.jsonl").read_text().splitlines()]


def test_eval_compares_any_two_checkpoints_paired_over_the_same_problems(tmp_path, capsys):
    """``--baseline`` (a run directory or a checkpoint folder) is one more row on its own weights and one line
    ``team - baseline``: given the run's warm start it is the warm_start row again, given the evaluated
    checkpoint itself a difference of exactly 0; a missing or incompatible one is refused in one line."""
    import shutil

    from teamrl.cli import main

    assert main(["sft", *_args(tmp_path), "--problems", "2", "--epochs", "8", "--batch-size", "6"]) == 0
    assert main(["train", *_args(tmp_path, "ws", "train.steps=1"), "--resume"]) == 0
    capsys.readouterr()
    run = tmp_path / "ws"
    out_a = tmp_path / "a"
    assert main(["eval", "--checkpoint", str(run), "--baseline", str(run / "warm_start" / "step_000000"),
                 "--limit", "2", "--out", str(out_a)]) == 0
    printed = capsys.readouterr().out
    (line,) = _lines(printed, "team - baseline (weights of ")
    assert str(run / "warm_start" / "step_000000") in line and "paired over the same 2 problems" in line
    results = json.loads((out_a / "results.json").read_text())
    by = {(c["trained"], c["untrained"]): c for c in results["comparisons"]}
    assert results["methods"]["baseline"]["scores"] == results["methods"]["warm_start"]["scores"]
    assert by[("team", "baseline")]["difference"] == by[("team", "warm_start")]["difference"]
    assert ([c["completion"] for e in _episodes(out_a, "baseline") for c in e["calls"]]
            == [c["completion"] for e in _episodes(out_a, "warm_start") for c in e["calls"]])
    assert (results["methods"]["warm_start"]["weights"], results["methods"]["team"]["weights"]) == (
        str(run / "warm_start" / "step_000000"), str(run / "checkpoints" / "step_000001"))

    out_b = tmp_path / "b"  # a checkpoint folder as --checkpoint, its run as --baseline: the same weights
    assert main(["eval", "--checkpoint", str(run / "checkpoints" / "step_000001"), "--baseline", str(run),
                 "--method", "team", "--limit", "2", "--out", str(out_b)]) == 0
    capsys.readouterr()
    results = json.loads((out_b / "results.json").read_text())
    assert list(results["methods"]) == ["team", "baseline"] and results["checkpoint_step"] == 1
    ((pair, diff, se),) = [((c["trained"], c["untrained"]), c["difference"], c["stderr"]) for c in results["comparisons"]]
    assert pair == ("team", "baseline") and (diff, se) == (0.0, 0.0)
    assert _episodes(out_b, "team")[0]["calls"][0]["completion"] == _episodes(out_b, "baseline")[0]["calls"][0]["completion"]

    assert main(["eval", "--checkpoint", str(run), "--baseline", str(tmp_path / "absent"), "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--baseline {tmp_path / 'absent'}: does not exist" in err, err
    other = tmp_path / "r8"  # the same checkpoints, but its config says LoRA rank 8
    shutil.copytree(run, other)
    (other / "config.yaml").write_text((other / "config.yaml").read_text().replace("r: 4", "r: 8"))
    assert main(["eval", "--checkpoint", str(run), "--baseline", str(other), "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--baseline" in err and "policy.lora.r=8" in err and "with 4" in err, err


def test_warm_start_method_needs_a_warm_started_run(tmp_path, capsys):
    from teamrl.cli import main

    assert main(["train", *_args(tmp_path, "cold", "train.steps=1")]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "cold"), "--method", "team,warm_start", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--method warm_start: run" in err and "has no warm start" in err, err
    assert not (tmp_path / "cold" / "warm_start").exists()


@pytest.mark.parametrize("warm", [True, False], ids=["warm_start", "no_warm_start"])
def test_held_out_evaluation_measures_the_warm_start_and_keeps_the_best(tmp_path, capsys, monkeypatch, warm):
    """With ``train.eval_every``: the warm start is scored once (step 0); falling under it is said in one line
    when it happens; the best checkpoint by held-out accuracy, the warm start included, stays in ``best/`` and
    the end of the run names it. Without a warm start nothing of this is added. The accuracies are scripted
    (``evaluate_accuracy``): what is under test is the trainer's reading of them."""
    from teamrl.cli import main
    from teamrl.trainer.trainer import Trainer

    scripted = iter([0.5, 0.25, 0.0, 0.375])  # steps 0..3: under the warm start from step 1, never above it
    monkeypatch.setattr(Trainer, "evaluate_accuracy", lambda self: {"eval/accuracy": next(scripted)})
    if warm:
        assert main(["sft", *_args(tmp_path), "--problems", "1", "--epochs", "1"]) == 0
    capsys.readouterr()
    assert main(["train", *_args(tmp_path, "ws", "train.steps=3", "train.eval_every=1", "train.eval_problems=2"),
                 *(["--resume"] if warm else [])]) == 0
    captured = capsys.readouterr()
    run = tmp_path / "ws"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/accuracy"], r.get("eval/under_warm_start")) for r in records if "eval/accuracy" in r]
    under = [line for line in captured.err.splitlines() if "under the warm start's" in line]
    best = sorted(p.name for p in (run / "best").iterdir()) if (run / "best").exists() else []
    if not warm:
        assert evals == [(0, 0.5, None), (1, 0.25, None), (2, 0.0, None), (3, 0.375, None)]
        assert not under and best == [] and "best checkpoint" not in captured.out
        assert "warm start:" not in captured.out and "first (the warm start)" not in captured.out
        return
    assert evals == [(0, 0.5, None), (1, 0.25, 1), (2, 0.0, 1), (3, 0.375, 1)]
    (line,) = under  # said when it happens, once while it stays under
    assert "0.250 at step 1" in line and "warm start's 0.500" in line and "lost 0.250" in line
    assert best == ["step_000000"]
    kept = torch.load(run / "best" / "step_000000" / "policy_shared.pt")
    warm_weights = torch.load(run / "warm_start" / "step_000000" / "policy_shared.pt")
    assert all(torch.equal(kept[k], v) for k, v in warm_weights.items())
    (named,) = _lines(captured.out, "best checkpoint by held-out accuracy: ")
    assert "the warm start (step 0), accuracy 0.500" in named and str(run / "best" / "step_000000") in named
    assert "held-out accuracy: first (the warm start) 0.500" in captured.out
