import subprocess
import sys

import pytest

from teamrl.core.config import ConfigError, load_config
from teamrl.tasks import TASKS
from teamrl.trainer.evaluate import evaluate, format_table
from teamrl.trainer.report import write_report
from teamrl.trainer.trainer import Trainer
from tests.test_magrpo import ToyTeam


@pytest.fixture
def toy_cfg(monkeypatch, tmp_path):
    monkeypatch.setitem(TASKS, "toy_team", ToyTeam)
    return load_config(None, ["model=tiny-random", "threads=1", "algorithm=magrpo", "task.name=toy_team", "name=ev",
                              "rollout.max_new_tokens=8", "rollout.batch_size=2", "rollout.group_size=3", "train.steps=2",
                              "run.progress=false", "policy.mode=lora_per_role", "policy.lora.r=4", "train.lr=5e-2",
                              f"run.dir={tmp_path}"])


def test_eval_rows_for_team_and_every_baseline(toy_cfg, tmp_path):
    Trainer(toy_cfg).train()
    ToyTeam.single_prompt = lambda self, p: [{"role": "user", "content": "both parts"}]
    ToyTeam.split_single = lambda self, text: {"short": text[:10], "long": text[10:]}
    rows = evaluate(toy_cfg, ["team", "single", "concat", "sequential", "discussion"], checkpoint=tmp_path / "ev", limit=3, progress=False)
    assert [r.method for r in rows] == ["team", "single", "concat", "sequential", "discussion"]
    for r in rows:
        assert 0 <= r.mean <= 1 and r.problems == 3 and r.tokens_per_s > 0 and r.seconds_per_problem > 0
    table = format_table(rows)
    # the toy task holds no problems out: the table says it scored the training problems, then the 5 rows
    assert table.splitlines()[:2] == ["no held-out split: scored on the training problems (the task holds none out)", ""]
    assert table.count("\n") == 8 and "| discussion |" in table


def test_eval_team_needs_a_checkpoint_and_methods_are_checked(toy_cfg):
    with pytest.raises(ConfigError, match="--checkpoint"):
        evaluate(toy_cfg, ["team"], progress=False)
    with pytest.raises(ConfigError, match="concat"):
        evaluate(toy_cfg, ["vote"], progress=False)


def test_baseline_workflows_see_what_they_should(toy_cfg):
    from teamrl.policies.models import load_model
    from teamrl.rollout.engine import SamplingParams
    from teamrl.rollout.hf_engine import HFEngine
    from teamrl.rollout.scheduler import GenerationScheduler
    from teamrl.workflows.context import EpisodeContext
    from teamrl.workflows.team_baselines import discussion, sequential
    import contextlib

    model, tok = load_model("tiny-random")
    eng = HFEngine(lambda p: contextlib.nullcontext(model), tok)
    task = ToyTeam()
    p = task.problems()[0]
    for wf, calls in ((sequential, 2), (discussion, 4)):
        sched = GenerationScheduler(eng)
        ctx = EpisodeContext(sched, lambda r: "base", tok, SamplingParams(max_new_tokens=5), p.id, 0)
        out = sched.run([wf(ctx, task, p)])[0]
        assert set(out) == {"short", "long"} and len(ctx.samples) == calls
        if wf is sequential:  # the second role saw the first one's output
            assert ctx.samples[0].text in ctx.samples[1].prompt_text and "teammate (short)" in ctx.samples[1].prompt_text
        else:  # revisions saw both drafts
            assert all("Your draft" in s.prompt_text for s in ctx.samples[2:])


def test_report_writes_plots_and_page(toy_cfg, tmp_path):
    Trainer(toy_cfg).train()
    page = write_report(tmp_path / "ev").parent / "report.md"  # it returns index.html (tests/test_report_html.py)
    text = page.read_text()
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    assert {"reward.png", "reward_per_agent.png", "loss.png", "grad_norm.png", "response_length.png", "kl.png"} <= set(pngs)
    for name in pngs:
        assert f"]({name})" in text
        assert (page.parent / name).read_bytes()[:4] == b"\x89PNG"
    assert "normalised_return" in text
    r = subprocess.run([sys.executable, "-m", "teamrl.cli", "report", str(tmp_path / "nope")], capture_output=True, text=True)
    assert r.returncode == 2 and "metrics.jsonl" in r.stderr


def _stats_run(run_dir, workflow: str):
    """A run folder with three steps of a workflow's statistics (orch/*, critic/*) and its config."""
    import json

    import yaml

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"workflow": {"name": workflow}}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": i, "reward_mean": 0.1 * i, "orch/subtasks_mean": 1.0 + i, "critic/agree": 0.5}) + "\n" for i in (1, 2, 3)))
    return run_dir


def test_a_users_workflow_stats_are_charted_without_a_shipped_title(tmp_path):
    """orch/* of a user's workflow was drawn under the Orch-Workers title, critic/* had no PNG chart."""
    page = write_report(_stats_run(tmp_path / "mine", "my_orchestrator")).parent
    md, html = (page / "report.md").read_text(), (page / "index.html").read_text()
    assert "Orch-Workers" not in md and "Orch-Workers" not in html
    for family in ("orch/*", "critic/*"):
        assert f"## {family}" in md, md  # a PNG chart each, titled by the prefix
        assert f"<figcaption>{family}</figcaption><svg" in html
    assert sum(f"]({p.name})" in md for p in page.glob("*.png")) == len(list(page.glob("*.png"))) >= 3

    shipped = write_report(_stats_run(tmp_path / "theirs", "orch_workers")).parent  # the shipped workflow keeps its title
    assert "## Orch-Workers: subtasks per plan, over-limit rate" in (shipped / "report.md").read_text()


def test_tensorboard_events_are_written(toy_cfg, tmp_path):
    Trainer(toy_cfg).train()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "ev" / "tensorboard"))
    acc.Reload()
    assert "normalised_return" in acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("normalised_return")] == [1, 2]


def test_wandb_without_the_package_fails_before_any_model_loads(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        load_config(None, ["run.wandb=true"])
