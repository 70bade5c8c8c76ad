"""The KL term after a warm start pulls toward the warm start (``train.loss.kl_reference``), not toward the base
model whose behaviour the warm start replaced; a LoRA's reference is its adapter's saved weights, swapped in to
compute and swapped back (the policy's own weights are unchanged by computing the reference)."""

import json

import pytest
import torch

from teamrl.core.config import ConfigError, load_config
from teamrl.tasks import make_task
from teamrl.trainer.sft import Demonstration, warm_start
from teamrl.trainer.trainer import Trainer


def _cfg(tmp_path, *extra):
    return load_config(None, ["name=klref", f"run.dir={tmp_path}", "model=tiny-random", "threads=1",
                              "task.name=word_count", "task.num_problems=12",
                              "rollout.group_size=2", "rollout.batch_size=2", "rollout.max_new_tokens=4",
                              "train.steps=1", "run.progress=false", "run.tensorboard=false", "policy.lora.r=4",
                              "train.lr=1e-2", "train.loss.kl_coef=0.5", *extra])


def _first_kl(run_dir):
    rec = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {k: v for k, v in rec.items() if k.startswith("kl/")}


def _warm_started(tmp_path, *extra):
    cfg = _cfg(tmp_path, *extra)
    task = make_task(cfg.task)
    demos = [Demonstration("agent", task.prompt(p), "one two three") for p in task.problems()[:4]]
    run_dir, _ = warm_start(cfg, demos, epochs=4, batch_size=4, progress=False)
    return cfg, run_dir


@pytest.mark.parametrize("reference", ["auto", "warm_start"])
def test_after_a_warm_start_the_first_steps_kl_is_zero_because_the_reference_is_the_warm_start(tmp_path, reference):
    cfg, run_dir = _warm_started(tmp_path, f"train.loss.kl_reference={reference}")
    trainer = Trainer(cfg, resume=True)
    assert trainer.kl_reference == "warm start"
    trainer.train()
    kls = _first_kl(run_dir)
    # step 1 updates the warm start itself (one PPO epoch): policy == reference, so k3 = 0 exactly
    assert kls and all(v == 0.0 for v in kls.values()), kls


def test_the_base_reference_sees_how_far_the_warm_start_moved(tmp_path):
    cfg, run_dir = _warm_started(tmp_path, "train.loss.kl_reference=base")
    trainer = Trainer(cfg, resume=True)
    assert trainer.kl_reference == "base"
    trainer.train()
    kls = _first_kl(run_dir)
    assert kls and all(v > 1e-4 for v in kls.values()), kls


def test_computing_the_warm_start_reference_leaves_the_policys_weights_as_they_were(tmp_path):
    cfg, run_dir = _warm_started(tmp_path)
    trainer = Trainer(cfg, resume=True)
    policy = trainer.router.policies["shared"]
    reference = {k: v.clone() for k, v in policy.named_state().items()}
    with torch.no_grad():  # move the policy away from its reference, as training does
        for p in policy.parameters():
            p.add_(0.01)
    moved = {k: v.clone() for k, v in policy.named_state().items()}
    ids = torch.tensor([[5, 6, 7, 8]])
    with policy.reference() as model:
        inside = {k: v.clone() for k, v in policy.named_state().items()}
        ref_logits = model(input_ids=ids).logits
    assert all(torch.equal(inside[k], reference[k]) for k in reference)  # the warm start while computing ...
    assert all(torch.equal(v, moved[k]) for k, v in policy.named_state().items())  # ... the policy's own after
    with policy.active() as model:
        assert not torch.equal(model(input_ids=ids).logits, ref_logits)


def test_a_warm_start_reference_without_a_warm_start_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no warm start.*teamrl sft"):
        Trainer(_cfg(tmp_path, "train.loss.kl_reference=warm_start"))


def test_auto_without_a_warm_start_is_the_base(tmp_path):
    assert Trainer(_cfg(tmp_path)).kl_reference == "base"


def test_rl_after_a_warm_start_at_a_rate_that_undid_warm_starts_says_so(tmp_path, capsys):
    cfg, run_dir = _warm_started(tmp_path, "train.lr=5e-4")
    Trainer(cfg, resume=True)
    err = capsys.readouterr().err
    assert "warning: train.lr=0.0005 after a warm start" in err and "train.lr=0.0002" in err
    cfg2, _ = _warm_started(tmp_path / "ok", "train.lr=1e-4")
    Trainer(cfg2, resume=True)
    assert "after a warm start" not in capsys.readouterr().err


def test_by_default_a_run_that_began_from_a_warm_start_pulls_toward_it_and_a_run_from_the_base_does_not(tmp_path):
    from teamrl.core.config import WARM_START_KL_COEF

    cfg, run_dir = _warm_started(tmp_path, "train.loss.kl_coef=null")
    trainer = Trainer(cfg, resume=True)
    assert cfg.train.loss.kl_coef == WARM_START_KL_COEF and trainer.kl_reference == "warm start"
    assert trainer.update_params.loss.kl_coef == WARM_START_KL_COEF
    trainer.train()
    assert _first_kl(run_dir) == {"kl/shared": 0.0}  # measured (a KL term ran), and 0 on the warm start itself
    base = _cfg(tmp_path / "base", "train.loss.kl_coef=null")
    fresh = Trainer(base)
    assert base.train.loss.kl_coef == 0.0 and fresh.kl_reference == "none"
    # an explicit weight is kept, and a base reference takes no default weight
    cfg2, _ = _warm_started(tmp_path / "b", "train.loss.kl_coef=null", "train.loss.kl_reference=base")
    assert Trainer(cfg2, resume=True).kl_reference == "none" and cfg2.train.loss.kl_coef == 0.0
