"""No update from noise (issue 55): a policy whose samples carry no information takes no optimizer step.

The case an audit saw: under ``policy.mode=lora_per_role`` one role's completions were identical in every group, the
groups varied only through the other role, so that role's advantages over identical (prompt, completion) sequences
sum to zero and its true gradient is 0; Adam normalised the float rounding left over into a full-size step.
"""

from __future__ import annotations

import copy

import pytest
import torch

from teamrl.core.config import load_config
from teamrl.core.sample import Sample
from teamrl.losses import group_advantages
from teamrl.trainer.learner import LearnBatch, LocalLearner, make_router
from teamrl.trainer.learner_setup import make_learner
from teamrl.trainer.step_metrics import learner_metrics
from teamrl.trainer.update import make_update_params
from tests.test_rollout_pool import local_ray  # noqa: F401  (two Ray nodes of 2 CPUs, this process connected)

ROLES = ["planner", "coder"]
COMMON = ["model=tiny-random", "threads=1", "policy.mode=lora_per_role", "policy.lora.r=4", "train.lr=1e-2"]
# two groups of four episodes (team rewards), as GRPO normalises them
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.3, 0.9, 0.1, 0.5]]


def _advantages() -> list[float]:
    rewards = torch.tensor([r for group in REWARDS for r in group])
    ids = torch.tensor([g for g, group in enumerate(REWARDS) for _ in group])
    return group_advantages(rewards, ids, "group", eps=1e-4).tolist()


def _episodes(tok, planner_varies: bool, step: int) -> dict[str, list[Sample]]:
    """Each role's samples of the two groups: the coder's completions always differ; the planner's differ only when
    ``planner_varies`` (else each group's four are identical, so only the coder made the rewards differ)."""
    adv = _advantages()
    out: dict[str, list[Sample]] = {r: [] for r in ROLES}
    for i, a in enumerate(adv):
        group = i // 4
        for role in ROLES:
            prompt = [256, 40 + group, 41 + ROLES.index(role)]
            varies = role == "coder" or planner_varies
            seed = i if varies else 100 * group  # identical completions: one seed for the whole group
            ids = torch.randint(70, 120, (4 + seed % 3,), generator=torch.Generator().manual_seed(seed + 7 * step))
            completion = [int(x) for x in ids] + [tok.eos_token_id]
            out[role].append(Sample(role=role, policy=role, problem_id=group, prompt_ids=prompt,
                                    completion_ids=completion, sampling_logprobs=[-4.0] * len(completion),
                                    advantage=a, episode=i, group=group))
    return out


def _batch(cfg, tok, planner_varies: bool, step: int) -> LearnBatch:
    samples = _episodes(tok, planner_varies, step)
    return LearnBatch({r: [samples[r]] for r in ROLES}, make_update_params(cfg, ROLES), tok.pad_token_id,
                      (tok.eos_token_id,))


def _optimizer_state(learner: LocalLearner, name: str) -> dict:
    return copy.deepcopy(learner.state(name)[1]["state"])


def _same(a, b) -> bool:
    """Bitwise equal: tensors by ``torch.equal``, containers item by item."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _learner(*extra: str) -> tuple[LocalLearner, object, object]:
    cfg = load_config(None, [*COMMON, *extra])
    router = make_router(cfg, ROLES)
    return LocalLearner(router), cfg, router.tokenizer


def test_a_role_whose_identical_completions_cancel_takes_no_step_and_the_other_role_does():
    learner, cfg, tok = _learner()
    learner.update(_batch(cfg, tok, planner_varies=True, step=0))  # a real step for both: Adam has moments now
    weights = {r: learner.weights(r) for r in ROLES}
    moments = {r: _optimizer_state(learner, r) for r in ROLES}
    versions = {r: learner.version(r) for r in ROLES}
    assert all(moments[r] for r in ROLES)
    batch = _batch(cfg, tok, planner_varies=False, step=1)
    steps = learner.update(batch)
    # the planner: bitwise unchanged weights and optimizer state, and the metric says why
    assert _same(learner.weights("planner"), weights["planner"])
    assert _same(_optimizer_state(learner, "planner"), moments["planner"])
    assert learner.version("planner") == versions["planner"]
    assert steps["planner"][0]["skipped_no_signal"] == 1.0 and steps["planner"][0]["skipped_steps"] == 1.0
    # the coder (the same groups, the same advantages): a normal step
    assert not _same(learner.weights("coder"), weights["coder"])
    assert not _same(_optimizer_state(learner, "coder"), moments["coder"])
    assert learner.version("coder") == versions["coder"] + 1
    assert steps["coder"][0]["skipped_no_signal"] == 0.0 and steps["coder"][0]["grad_norm"] > 1e-3
    record, _ = learner_metrics(steps, batch.parts)
    assert record["skipped_no_signal/planner"] == 1 and record["optimizer_steps/planner"] == 0
    assert record["skipped_no_signal/coder"] == 0 and record["optimizer_steps/coder"] == 1


def test_a_normal_step_is_not_skipped():
    learner, cfg, tok = _learner()
    before = {r: learner.weights(r) for r in ROLES}
    steps = learner.update(_batch(cfg, tok, planner_varies=True, step=0))
    for r in ROLES:
        assert steps[r][0]["skipped_no_signal"] == 0.0 and steps[r][0]["skipped_steps"] == 0.0, r
        assert steps[r][0]["grad_norm"] > 1e-3 and not _same(learner.weights(r), before[r]), r


def test_cancelling_advantages_with_a_kl_term_are_caught_by_the_gradient_norm():
    """With a KL term the advantages alone do not decide (its gradient need not be 0); on the first step the policy is
    its reference (LoRA's B starts at 0), so the KL's gradient is 0 too and what is left is float rounding: the norm
    (below ``train.noise_grad_norm``) skips the step."""
    learner, cfg, tok = _learner("train.loss.kl_coef=0.1")
    weights, moments = learner.weights("planner"), _optimizer_state(learner, "planner")
    steps = learner.update(_batch(cfg, tok, planner_varies=False, step=1))
    st = steps["planner"][0]
    print(f"planner's gradient norm at the reference with cancelling advantages: {st['grad_norm']:.3e}")
    assert st["skipped_no_signal"] == 1.0 and st["grad_norm"] <= cfg.train.noise_grad_norm
    assert _same(learner.weights("planner"), weights) and _same(_optimizer_state(learner, "planner"), moments)
    assert steps["coder"][0]["skipped_no_signal"] == 0.0 and steps["coder"][0]["grad_norm"] > 1e3 * cfg.train.noise_grad_norm


@pytest.mark.parametrize("threshold, skipped", [("1e9", True), ("0", False)])
def test_the_noise_threshold_is_a_config_key(threshold, skipped):
    """``train.noise_grad_norm`` decides by the gradient's norm: above every norm it skips a real step (weights and
    optimizer state untouched, the norm still logged); 0 never skips one."""
    learner, cfg, tok = _learner(f"train.noise_grad_norm={threshold}")
    before = learner.weights("coder")
    st = learner.update(_batch(cfg, tok, planner_varies=True, step=0))["coder"][0]
    assert st["skipped_no_signal"] == float(skipped) and st["grad_norm"] > 1e-3
    assert _same(learner.weights("coder"), before) == skipped
    assert (learner.state("coder")[1]["state"] == {}) == skipped


@pytest.mark.ray
def test_two_ranks_skip_as_one_rank_does_when_no_rank_alone_sees_the_advantages_cancel(local_ray):  # noqa: F811
    """The sharded learner (``policy.ranks``) decides on every rank's samples: each identical set is split so that
    neither rank's share of it sums to 0, yet both ranks skip the planner's step, as one process does."""
    pytest.importorskip("ray")
    extra = ["policy.placement=ray", "policy.workers={base: [planner, coder]}", "policy.ranks={base: 2}",
             "policy.ray_timeout_s=180", "policy.collective_timeout_s=180",
             "train.lr=0.0001"]  # as test_sharded_learner: Adam's first steps at 1e-2 magnify reduction-order differences
    cfg = load_config(None, [*COMMON, *extra])
    router = make_router(cfg, ROLES)
    sharded = make_learner(cfg, router, ROLES, separate=False)  # takes the router's initial weights
    local, tok = LocalLearner(router), router.tokenizer
    try:
        assert type(sharded).__name__ == "ShardedLearner"
        # rank 0 gets the first half: group 0's samples 0 and 3, group 1's 0 and 1; rank 1 the others
        order = [0, 3, 4, 5, 1, 2, 6, 7]
        for step, varies in ((0, True), (1, False)):
            batch = _batch(cfg, tok, planner_varies=varies, step=step)
            batch.parts = {r: [[p[0][i] for i in order]] for r, p in batch.parts.items()}
            if not varies:  # no rank's share of a group (its identical samples) sums to 0
                planner = batch.parts["planner"][0]
                for share in (planner[:4], planner[4:]):
                    assert all(abs(sum(s.advantage for s in share if s.group == g)) > 0.1 for g in (0, 1))
                before = {r: sharded.state(r) for r in ROLES}
            one, two = local.update(batch), sharded.update(batch)
        assert two["planner"][0]["skipped_no_signal"] == one["planner"][0]["skipped_no_signal"] == 1.0
        assert two["coder"][0]["skipped_no_signal"] == one["coder"][0]["skipped_no_signal"] == 0.0
        after = {r: sharded.state(r) for r in ROLES}
        assert _same(after["planner"][0], before["planner"][0]) and _same(after["planner"][1], before["planner"][1])
        assert not _same(after["coder"][0], before["coder"][0])
        for r in ROLES:  # 2 ranks took the steps 1 rank took
            got, want = sharded.weights(r), local.weights(r)
            assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-5, r
    finally:
        sharded.shutdown()


# --- the sampling temperature in the episode rows ------------------------------------------------------------------
TINY_RUN = ["model=tiny-random", "threads=1", "rollout.max_new_tokens=4", "run.progress=false",
            "run.tensorboard=false"]


def test_each_training_episode_row_records_the_temperature_it_was_sampled_at(tmp_path):
    """``episodes/step_*.jsonl``: the rollout's samples at ``rollout.temperature``, ReMax's greedy baselines at 0."""
    import json

    from teamrl.trainer.trainer import Trainer

    cfg = load_config(None, [*TINY_RUN, "task.name=word_count", "rollout.temperature=0.7", "rollout.batch_size=1",
                             "rollout.group_size=2", "train.advantage=max", "train.steps=1", f"run.dir={tmp_path}",
                             "name=t", "run.log_episodes=true"])
    trainer = Trainer(cfg)
    try:
        trainer.train_step()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "t" / "episodes" / "step_000001.jsonl").read_text().splitlines()]
    assert sorted({(r["baseline"], r["temperature"]) for r in rows}) == [(False, 0.7), (True, 0.0)]


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_each_evaluated_call_records_the_temperature_it_was_sampled_at(temperature):
    """``teamrl eval``'s ``<method>.jsonl``: every call's ``temperature`` (``--temperature``; 0: greedy)."""
    from teamrl.trainer.evaluate import evaluate

    cfg = load_config(None, [*TINY_RUN, "task.name=word_count"])
    (row,) = evaluate(cfg, ["untrained"], limit=2, temperature=temperature, progress=False)
    calls = [c for e in row.episodes for c in e["calls"]]
    assert calls and all(c["temperature"] == temperature for c in calls)
