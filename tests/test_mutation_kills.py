"""Tests written to kill the mutants of tools/mutants.py that the rest of the suite let through:
each pins a number a training step depends on (loss, gradient, reward, return, group key, sampled
token) against a value worked out by hand."""

import contextlib
import copy
import dataclasses
import math

import pytest
import torch

from teamrl.algorithms.at_grpo import ATGRPO, ATGRPOConfig
from teamrl.algorithms.grpo import GRPO
from teamrl.algorithms.m_grpo import prepare_sub_samples
from teamrl.algorithms.magrpo import MAGRPO, MAGRPOConfig
from teamrl.algorithms.grpo import WorkflowGRPO
from teamrl.core.sample import Sample
from teamrl.losses import LossConfig, policy_loss
from teamrl.policies.logprobs import token_logprobs
from teamrl.policies.policy import Policy
from teamrl.rollout.engine import GenerationRequest, SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.tasks.environment import Environment
from teamrl.tasks.task import Problem, Task, TeamTask
from teamrl.trainer.update import UpdateParams, update_policy
from tests.fakes import FakeTokenizer, FixedLogitsModel, run_all, scripted_factory

# --- losses ------------------------------------------------------------------------------------


def test_advantages_are_constants_of_the_loss():
    logprobs = torch.zeros(2, 2, requires_grad=True)
    adv = torch.tensor([1.0, -1.0], requires_grad=True)
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, torch.ones(2, 2), LossConfig())
    loss.backward()
    assert adv.grad is None
    assert logprobs.grad.tolist() == [[-0.25, -0.25], [0.25, 0.25]]


def test_dr_grpo_accepts_a_completion_of_exactly_its_length():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0, 2.0]), mask,
                          LossConfig(aggregation="dr_grpo", max_completion_length=3))
    assert loss.item() == pytest.approx(-(3 * 1.0 + 1 * 2.0) / (2 * 3))


def test_kl_penalty_gradient_by_hand():
    """k3 = exp(ref - lp) - (ref - lp) - 1 pulls lp towards ref: d k3 / d lp = 1 - exp(ref - lp)."""
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    loss, stats = policy_loss(logprobs, logprobs.detach(), torch.tensor([0.0]), torch.ones(1, 2), LossConfig(kl_coef=0.5),
                              ref_logprobs=ref)
    loss.backward()
    delta = ref - logprobs.detach()
    assert stats["kl"] == pytest.approx((delta.exp() - delta - 1).mean().item(), abs=1e-6)
    assert torch.allclose(logprobs.grad, 0.5 * (1 - delta.exp()) / 2, atol=1e-6)


# --- update ------------------------------------------------------------------------------------


def _samples(tok, advs):
    return [Sample(role="agent", policy="p", problem_id=i, prompt_ids=[256, 60 + i], completion_ids=[70 + i, 71, tok.eos_token_id],
                   sampling_logprobs=[], advantage=a) for i, a in enumerate(advs)]


def _sgd_policy(model, **kw):
    pol = Policy("p", copy.deepcopy(model), None, lr=1.0, weight_decay=0.0, **kw)
    pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1.0)  # the step is the (clipped) gradient
    return pol


def _step_of(pol, fn):
    before = [p.detach().clone() for p in pol.parameters()]
    stats = fn()
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, pol.parameters())]), stats


def test_update_clips_the_gradient_norm(tiny):
    model, tok = tiny
    pol = _sgd_policy(model)
    step, stats = _step_of(pol, lambda: update_policy(pol, _samples(tok, [1.0, -1.0]), UpdateParams(
        loss=LossConfig(), max_grad_norm=1e-3), tok.pad_token_id, [tok.eos_token_id]))
    assert stats["grad_norm"] > 1e-2  # the norm before clipping
    assert step.norm().item() == pytest.approx(1e-3, rel=1e-3)


def test_update_trains_no_token_after_eos(tiny):
    model, tok = tiny
    eos = tok.eos_token_id
    clean = _samples(tok, [1.0, -1.0])
    tailed = [dataclasses.replace(s, completion_ids=s.completion_ids + [90, eos, 91]) for s in clean]
    settings = UpdateParams(loss=LossConfig(), max_grad_norm=1e9)
    steps = []
    for samples in (clean, tailed):
        pol = _sgd_policy(model)
        steps.append(_step_of(pol, lambda: update_policy(pol, samples, settings, tok.pad_token_id, [eos]))[0])
    assert steps[0].abs().sum() > 0
    assert torch.allclose(steps[0], steps[1], atol=1e-6)


def test_kl_penalty_is_against_the_reference_model(tiny):
    model, tok = tiny
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    pol = _sgd_policy(model, reference_model=ref)
    step, stats = _step_of(pol, lambda: update_policy(pol, _samples(tok, [0.0, 0.0]), UpdateParams(
        loss=LossConfig(kl_coef=1.0), max_grad_norm=1e9), tok.pad_token_id, [tok.eos_token_id]))
    assert stats["kl"] > 1e-4 and stats["loss"] == pytest.approx(stats["kl"], rel=1e-5)  # zero advantages: loss = KL
    assert step.abs().sum() > 0  # and the KL pulls the weights


def test_ppo_epochs_step_from_their_own_gradient_only(tiny):
    """Each PPO epoch's optimizer step uses that epoch's gradient, not the sum with earlier epochs'."""
    model, tok = tiny
    samples = _samples(tok, [1.0, -1.0])

    def step(epochs):
        pol = _sgd_policy(model)
        pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1e-4)  # small steps: each epoch's gradient ~ the first's
        settings = UpdateParams(loss=LossConfig(), ppo_epochs=epochs, max_grad_norm=1e9)
        return _step_of(pol, lambda: update_policy(pol, samples, settings, tok.pad_token_id, [tok.eos_token_id]))[0]

    one, two = step(1), step(2)
    # two epochs move about twice as far as one; gradients left over from epoch 1 would make it three times
    assert (two.norm() / one.norm()).item() == pytest.approx(2.0, rel=0.05)


# --- log-probs ---------------------------------------------------------------------------------


def test_token_logprobs_at_a_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0, 0.5]]])
    lp, ent = token_logprobs(logits, torch.tensor([[0]]), temperature=0.5, with_entropy=True)
    p = torch.softmax(logits / 0.5, -1)
    assert lp.item() == pytest.approx(math.log(p[0, 0, 0].item()), abs=1e-6)
    assert ent.item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-6)


def _gpt2():
    """A tiny randomly initialised GPT-2: absolute position embeddings, so a shifted position id changes the logits
    (with rotary embeddings, as in the Llama-family models, a uniform shift changes nothing)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1, n_head=2)).eval()


def test_completion_logprobs_match_a_plain_forward_with_absolute_positions():
    from teamrl.policies.logprobs import build_shared_prefix_batch, build_token_batch, completion_logprobs, shared_prefix_logprobs

    model = _gpt2()
    prompts, comps = [[1, 2, 3, 4], [5, 6], [5, 6]], [[7, 8, 9], [10, 11], [12]]
    with torch.no_grad():
        plain, _ = completion_logprobs(model, build_token_batch(prompts, comps, pad_id=0))
        shared, _ = shared_prefix_logprobs(model, build_shared_prefix_batch(prompts, comps, pad_id=0))
        for i, (p, c) in enumerate(zip(prompts, comps)):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1]  # positions 0.. of the unpadded sequence
            expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c).unsqueeze(1)).squeeze(1)
            assert torch.allclose(plain[i, :len(c)], expected, atol=1e-5), i
            assert torch.allclose(shared[i, :len(c)], expected, atol=1e-5), i


# --- algorithms --------------------------------------------------------------------------------


class LengthTask(Task):
    name = "length"

    def problems(self):
        return [Problem("a", {}), Problem("b", {})]

    def prompt(self, problem):
        return [{"role": "user", "content": f"problem {problem.id}"}]

    def reward(self, problem, text):
        return float(len(text))


def test_grpo_groups_every_episode_of_a_problem_together():
    task, contexts = LengthTask(), []
    algo = GRPO(3, greedy_baseline=True)
    samples = algo.rollout(task.problems(), task, scripted_factory(lambda r, p, j: "x" * (len(p) % 3 + 1), contexts), run_all)
    regular = [s for s in samples if not s.baseline]
    assert sorted((s.problem_id, s.episode) for s in regular) == [(p, e) for p in "ab" for e in range(3)]
    assert {s.group for s in samples} == {("a",), ("b",)}
    baselines = [s for s in samples if s.baseline]
    assert [(s.problem_id, s.episode, s.tags.get("greedy")) for s in baselines] == [("a", -1, True), ("b", -1, True)]
    assert all(s.reward == len(s.text) for s in samples)


class TurnTeam(TeamTask):
    """Two roles; reward of a joint action = turn + 0.5 * (both chose branch 1); feedback and history in the prompt."""

    name = "turn_team"
    roles = ("a", "b")
    max_reward = 4.0

    def problems(self):
        return [Problem("q", {})]

    def prompt(self, problem, role, turn=0, history=(), feedback=""):
        return [{"role": "user", "content": f"{role} t{turn} h{[h[role] for h in history]}"}]

    def reward(self, problem, outputs):
        return float(outputs["a"].endswith("1") and outputs["b"].endswith("1")) * 0.5 + outputs["a"].count("t1")


def test_magrpo_returns_and_groups_on_a_two_turn_tree():
    task = TurnTeam()
    algo = MAGRPO(MAGRPOConfig(num_turns=2, gamma=0.5), group_size=2)
    # a text repeats the turn it saw, and says which branch of the group it is
    samples = algo.rollout(task.problems(), task, scripted_factory(lambda r, p, j: f"{p.split()[1]}-{j}"), run_all)
    t0 = [s for s in samples if s.turn == 0]
    t1 = [s for s in samples if s.turn == 1]
    assert len(t0) == 4 and len(t1) == 2 * 4  # two children (one per joint action), each 2 roles x 2 samples
    # turn 1 rewards: 1 (texts contain t1) + 0.5 for the joint action (1, 1); each child's mean return: 1.25
    # turn 0 rewards: 0 and 0.5; returns = r + 0.5 * 1.25
    assert sorted(s.reward for s in t0) == pytest.approx([0.625, 0.625, 1.125, 1.125])
    assert sorted(s.reward for s in t1) == pytest.approx([1.0] * 4 + [1.5] * 4)
    # each child node is its own group per role, and its prompt carries its parent's joint action
    assert len({s.group for s in t1}) == 4 and all(s.group[3] in ((0,), (1,)) for s in t1)
    assert {s.prompt_text for s in t1 if s.role == "a"} == {"a t1 h['t0-0']", "a t1 h['t0-1']"}


class ScoreEnv(Environment):
    """Local reward = length of the text / 10 (+0.1 for the first role); team reward = number of actions applied."""

    name = "score_env"

    def __init__(self, roles=("x", "y"), parallel=False, turns=2):
        self.roles, self.parallel, self.max_turns = roles, parallel, turns

    def problems(self):
        return [Problem("p", {})]

    def reset(self, problem):
        return ()

    def observe(self, state, role):
        return [{"role": "user", "content": f"{role} {len(state)}"}]

    def apply(self, state, role, text):
        return state + ((role, text),), len(text) / 10 + (0.1 if role == self.roles[0] else 0.0)

    def team_reward(self, state):
        return float(len(state))

    def done(self, state):
        return False


def _long_second(role, prompt, j):
    return "ab" if j == 0 else "abcd"  # candidate 1 has the higher local reward


def test_at_grpo_tree_and_trajectory_rewards_by_hand():
    env = ScoreEnv()
    tree = ATGRPO(ATGRPOConfig(alpha=0.5), k=2).rollout(env.problems(), env, scripted_factory(_long_second), run_all)
    # 2 turns x 2 roles x 2 candidates; the n-th action (1-based) gets team reward n
    assert len(tree) == 8
    for n, pair in enumerate([tree[i:i + 2] for i in range(0, 8, 2)], 1):
        local = [0.2, 0.4] if pair[0].role == "y" else [0.3, 0.5]
        assert [s.reward for s in pair] == pytest.approx([r + 0.5 * n for r in local])
        assert [s.tags.get("chosen", False) for s in pair] == [False, True]
        assert pair[0].prompt_text == f"{pair[0].role} {n - 1}"  # the chosen branch's state continues
    assert len({s.group for s in tree}) == 4 and all(s.group == ("p", s.turn, s.role) for s in tree)
    short = ATGRPO(ATGRPOConfig(alpha=0.5, max_turns=1), k=2).rollout(env.problems(), env, scripted_factory(_long_second), run_all)
    assert {s.turn for s in short} == {0}

    par = ScoreEnv(parallel=True, turns=1)
    traj = ATGRPO(ATGRPOConfig(alpha=0.5, grouping="trajectory"), k=2).rollout(par.problems(), par, scripted_factory(_long_second), run_all)
    assert len(traj) == 2 * 2  # k episodes x 2 roles
    assert [s.prompt_text for s in traj] == ["x 0", "y 0"] * 2  # parallel agents both see the turn's first state
    assert [s.reward for s in traj] == pytest.approx([0.3 + 0.5 * 2, 0.2 + 0.5 * 2] * 2)
    assert {s.group for s in traj} == {("p", "x"), ("p", "y")}
    two_turns = ScoreEnv(turns=2)
    traj2 = ATGRPO(ATGRPOConfig(alpha=0.5, grouping="trajectory"), k=2).rollout(two_turns.problems(), two_turns, scripted_factory(_long_second), run_all)
    assert {s.group for s in traj2} == {("p", "x"), ("p", "y")} and {s.turn for s in traj2} == {0, 1}


def _sub(ep, call, turn, valid=True):
    return Sample("sub", "sub", "q", [1], [2], [0.0], episode=ep, turn=turn,
                  tags={"parent_episode": ep, "call": call, "format_valid": valid})


def test_m_grpo_rewards_and_groups_by_hand():
    # rollout 0: one call (2 turns); rollout 1: two calls; rollout 2: none. d_max = 2.
    sub = [_sub(0, 0, 0), _sub(0, 0, 1), _sub(1, 0, 0), _sub(1, 1, 0, valid=False)]
    outcomes = {("q", 0): 1.0, ("q", 1): 0.5, ("q", 2): 0.0}
    out = prepare_sub_samples(sub, outcomes, d_max=2, mode="gated", seed=3)
    assert all(s.group == ("q", "sub") for s in out)
    assert sum(s.turn == 0 for s in out) == 3 * 2  # K * d_max sub-trajectories
    for s in out:  # every copy carries its own parent's outcome, gated by its validity
        assert s.reward == (outcomes[("q", s.tags["parent_episode"])] if s.tags["format_valid"] else 0.0)
    own = [s for s in out if s.tags["parent_episode"] == 0 and s.turn == 0]
    assert len(own) >= 2 and sum(not s.tags.get("duplicate", False) for s in own) == 1  # one original, copies tagged
    assert len({id(s) for s in out}) == len(out)  # a duplicate is a new Sample, not the same one twice


def test_m_grpo_rollout_tags_each_sub_call_with_its_own_validity(monkeypatch):
    """Every sub sample carries the format validity of the call it belongs to (call 0 invalid, call 1 valid)."""
    import teamrl.algorithms.m_grpo as m_grpo_module
    from teamrl.algorithms.m_grpo import MGRPO, MGRPOConfig
    from teamrl.workflows.research_team import ResearchOutcome, SubCall

    async def two_calls(ctx, env, problem):
        await ctx.generate("main", "question", turn=0)
        for call in (0, 1):
            ctx.tags["call"], ctx.tags["parent_episode"] = call, ctx.episode
            await ctx.generate("sub", f"subtask {call}", turn=0)
        ctx.tags.clear()
        return ResearchOutcome("42", True, 1.0, True, [SubCall("a", "x", False, 1), SubCall("b", "y", True, 1)])

    monkeypatch.setattr(m_grpo_module, "research_team", two_calls)
    raw = MGRPO(MGRPOConfig(d_max=2), k=2).rollout_raw([Problem("q", {})], None, scripted_factory(), run_all)
    assert len(raw.main) == 2 and all(s.reward == 1.0 and s.group == ("q",) for s in raw.main)
    assert [(s.tags["call"], s.tags["format_valid"]) for s in raw.sub] == [(0, False), (1, True)] * 2
    assert raw.outcomes == {("q", 0): 1.0, ("q", 1): 1.0}


def test_workflow_group_key_pools_role_instances():
    def key(role, turn):
        return WorkflowGRPO.group_key(Sample(role, "p", "q", [1], [2], [0.0], turn=turn))

    assert key("generator0", 0) == key("generator2", 0) != key("generator0", 1)
    assert key("evaluator", 1) != key("generator0", 1)


# --- sampling ----------------------------------------------------------------------------------

PROBS = [0.5, 0.25, 0.125, 0.125]


def _engine(logits, eos=None):
    return HFEngine(lambda policy: contextlib.nullcontext(FixedLogitsModel(logits)), FakeTokenizer(eos_token_id=eos))


def _firsts(engine, n=400, **params):
    out = engine.generate("p", [GenerationRequest([1, 2], SamplingParams(max_new_tokens=1, **params), n=n)], seed=0)[0]
    return [c.token_ids[0] for c in out], [c.logprobs[0] for c in out]


def test_engine_sampling_distribution():
    engine = _engine([math.log(p) for p in PROBS])
    toks, lps = _firsts(engine)
    assert set(toks) == {0, 1, 2, 3} and 0.4 < toks.count(0) / len(toks) < 0.6
    assert all(lp == pytest.approx(math.log(PROBS[t]), abs=1e-5) for t, lp in zip(toks, lps))
    # temperature 0.5 squares the probabilities: [64, 16, 4, 4] / 88
    toks, lps = _firsts(engine, temperature=0.5)
    assert all(lp == pytest.approx(math.log([64, 16, 4, 4][t] / 88), abs=1e-5) for t, lp in zip(toks, lps))
    assert toks.count(0) / len(toks) > 0.6
    # top-k 2 and top-p 0.6 both keep tokens 0 and 1 (the second one crosses 0.6); log-probs stay unfiltered
    for params in ({"top_k": 2}, {"top_p": 0.6}):
        toks, lps = _firsts(engine, **params)
        assert set(toks) == {0, 1}, params
        assert all(lp == pytest.approx(math.log(PROBS[t]), abs=1e-5) for t, lp in zip(toks, lps))
    toks, lps = _firsts(engine, n=4, temperature=0.0)
    assert toks == [0] * 4 and lps == pytest.approx([math.log(0.5)] * 4, abs=1e-5)


def test_engine_ignore_eos_and_tokens_beyond_the_first_block():
    eos_first = _engine([5.0, 0.0, 0.0], eos=0)
    (c,) = eos_first.generate("p", [GenerationRequest([1], SamplingParams(max_new_tokens=5, temperature=0))], seed=0)[0]
    assert (c.token_ids, c.finish_reason) == ([0], "eos")
    (c,) = eos_first.generate("p", [GenerationRequest([1], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))], seed=0)[0]
    assert (c.token_ids, c.finish_reason) == ([0] * 5, "length")
    for target in (300, 599):  # all mass on one token in the second / third block of the inverse CDF
        logits = torch.full((600,), -1e4)
        logits[target] = 0.0
        toks, _ = _firsts(_engine(logits), n=8)
        assert toks == [target] * 8


def test_engine_logprobs_match_a_plain_forward_with_absolute_positions():
    """Prompts of different lengths (left padding) on a model with absolute positions: the greedy tokens and their
    log-probs are those of a plain forward over the unpadded prompt + completion."""
    model = _gpt2()
    engine = HFEngine(lambda policy: contextlib.nullcontext(model), FakeTokenizer(eos_token_id=None))
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14]]
    params = SamplingParams(max_new_tokens=4, temperature=0)
    out = engine.generate("p", [GenerationRequest(p, params) for p in prompts], seed=0)
    with torch.no_grad():
        for p, (c,) in zip(prompts, out):
            logp = torch.log_softmax(model(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1].float(), -1)
            assert c.token_ids == logp.argmax(-1).tolist()
            assert c.logprobs == pytest.approx(logp.max(-1).values.tolist(), abs=1e-5)
