"""The sharded learner (``policy.ranks``): 2 ranks take the step 1 rank takes, checkpoints move between rank counts,
and a rank that dies or hangs fails the run in one line with nothing left running."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from teamrl.core.config import ConfigError, load_config
from teamrl.core.sample import Sample
from teamrl.losses import LossConfig
from teamrl.losses.policy_loss import AGGREGATIONS
from teamrl.trainer.learner import LearnBatch, LocalLearner, WorkerFailed, make_router
from teamrl.trainer.learner_setup import make_learner
from teamrl.trainer.update import UpdateParams
from tests.test_placement import _alive
from tests.test_rollout_pool import local_ray  # noqa: F401  (two Ray nodes of 2 CPUs, this process connected)
from tests.test_vllm_server import wait_until

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

COMMON = ["model=tiny-random", "threads=1", "policy.lora.r=4", "train.lr=0.0001", "policy.placement=ray",
          "policy.ray_timeout_s=60", "policy.collective_timeout_s=60"]
# name -> (the team's roles, the overrides); every worker on 2 ranks
SETUPS = {
    "grpo_lora": (["agent", "critic"], ["policy.ranks={shared: 2}"]),
    # with a KL term: a reference copy of the model, not sharded
    "grpo_full": (["agent", "critic"], ["policy.lora=null", "policy.ranks={shared: 2}", "train.loss.kl_coef=0.05"]),
    # MAGRPO: two adapters on one base, one worker of 2 ranks
    "magrpo": (["short", "long"], ["policy.mode=lora_per_role", "policy.workers={base: [short, long]}",
                                   "policy.ranks={base: 2}"]),
    # M-GRPO's two agents as two separate models, both on one worker of 2 ranks
    "mgrpo_separate": (["main", "sub"], ["policy.mode=separate", "policy.workers={base: [main, sub]}",
                                         "policy.ranks={base: 2}", "policy.activation_checkpointing=true"]),
}
TOL = 1e-5


def _pair(setup: str, *extra: str):
    """(1-rank learner, 2-rank learner, tokenizer), both starting from the same weights."""
    roles, overrides = SETUPS[setup]
    cfg = load_config(None, [*COMMON, *overrides, *extra])
    router = make_router(cfg, roles)
    sharded = make_learner(cfg, router, roles, separate=False)  # takes the router's initial weights
    assert type(sharded).__name__ == "ShardedLearner"
    return LocalLearner(router), sharded, router.tokenizer


def _samples(policy: str, roles: list[str], step: int, tok, n: int = 8, long_tail: bool = False) -> list[Sample]:
    """``n`` samples of ``policy``: prompt groups of 3 (shared prompts), lengths and advantages that vary (some 0),
    finite sampling log-probs; ``long_tail``: the second half much longer (ranks get different token counts)."""
    g = torch.Generator().manual_seed(1000 * step + len(policy))
    # advantage 0: one sample; MAGRPO's "long" also the one sample of rank 0's share of its second step (it computes
    # nothing while rank 1 does); "short" every sample of step 1 (the optimizer steps on a zero gradient)
    zero = (lambda i: i in (2, 5)) if policy == "long" else (lambda i: True) if (policy, step) == ("short", 1) \
        else (lambda i: i == 2)
    out = []
    for i in range(n):
        length = (12 if long_tail and i >= n // 2 else 1) + int(torch.randint(0, 6, (1,), generator=g))
        completion = [int(x) for x in torch.randint(70, 120, (length,), generator=g)] + [tok.eos_token_id]
        out.append(Sample(role=roles[i % len(roles)], policy=policy, problem_id=i // 3,
                          # M-GRPO's: each prompt its own (passes without a KV cache: activation checkpointing)
                          prompt_ids=[256, 60 + i // 3, 61 + (i // 3) % 2] + ([90 + i] if policy in ("main", "sub") else []),
                          completion_ids=completion,
                          sampling_logprobs=[-4.0 + 0.1 * float(torch.randn(1, generator=g)) for _ in completion],
                          advantage=0.0 if zero(i) else float(torch.randn(1, generator=g))))
    return out


def _batch(setup: str, step: int, tok, loss: LossConfig, **kw) -> LearnBatch:
    roles = SETUPS[setup][0]
    policies = ["shared"] if setup.startswith("grpo") else roles
    long_tail, parts = kw.pop("long_tail", False), {}
    for p in policies:
        samples = _samples(p, roles if p == "shared" else [p], step, tok, long_tail=long_tail)
        # two steps of one policy (old log-probs computed first); one sample alone (rank 0 gets none)
        parts[p] = [samples[:5], samples[5:]] if p == "long" else [samples[:1]] if p == "sub" else [samples]
    params = UpdateParams(loss=loss, micro_batch_size=kw.pop("micro_batch_size", 2), max_grad_norm=0.5,
                          role_grad_norms=True, **kw)
    return LearnBatch(parts, params, tok.pad_token_id, (tok.eos_token_id,))


def _differences(a: dict[str, list[dict]], b: dict[str, list[dict]], wa, wb) -> dict[str, float]:
    """The largest differences between two learners' step statistics (gradient norms relative) and weights."""
    out = {"loss": 0.0, "grad_norm": 0.0, "stats": 0.0, "weights": 0.0}
    for name in a:
        assert len(a[name]) == len(b[name]) and a[name], name
        for sa, sb in zip(a[name], b[name]):
            assert sorted(sa) == sorted(sb), (name, sorted(sa), sorted(sb))
            for k, v in sa.items():
                d = abs(v - sb[k])
                if k.startswith("grad_norm"):
                    out["grad_norm"] = max(out["grad_norm"], d / max(1.0, abs(v)))
                else:
                    out["loss" if k.startswith("loss") else "stats"] = max(
                        out["loss" if k.startswith("loss") else "stats"], d / max(1.0, abs(v)))
    for name in wa:
        out["weights"] = max(out["weights"], *(float((wa[name][k] - wb[name][k]).abs().max()) for k in wa[name]))
    return out


def _steps(learners, setup, tok, loss, steps=range(3), **kw):
    """Each learner's statistics over ``steps``, with its weights after them."""
    stats = [{} for _ in learners]
    for step in steps:
        batch = _batch(setup, step, tok, loss, **kw)
        for s, learner in zip(stats, learners):
            for name, st in learner.update(batch).items():
                s.setdefault(name, []).extend(st)
    return stats, [{n: learner.weights(n) for n in learner.policy_names()} for learner in learners]


def _check(diffs: dict[str, float], what: str) -> None:
    print(f"{what}: 2 vs 1 rank, max differences {', '.join(f'{k} {v:.2e}' for k, v in diffs.items())}")
    assert all(v <= TOL for v in diffs.values()), (what, diffs)


@pytest.fixture(scope="module")
def lora_pair(local_ray):  # noqa: F811
    local, sharded, tok = _pair("grpo_lora")
    initial = {n: local.state(n) for n in local.policy_names()}
    initial = {n: ({k: v.clone() for k, v in w.items()}, o) for n, (w, o) in initial.items()}

    def reset(*learners):
        for learner in learners:
            for n, (w, o) in initial.items():
                learner.load_state(n, w, o)

    try:
        yield local, sharded, tok, reset
    finally:
        sharded.shutdown()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_ranks_equal_one_for_every_aggregation(lora_pair, aggregation):
    local, sharded, tok, reset = lora_pair
    reset(local, sharded)
    loss = LossConfig(aggregation=aggregation, max_completion_length=24, importance_correction="token")
    (a, b), (wa, wb) = _steps([local, sharded], "grpo_lora", tok, loss)
    assert a["shared"][-1]["is_weight_count"] > 0 and a["shared"][-1]["grad_norm@agent"] > 0
    _check(_differences(a, b, wa, wb), f"grpo_lora {aggregation}")


@pytest.mark.parametrize("setup", ["grpo_full", "magrpo", "mgrpo_separate"])
def test_two_ranks_equal_one(local_ray, setup):  # noqa: F811
    local, sharded, tok = _pair(setup)
    try:
        initial = {n: local.weights(n) for n in local.policy_names()}
        initial = {n: {k: v.clone() for k, v in w.items()} for n, w in initial.items()}
        ranks = sharded.ranks["base" if setup != "grpo_full" else "shared"]
        ray.get([r.__ray_call__.remote(_count_checkpoints) for r in ranks])
        # MAGRPO: 2 PPO epochs (old log-probs computed first) and a KL term (the base with the adapter off)
        loss = LossConfig(aggregation="seq_mean_token_mean", kl_coef=0.0 if setup == "mgrpo_separate" else 0.05)
        (a, b), (wa, wb) = _steps([local, sharded], setup, tok, loss, ppo_epochs=2 if setup == "magrpo" else 1)
        for n in wa:  # the weights moved: the comparison is not vacuous
            assert any(not torch.equal(initial[n][k], v) for k, v in wa[n].items()), n
        recomputed = ray.get([r.__ray_call__.remote(_count_checkpoints) for r in ranks])
        assert (min(recomputed) > 0) == (setup == "mgrpo_separate"), recomputed  # activation_checkpointing there
        _check(_differences(a, b, wa, wb), setup)
    finally:
        sharded.shutdown()


def _count_checkpoints(rank_actor) -> int:
    """In a rank's process: count the checkpointed layer passes from now on; returns the count so far."""
    import torch.utils.checkpoint as ckpt

    if not hasattr(ckpt, "_counted"):
        ckpt._counted, ckpt._calls, orig = ckpt.checkpoint, [0], ckpt.checkpoint

        def counted(*args, **kwargs):
            ckpt._calls[0] += 1
            return orig(*args, **kwargs)

        ckpt.checkpoint = counted
    return ckpt._calls[0]


def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank(lora_pair):
    local, sharded, tok, reset = lora_pair
    reset(local, sharded)
    batch = _batch("grpo_lora", 0, tok, LossConfig())
    batch.parts["shared"][0][-1].advantage = float("nan")  # in rank 1's share only
    before = sharded.weights("shared")
    a, b = local.update(batch), sharded.update(batch)
    print(f"non-finite on rank 1: 1 rank {a}, 2 ranks {b}")
    assert a == b and b["shared"][0]["skipped_steps"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in sharded.weights("shared").items())


def _rank_normaliser(rank_actor):
    """In a rank's process: the normalisers of its own samples only (what the global one prevents)."""
    import teamrl.trainer.update as update

    orig = update._plan_update

    def per_rank(samples, settings, pad_id, eos_ids, dev, ranks=None):
        plan = orig(samples, settings, pad_id, eos_ids, dev, ranks)
        own = orig(samples, settings, pad_id, eos_ids, dev, None)
        plan.total_tokens, plan.total_samples = own.total_tokens, max(1, own.total_samples)
        return plan

    update._plan_update = per_rank
    update._plan_update_orig = orig


def _global_normaliser(rank_actor):
    import teamrl.trainer.update as update

    update._plan_update = getattr(update, "_plan_update_orig", update._plan_update)


def test_ranks_with_different_token_counts_share_one_normaliser(lora_pair):
    local, sharded, tok, reset = lora_pair
    loss = LossConfig(aggregation="token_mean")
    batch = _batch("grpo_lora", 0, tok, loss, long_tail=True)
    shares = [p[len(p) * r // 2:len(p) * (r + 1) // 2] for p in batch.parts["shared"] for r in (0, 1)]
    tokens = [sum(len(s.completion_ids) for s in share) for share in shares]
    assert tokens[1] > 2 * tokens[0], tokens  # rank 1 holds far more tokens than rank 0
    reset(local, sharded)
    (a, b), (wa, wb) = _steps([local, sharded], "grpo_lora", tok, loss, steps=[0], long_tail=True)
    _check(_differences(a, b, wa, wb), "different token counts, global normaliser")
    # the same with each rank dividing by its own count: not the 1-rank step
    reset(sharded)
    ray.get([r.__ray_call__.remote(_rank_normaliser) for r in sharded.ranks["shared"]])
    try:
        (c,), (wc,) = _steps([sharded], "grpo_lora", tok, loss, steps=[0], long_tail=True)
    finally:
        ray.get([r.__ray_call__.remote(_global_normaliser) for r in sharded.ranks["shared"]])
    wrong = _differences(a, c, wa, wc)
    print(f"per-rank normaliser: 2 vs 1 rank, max differences {', '.join(f'{k} {v:.2e}' for k, v in wrong.items())}")
    assert wrong["grad_norm"] > 1e-2 and wrong["weights"] > 10 * TOL


def test_checkpoints_move_between_rank_counts(lora_pair, tmp_path):
    local, sharded, tok, reset = lora_pair
    loss = LossConfig(aggregation="token_mean")
    reset(local)
    (ref,), (w_ref,) = _steps([local], "grpo_lora", tok, loss)  # uninterrupted, 1 rank
    for saver, loader, what in ((sharded, local, "saved at 2 ranks, resumed at 1"),
                                (local, sharded, "saved at 1 rank, resumed at 2")):
        reset(local, sharded)
        _steps([saver], "grpo_lora", tok, loss, steps=range(2))
        path = tmp_path / "policy.pt"
        torch.save(saver.state("shared"), path)
        weights, optimizer = torch.load(path, weights_only=True)
        assert optimizer["state"] and all(isinstance(k, int) for k in optimizer["state"])  # torch.optim's own format
        loader.load_state("shared", weights, optimizer)
        (cont,), (w_cont,) = _steps([loader], "grpo_lora", tok, loss, steps=[2])
        _check(_differences({"shared": ref["shared"][2:]}, cont, w_ref, w_cont), what)


def _failing_learner(*extra: str):
    local, sharded, tok = _pair("grpo_lora", *extra)
    pids = [d["pid"] for d in sharded.where()["shared"]["ranks"]]
    assert len(pids) == 2 and os.getpid() not in pids
    return sharded, tok, pids


def test_a_killed_rank_is_named_within_seconds_and_every_rank_stops(local_ray):  # noqa: F811
    sharded, tok, pids = _failing_learner()
    loss = LossConfig(aggregation="token_mean")
    batch = _batch("grpo_lora", 0, tok, loss, micro_batch_size=1)
    batch.parts["shared"] = [[s for _ in range(100) for s in p] for p in batch.parts["shared"]]  # a long update
    killed = {}

    def kill():
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)
        killed["at"] = time.monotonic()

    threading.Thread(target=kill).start()
    with pytest.raises(WorkerFailed) as e:
        sharded.update(batch)
    delay = time.monotonic() - killed["at"]
    print(f"killed rank: {e.value} (after {delay:.1f} s)")
    assert f"policy worker 'shared' rank 1 of 2 (pid {pids[1]}) died" in str(e.value) and "\n" not in str(e.value)
    assert delay < 10
    wait_until(lambda: not any(_alive(p) for p in pids), 10, f"a rank of {pids} outlived the failure")


def test_a_hung_collective_fails_on_the_group_timeout(local_ray):  # noqa: F811
    sharded, tok, pids = _failing_learner("policy.collective_timeout_s=5")
    os.kill(pids[1], signal.SIGSTOP)  # rank 1 hangs: rank 0 waits for it in the first collective
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerFailed, match=rf"rank 0 of 2 .* failed: .*[Tt]imed? ?out.*; rank 1 \(pid {pids[1]}\) "
                                               r"gave no answer") as e:
            sharded.update(_batch("grpo_lora", 0, tok, LossConfig()))
    finally:
        os.kill(pids[1], signal.SIGCONT)
    print(f"hung rank: {e.value} (after {time.monotonic() - t0:.1f} s)")
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 30
    wait_until(lambda: not any(_alive(p) for p in pids), 10, f"a rank of {pids} outlived the failure")


def test_impossible_rank_settings_fail_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"policy.ranks.shared: 2 ranks need policy.placement=ray"):
        load_config(None, ["policy.ranks={shared: 2}"])
    with pytest.raises(ConfigError, match=r"policy.ranks.shared: expected a whole number of ranks >= 1, got 0"):
        load_config(None, ["policy.placement=ray", "policy.ranks={shared: 0}"])
    with pytest.raises(ConfigError, match=r"policy.resources.shared.num_gpus: 0.5 with policy.ranks.shared=2: each "
                                          r"rank needs whole GPUs"):
        load_config(None, ["policy.placement=ray", "policy.ranks={shared: 2}", "policy.resources={shared: {num_gpus: 0.5}}"])
    from teamrl.trainer.learner import worker_groups

    cfg = load_config(None, ["policy.placement=ray", "policy.ranks={nobody: 2}"])
    with pytest.raises(ConfigError, match=r"policy.ranks: 'nobody' is not a worker; the workers are \['shared'\]"):
        worker_groups(cfg, ["shared"])


def test_a_run_on_two_ranks_trains_publishes_saves_and_resumes_as_one_rank(local_ray, tmp_path):  # noqa: F811
    """Through the trainer: the driver's copy gets the ranks' weights, and a checkpoint of the 2-rank run resumes in
    one process with the uninterrupted 1-rank run's next step."""
    from teamrl.trainer.trainer import Trainer
    from tests.test_placement import COMMON as RUN

    def cfg(name, *extra):
        return load_config(None, [*RUN, "algorithm=grpo", "task.name=word_count", "train.lr=0.0001", "train.steps=3",
                                  "run.save_every=1", f"run.dir={tmp_path}", f"name={name}", *extra])

    reference = Trainer(cfg("local")).train()
    tr = Trainer(cfg("sharded", "policy.placement=ray", "policy.ranks={shared: 2}"))
    try:
        assert type(tr.learner).__name__ == "ShardedLearner"
        for _ in range(2):
            tr.train_step()
        trained = tr.learner.state("shared")[0]
        driver = tr.router.policies["shared"].named_state()  # what the next rollout samples with
        assert all(torch.equal(driver[k], v) for k, v in trained.items())
    finally:
        tr.shutdown()
    resumed = Trainer(cfg("sharded"), resume=True)  # placement local: one process
    assert resumed.step == 2
    records = resumed.train()  # the run's records: its two steps on 2 ranks, the third in one process
    keys = [k for k in reference[-1] if k.startswith(("loss/", "grad_norm/", "reward_mean", "completion_len"))]
    diffs = {k: max(abs(a[k] - b[k]) / max(1.0, abs(a[k])) for a, b in zip(reference, records)) for k in keys}
    print(f"trainer, 2 ranks then resumed at 1 vs 1 rank: max differences {diffs}")
    assert [r["step"] for r in records] == [1, 2, 3] and all(d <= TOL for d in diffs.values()), diffs


def test_full_weights_from_two_ranks_reach_a_server_and_each_reload_is_checked(local_ray, tmp_path):  # noqa: F811
    """The weights out of the shards: a full-weight policy on 2 ranks, rollouts from a vLLM-like server; after each
    update the ranks' weights are gathered once into the driver's copy, written and reloaded by the server (POST
    /collective_rpc reload_weights), and the sync check finds the server's log-probs equal to the trainer's."""
    from teamrl.trainer.trainer import Trainer
    from tests.test_placement import COMMON as RUN
    from tests.test_vllm_contract import strict_server

    with strict_server("vllm", logprobs_mode="processed_logprobs") as server:
        tr = Trainer(load_config(None, [*RUN, "algorithm=grpo", "task.name=word_count", "train.lr=0.0001",
                                        "rollout.temperature=1.0", "policy.lora=null", "policy.placement=ray",
                                        "policy.ranks={shared: 2}", "rollout.engine=http",
                                        f"rollout.server_url={server.url}", f"run.dir={tmp_path}", "name=full2"]))
        try:
            assert type(tr.learner).__name__ == "ShardedLearner" and tr.engine.full_weights == {"shared"}
            moved = []
            for step in (1, 2):
                rec = tr.train_step()
                print(f"2 full-weight ranks through a server, step {step}: sync max gap "
                      f"{rec['sync/shared/max_logprob_gap']:.2e}, moved {rec['sync/shared/moved']:.2e}")
                assert rec["sync/shared/max_logprob_gap"] < 1e-4, rec
                moved.append(rec["sync/shared/moved"])
            assert max(moved) > 1e-3  # an update moved the probe past the tolerance: a stale reload would show
            trained = tr.learner.weights("shared")
            served = dict(server.model_server.base.named_parameters())
            assert all(torch.allclose(served[k], v, atol=1e-6) for k, v in trained.items())
        finally:
            tr.shutdown()


def _store_port(rank) -> int:
    """The port of the rendezvous store the rank's process group uses (a TCPStore under torch's PrefixStore)."""
    store = torch.distributed.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store.port


def test_the_rendezvous_of_a_sharded_run_listens_on_loopback_only(lora_pair):
    """Issue 57 item 6: torch's TCPStore listened on ``*:PORT`` whatever address it was given, so anyone reaching the
    node could read or write the rendezvous. Now, with every rank on this machine, it listens on 127.0.0.1 only.
    (Ray's own gRPC servers, one per rank process, listen on ``::``: Ray's, printed, not bound by teamrl.)"""
    from tests.listening import WILDCARDS, listening

    _, sharded, _, _ = lora_pair
    ranks = sharded.ranks["shared"]
    port = ray.get(ranks[0].__ray_call__.remote(_store_port), timeout=60)
    sockets = listening({p for ps in sharded.pids.values() for p in ps})
    for (host, p), pids in sorted(sockets.items()):
        print(f"rank sockets: {host}:{p} {'(the rendezvous)' if p == port else ''}")
    hosts = {host for host, p in sockets if p == port}
    assert hosts and not hosts & WILDCARDS and hosts <= {"127.0.0.1"}, (port, hosts)
