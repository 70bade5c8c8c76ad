"""One test per mutant that survived the first mutation run (issue 20): each pins down a behaviour
that no other test exercised. The mutant each one kills is named in its docstring and listed in
tools/mutants.py."""

import contextlib
import copy
import dataclasses
import math

import torch

from teamrl.algorithms.at_grpo import ATGRPO, ATGRPOConfig
from teamrl.algorithms.m_grpo import prepare_sub_samples
from teamrl.algorithms.magrpo import MAGRPO, MAGRPOConfig
from teamrl.algorithms.grpo import assign_rewards
from teamrl.core.sample import Sample
from teamrl.losses import LossConfig, completion_mask, policy_loss
from teamrl.policies.logprobs import build_token_batch, completion_logprobs, token_logprobs
from teamrl.policies.policy import Policy
from teamrl.rollout.engine import GenerationRequest, SamplingParams
from teamrl.rollout.hf_engine import HFEngine
from teamrl.tasks.environment import Environment
from teamrl.tasks.task import Problem, TeamTask
from teamrl.trainer.update import UpdateParams, update_policy
from teamrl.workflows.outcome import EpisodeOutcome
from tests.fakes import FakeTokenizer, FixedLogitsModel, run_all, scripted_factory


def test_old_logprobs_are_constants_even_when_they_carry_a_graph():
    """Mutant: ``old_logprobs`` not detached in the log-ratio."""
    logprobs = torch.zeros(1, 2, requires_grad=True)
    old = logprobs * 1.0  # still on the graph, as a caller's recomputed log-probs can be
    loss, _ = policy_loss(logprobs, old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), LossConfig())
    loss.backward()
    # d/dlp of -mean(exp(lp - old) * A) at ratio 1: -A / T per token
    assert logprobs.grad.tolist() == [[-0.5, -0.5]]


def _step(model, samples, tok):
    pol = Policy("p", copy.deepcopy(model), None, lr=1.0, weight_decay=0.0)
    pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1.0)  # the step is the gradient
    before = [p.detach().clone() for p in pol.parameters()]
    update_policy(pol, samples, UpdateParams(loss=LossConfig(), max_grad_norm=1e9), tok.pad_token_id, [tok.eos_token_id])
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, pol.parameters())])


def test_update_computes_logprobs_at_the_sampling_temperature(tiny):
    """Mutant: the training log-probs ignore ``Sample.temperature``."""
    model, tok = tiny
    prompts = [[256, 60], [256, 61, 62]]
    comps = [[70, 71, tok.eos_token_id], [72, 73, 74]]
    adv = [1.0, -0.5]
    samples = [Sample(role="agent", policy="p", problem_id=i, prompt_ids=p, completion_ids=c, sampling_logprobs=[],
                      advantage=a, temperature=0.5) for i, (p, c, a) in enumerate(zip(prompts, comps, adv))]
    step = _step(model, samples, tok)

    m = copy.deepcopy(model)
    b = build_token_batch(prompts, comps, tok.pad_token_id)
    lp, _ = completion_logprobs(m, b, temperature=0.5)
    mask = completion_mask(b.completion_ids, tok.eos_token_id, b.completion_pad_mask)
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor(adv), mask, LossConfig())
    loss.backward()
    expected = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in m.parameters()])
    assert torch.allclose(step, expected, atol=1e-6, rtol=1e-4)
    at_one = _step(model, [dataclasses.replace(s, temperature=1.0) for s in samples], tok)
    assert not torch.allclose(step, at_one, atol=1e-4)  # the temperature matters here


def test_entropy_of_a_uniform_distribution_is_log_vocab():
    """Mutant: entropy averaged over the vocabulary instead of summed."""
    _, entropy = token_logprobs(torch.zeros(1, 3, 8), torch.zeros(1, 3, dtype=torch.long), with_entropy=True)
    assert entropy.shape == (1, 3)
    assert torch.allclose(entropy, torch.full((1, 3), math.log(8)))


class ConstantTeam(TeamTask):
    """Every joint action scores ``score`` out of ``max_reward`` 2."""

    name = "constant_team"
    roles = ("a", "b")
    max_reward = 2.0

    def __init__(self, score: float) -> None:
        self.score = score

    def problems(self):
        return [Problem("q", {})]

    def prompt(self, problem, role, turn=0, history=(), feedback=""):
        return [{"role": "user", "content": f"{role} turn {turn}"}]

    def reward(self, problem, outputs):
        return self.score


def test_a_joint_action_exactly_at_the_termination_threshold_terminates():
    """Mutant: the normalised reward compared with ``>`` instead of ``>=`` the threshold."""
    task = ConstantTeam(score=1.0)  # normalised 0.5
    algo = MAGRPO(MAGRPOConfig(num_turns=3, gamma=1.0, termination_threshold=0.5), group_size=2)
    samples = algo.rollout(task.problems(), task, scripted_factory(), run_all)
    assert {s.turn for s in samples} == {0}
    # a terminated success is credited with its reward for each of the 3 turns (gamma 1): 1 + 1 + 1
    assert [s.reward for s in samples] == [3.0] * 4
    below = MAGRPO(MAGRPOConfig(num_turns=2, gamma=1.0, termination_threshold=0.6), group_size=2)
    assert {s.turn for s in below.rollout(task.problems(), task, scripted_factory(), run_all)} == {0, 1}


class AfterActionEnv(Environment):
    """One agent; the team reward is 3 once anything has been done, 0 on the fresh state."""

    name = "after_action"
    roles = ("agent",)
    max_turns = 1

    def problems(self):
        return [Problem("p", {})]

    def reset(self, problem):
        return ()

    def observe(self, state, role):
        return [{"role": "user", "content": f"state {len(state)}"}]

    def apply(self, state, role, text):
        return state + (text,), 0.0

    def team_reward(self, state):
        return 3.0 if state else 0.0

    def done(self, state):
        return False


def test_a_candidate_is_scored_with_the_team_reward_of_the_state_it_produces():
    """Mutant: the candidate's team term taken from the state before its action."""
    env = AfterActionEnv()
    algo = ATGRPO(ATGRPOConfig(alpha=1.0), k=2)
    samples = algo.rollout(env.problems(), env, scripted_factory(), run_all)
    assert [s.reward for s in samples] == [3.0, 3.0]
    assert [s.tags["team_reward"] for s in samples] == [3.0, 3.0]


def test_sub_trajectory_validity_is_read_from_its_last_turn():
    """Mutant: validity read from the sub-trajectory's first turn."""
    sub = [Sample("sub", "sub", "q", [1], [2], [0.0], episode=0, turn=t,
                  tags={"parent_episode": 0, "call": 0, "format_valid": t == 1}) for t in (1, 0)]  # out of order
    out = prepare_sub_samples(sub, {("q", 0): 1.0}, d_max=1, mode="gated", seed=0)
    assert [s.reward for s in out] == [1.0, 1.0]


def test_outcome_mode_ignores_role_rewards():
    """Mutant: the per-role reward used in ``outcome`` mode too."""
    samples = [Sample("evaluator", "p", "q", [1], [2], [0.0], role_reward=0.0),
               Sample("generator", "p", "q", [1], [2], [0.0])]
    outcome = EpisodeOutcome(final_text="4", answer="4", correct=True)
    assign_rewards(samples, outcome, "outcome")
    assert [s.reward for s in samples] == [1.0, 1.0]
    assign_rewards(samples, outcome, "per_role")
    assert [s.reward for s in samples] == [0.0, 1.0]


def test_mixed_max_new_tokens_in_one_call_stop_each_row_at_its_own_length():
    """Mutant: the length stop off by one (``max_new <= t`` instead of ``<= t + 1``)."""
    engine = HFEngine(lambda policy: contextlib.nullcontext(FixedLogitsModel([0.0] * 5)), FakeTokenizer(eos_token_id=None))
    short, long = (GenerationRequest([1, 2], SamplingParams(max_new_tokens=n)) for n in (3, 6))
    out = engine.generate("p", [short, long], seed=0)
    assert [len(c.token_ids) for (c,) in out] == [3, 6]
    assert [c.finish_reason for (c,) in out] == ["length", "length"]
