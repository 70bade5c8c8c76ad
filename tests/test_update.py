"""The trainer's update step: masks carry no gradient, micro-batching is exact, GRPO reduces correctly."""

import copy

import torch

from teamrl.core.sample import Sample
from teamrl.losses import LossConfig, completion_mask, policy_loss
from teamrl.policies.logprobs import build_token_batch, completion_logprobs
from teamrl.policies.policy import Policy
from teamrl.trainer.update import UpdateParams, update_policy


def _grads(model, prompts, completions, adv, pad, eos, agg="token_mean", max_completion_length=None):
    model.zero_grad()
    b = build_token_batch(prompts, completions, pad)
    lp, _ = completion_logprobs(model, b)
    m = completion_mask(b.completion_ids, eos, b.completion_pad_mask)
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor(adv), m,
                          LossConfig(aggregation=agg, max_completion_length=max_completion_length))
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_prompt_padding_and_post_eos_tokens_carry_no_gradient(tiny):
    model, tok = tiny
    eos, pad = tok.eos_token_id, tok.pad_token_id
    prompts = [[256, 80, 81], [256, 82]]
    comps = [[90, 91, eos], [92, eos]]
    g1 = _grads(model, prompts, comps, [1.0, -0.5], pad, eos)
    # Tokens after EOS (here: garbage appended), longer padding, and a different pad id change nothing.
    comps2 = [[90, 91, eos, 93, 94, 95], [92, eos, 99]]
    g2 = _grads(model, prompts, comps2, [1.0, -0.5], pad, eos)
    g3 = _grads(model, prompts, comps2, [1.0, -0.5], 5, eos)
    for n in g1:
        assert torch.allclose(g1[n], g2[n], atol=1e-6), n
        assert torch.allclose(g1[n], g3[n], atol=1e-6), n


def _sample(i, tok, adv):
    return Sample(role="agent", policy="p", problem_id=0, prompt_ids=[256] + [60 + i] * (1 + i % 3),
                  completion_ids=[70 + i] * (2 + i % 4) + [tok.eos_token_id], sampling_logprobs=[], advantage=adv)


def test_micro_batching_equals_one_full_batch_for_every_aggregation(tiny):
    model, tok = tiny
    samples = [_sample(i, tok, a) for i, a in enumerate([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.1])]
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"):
        grads = []
        for mb in (7, 3, 1):
            m = copy.deepcopy(model)
            pol = Policy("p", m, None, lr=1.0, weight_decay=0.0)
            pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1.0)  # the step equals the gradient
            before = [p.clone() for p in pol.parameters()]
            update_policy(pol, samples, UpdateParams(loss=LossConfig(aggregation=agg, max_completion_length=8), micro_batch_size=mb, max_grad_norm=1e9),
                          tok.pad_token_id, [tok.eos_token_id])
            grads.append(torch.cat([(b - p.detach()).flatten() for b, p in zip(before, pol.parameters())]))
        assert grads[0].abs().sum() > 0
        for g in grads[1:]:
            assert torch.allclose(grads[0], g, atol=1e-6, rtol=1e-4), agg


def test_ppo_epochs_use_fixed_old_logprobs_and_clip(tiny):
    model, tok = tiny
    samples = [_sample(i, tok, a) for i, a in enumerate([1.0, -1.0, 1.0, -1.0])]
    pol = Policy("p", copy.deepcopy(model), None, lr=5e-2, weight_decay=0.0)
    stats = update_policy(pol, samples, UpdateParams(loss=LossConfig(eps_low=0.01, eps_high=0.01), ppo_epochs=3), tok.pad_token_id, [tok.eos_token_id])
    # after the first epoch's big step, ratios leave [0.99, 1.01] and some tokens are clipped
    assert stats["clip_frac"] > 0


def _two_shared_prompts(eos):
    """Five completions of two prompts (three and two), of different lengths, some ending on EOS."""
    prompts = [[256, 5, 6, 7, 8]] * 3 + [[256, 9, 10]] * 2
    comps = [[11, 12, 13, eos], [14, 15], [16, 17, 18, 19, 20, 21], [22], [23, 24, eos]]
    return prompts, comps


def test_shared_prompt_pass_gives_the_same_logprobs_and_gradients(tiny):
    from teamrl.policies.logprobs import build_shared_prefix_batch, shared_prefix_logprobs

    model, tok = tiny
    prompts, comps = _two_shared_prompts(tok.eos_token_id)
    plain = build_token_batch(prompts, comps, tok.pad_token_id)
    shared = build_shared_prefix_batch(prompts, comps, tok.pad_token_id)
    assert shared.prompt_ids.shape[0] == 2  # each distinct prompt once
    w = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    results = []
    for fn, b in ((completion_logprobs, plain), (shared_prefix_logprobs, shared)):
        model.zero_grad()
        lp, _ = fn(model, b, 0.8)
        (lp * w * plain.completion_pad_mask).sum().backward()
        results.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    mask = plain.completion_pad_mask
    assert torch.allclose(results[0][0][mask], results[1][0][mask], atol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.allclose(a, b, atol=1e-5)


def test_update_with_repeated_prompts_matches_distinct_micro_batches(tiny):
    model, tok = tiny
    eos = tok.eos_token_id
    samples = [Sample(role="agent", policy="p", problem_id=i // 3, prompt_ids=[256, 40 + i // 3, 41],
                      completion_ids=[70 + i] * (1 + i % 3) + [eos], sampling_logprobs=[], advantage=float(i % 3 - 1))
               for i in range(6)]
    steps = []
    # 6: two shared-prompt groups in one micro-batch; 2 and 1: one group per micro-batch, its prompt run once and
    # its three completions in passes of 2 + 1 and 1 + 1 + 1 (shared_prefix_backward)
    for mb in (6, 2, 1):
        pol = Policy("p", copy.deepcopy(model), None, lr=1.0, weight_decay=0.0)
        pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1.0)
        before = [p.clone() for p in pol.parameters()]
        update_policy(pol, samples, UpdateParams(loss=LossConfig(), micro_batch_size=mb, max_grad_norm=1e9), tok.pad_token_id, [eos])
        steps.append(torch.cat([(b - p.detach()).flatten() for b, p in zip(before, pol.parameters())]))
    assert steps[0].abs().sum() > 0
    for step in steps[1:]:
        assert torch.allclose(steps[0], step, atol=1e-6, rtol=1e-4)


def test_shared_prefix_backward_in_passes_equals_one_backward(tiny):
    from teamrl.policies.logprobs import build_shared_prefix_batch, shared_prefix_backward, shared_prefix_logprobs

    model, tok = tiny
    prompts, comps = _two_shared_prompts(tok.eos_token_id)
    batch = build_shared_prefix_batch(prompts, comps, tok.pad_token_id)
    w = torch.randn(5, 6, generator=torch.Generator().manual_seed(1)) * batch.completion_pad_mask
    model.zero_grad()
    lp, _ = shared_prefix_logprobs(model, batch, 0.8)
    (lp * w).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    for rows_per_pass in (1, 2, 5):
        model.zero_grad()
        seen = []
        def loss_of(rows, logp, ent):
            seen.append((rows.start, rows.stop))
            assert ent is not None and torch.allclose(logp, lp[rows], atol=1e-5)
            return (logp * w[rows]).sum()
        shared_prefix_backward(model, batch, rows_per_pass, loss_of, 0.8, with_entropy=True)
        assert seen == [(s, min(5, s + rows_per_pass)) for s in range(0, 5, rows_per_pass)]
        for a, p in zip(want, model.parameters()):
            assert torch.allclose(a, p.grad, atol=1e-5), rows_per_pass


def test_freed_memory_goes_back_to_the_os_before_every_micro_batch_and_pass(tiny, monkeypatch):
    """The update trims the heap before each micro-batch and each pass of a shared-prompt group, so that
    the activations the last one freed do not add to the resident set under the next (demo: ~300 MB)."""
    import teamrl.policies.logprobs as logprobs
    import teamrl.trainer.update as update

    model, tok = tiny
    eos = tok.eos_token_id
    samples = [Sample(role="agent", policy="p", problem_id=i // 3, prompt_ids=[256, 40 + i // 3, 41],
                      completion_ids=[70 + i] * (1 + i % 3) + [eos], sampling_logprobs=[], advantage=float(i % 2) - 0.5)
               for i in range(6)]
    events = []
    monkeypatch.setattr(update, "trim_freed_memory", lambda: events.append("trim"))
    monkeypatch.setattr(logprobs, "trim_freed_memory", lambda: events.append("trim"))
    completion_logits = logprobs._completion_logits
    monkeypatch.setattr(logprobs, "_completion_logits", lambda *a: events.append("pass") or completion_logits(*a))
    for mb, want in ((6, ["trim", "pass"]), (1, ["trim", "pass"] * 3 * 2)):
        events.clear()
        update_policy(Policy("p", copy.deepcopy(model), None, lr=1e-3, weight_decay=0.0), samples,
                      UpdateParams(loss=LossConfig(), micro_batch_size=mb), tok.pad_token_id, [eos])
        assert events == want, mb


def test_rows_per_pass_are_as_even_as_possible():
    from teamrl.trainer.update import _rows_per_pass

    assert [_rows_per_pass(n, 4) for n in (1, 4, 5, 8, 9, 16)] == [1, 4, 3, 4, 3, 4]
    assert _rows_per_pass(4, 2) == 2 and _rows_per_pass(3, 2) == 2 and _rows_per_pass(7, 1) == 1


def test_micro_batch_plan_splits_prompts_whose_padding_would_cost_much():
    from teamrl.trainer.update import _plan_micro_batches

    a, b, c = (1,) * 480, (2,) * 570, (3,) * 575
    prompts = [a] * 4 + [b] * 4 + [c] * 4
    parts = _plan_micro_batches(prompts, [32] * 12, size=16)
    # 480 vs 570: 90 of 1140 padded prompt positions, ~7% of all positions -> split; 570 vs 575 stay together
    assert parts == [slice(0, 4), slice(4, 12)]
    # a prompt's samples are never split (its prompt runs once; update_policy runs its completions in passes)
    assert _plan_micro_batches(prompts, [32] * 12, size=3) == [slice(0, 4), slice(4, 8), slice(8, 12)]
    assert _plan_micro_batches(prompts, [32] * 12, size=8) == [slice(0, 4), slice(4, 12)]
    assert _plan_micro_batches(prompts, [32] * 12, size=7) == [slice(0, 4), slice(4, 8), slice(8, 12)]
    # short prompts with long completions: the padding is cheap, so one micro-batch
    assert _plan_micro_batches([(1,) * 40] * 4 + [(2,) * 45] * 4, [160] * 8, size=16) == [slice(0, 8)]


def test_update_split_for_padding_equals_one_padded_micro_batch(tiny, monkeypatch):
    import teamrl.trainer.update as upd

    model, tok = tiny
    eos = tok.eos_token_id
    lens = [3, 12, 12, 25]  # very different prompt lengths: the plan splits them
    samples = [Sample(role="agent", policy="p", problem_id=i // 2, prompt_ids=[256] + [40 + i // 2] * lens[i // 2],
                      completion_ids=[70 + i] * (1 + i % 3) + [eos], sampling_logprobs=[], advantage=float(i % 2) - 0.5)
               for i in range(8)]
    assert len(upd._plan_micro_batches([tuple(s.prompt_ids) for s in samples], [len(s.completion_ids) for s in samples], 16)) > 1
    steps = []
    for share in (upd.MAX_PADDING_SHARE, 1.0):  # 1.0: never split for padding -> one micro-batch
        monkeypatch.setattr(upd, "MAX_PADDING_SHARE", share)
        pol = Policy("p", copy.deepcopy(model), None, lr=1.0, weight_decay=0.0)
        pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1.0)
        before = [p.clone() for p in pol.parameters()]
        update_policy(pol, samples, UpdateParams(loss=LossConfig(), micro_batch_size=16, max_grad_norm=1e9), tok.pad_token_id, [eos])
        steps.append(torch.cat([(b - p.detach()).flatten() for b, p in zip(before, pol.parameters())]))
    assert steps[0].abs().sum() > 0
    assert torch.allclose(steps[0], steps[1], atol=1e-6, rtol=1e-4)


def _counting_logprobs(monkeypatch):
    """Wrap the update's log-prob pass; the returned list grows by each micro-batch's sample count."""
    import teamrl.trainer.update as upd

    rows: list[int] = []
    real = upd._logprobs

    def counted(model, batch, *a, **k):
        rows.append(batch.completion_ids.shape[0])
        return real(model, batch, *a, **k)

    monkeypatch.setattr(upd, "_logprobs", counted)
    return rows


def test_zero_advantage_samples_are_not_computed_and_the_step_is_unchanged(tiny, monkeypatch):
    """A sample with advantage 0 adds nothing to the loss or its gradient (no KL term), so the update
    skips its forward and backward passes but keeps it in the normalisation: the step equals the
    full batch's for every aggregation."""
    model, tok = tiny
    advs = [1.0, 0.0, -0.5, 0.0, 0.0, 2.0, 0.0]
    samples = [_sample(i, tok, a) for i, a in enumerate(advs)]
    rows = _counting_logprobs(monkeypatch)
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"):
        full = _grads(model, [s.prompt_ids for s in samples], [s.completion_ids for s in samples], advs,
                      tok.pad_token_id, [tok.eos_token_id], agg, max_completion_length=8)
        pol = Policy("p", copy.deepcopy(model), None, lr=1.0, weight_decay=0.0)
        pol.optimizer = torch.optim.SGD(pol.parameters(), lr=1.0)  # the step equals minus the gradient
        before = {n: p.detach().clone() for n, p in pol.model.named_parameters()}
        rows.clear()
        update_policy(pol, samples, UpdateParams(loss=LossConfig(aggregation=agg, max_completion_length=8),
                                                   max_grad_norm=1e9),
                      tok.pad_token_id, [tok.eos_token_id])
        assert sum(rows) == 3, (agg, rows)  # only the three samples with a non-zero advantage ran
        for n, p in pol.model.named_parameters():
            assert torch.allclose(before[n] - p.detach(), full[n], atol=1e-6, rtol=1e-4), (agg, n)


def test_an_all_zero_advantage_update_runs_no_pass_and_takes_no_step(tiny, monkeypatch):
    """No forward pass at all, and no optimizer step (issue 55: no update without signal): AdamW's momentum and
    weight decay do not move the weights, its moments stay as they were, the statistics say why."""
    model, tok = tiny
    settings = UpdateParams(loss=LossConfig())
    moved = Policy("p", copy.deepcopy(model), None, lr=1e-2, weight_decay=0.1)
    update_policy(moved, [_sample(i, tok, a) for i, a in enumerate([1.0, -1.0, 0.5])], settings,
                  tok.pad_token_id, [tok.eos_token_id])  # builds up momentum
    reference = copy.deepcopy(moved)
    rows = _counting_logprobs(monkeypatch)
    stats = update_policy(moved, [_sample(i, tok, 0.0) for i in range(4)], settings, tok.pad_token_id, [tok.eos_token_id])
    assert rows == []
    assert moved.version == reference.version == 1
    assert stats["grad_norm"] == 0.0 and stats["loss"] == 0.0
    assert stats["skipped_no_signal"] == 1.0 and stats["skipped_steps"] == 1.0
    for a, b in zip(moved.parameters(), reference.parameters()):
        assert torch.equal(a.detach(), b.detach())
    moments = [(moved.optimizer.state[a], reference.optimizer.state[b])
               for a, b in zip(moved.parameters(), reference.parameters())]
    assert all(x for x, _ in moments) and all(torch.equal(x[k], y[k]) for x, y in moments for k in x)


def test_logged_kl_clip_frac_and_loss_do_not_depend_on_the_micro_batch_size(tiny):
    """The statistics are of the whole batch, like the gradient: ``kl`` and ``clip_frac`` are token means over every
    loss token and ``loss`` is the aggregation's full-batch value, at any micro-batch size (issue 43.5: ``kl``
    0.03151, 0.02954, 0.02970, 0.02913 at micro-batch 1, 2, 3, 16 against 0.028953 under ``seq_mean_token_mean``)."""
    model, tok = tiny
    samples = [_sample(i, tok, a) for i, a in enumerate([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.1])]
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"):
        logged = []
        for mb in (1, 2, 3, 16):
            pol = Policy("p", copy.deepcopy(model), None, lr=0.02, weight_decay=0.0, reference_model=copy.deepcopy(model))
            loss = LossConfig(aggregation=agg, max_completion_length=8, kl_coef=0.1, eps_low=0.05, eps_high=0.05)
            # two PPO epochs: the second one's statistics are logged, after a step has moved the policy off the reference
            st = update_policy(pol, samples, UpdateParams(loss=loss, ppo_epochs=2, micro_batch_size=mb, max_grad_norm=1e9),
                               tok.pad_token_id, [tok.eos_token_id])
            logged.append({k: st[k] for k in ("kl", "clip_frac", "loss")})
        assert logged[0]["kl"] > 1e-4 and logged[0]["clip_frac"] > 0, (agg, logged[0])
        for mb, got in zip((2, 3, 16), logged[1:]):
            for k in ("kl", "clip_frac", "loss"):
                assert abs(got[k] - logged[0][k]) <= 1e-6, (agg, k, mb, got[k], logged[0][k])


def test_a_shared_prefix_batch_marks_the_same_completion_tokens_as_a_plain_batch():
    """The loss mask of a step (completion_mask over completion_pad_mask) must not depend on whether the prompts
    repeat: a shared-prefix batch that dropped each completion's last token (the mutant logprobs.shared_pad_mask_short,
    which survived) would leave a completion without EOS one token short of the loss."""
    from teamrl.policies.logprobs import build_shared_prefix_batch

    prompts = [[5, 6, 7], [5, 6, 7], [8, 9]]
    completions = [[11, 12, 2], [13, 14, 15, 16], [17]]  # EOS (2), no EOS (cut at max_new_tokens), one token
    shared, plain = build_shared_prefix_batch(prompts, completions, 0), build_token_batch(prompts, completions, 0)
    assert torch.equal(shared.completion_pad_mask, plain.completion_pad_mask.bool())
    assert torch.equal(completion_mask(shared.completion_ids, [2], shared.completion_pad_mask),
                       completion_mask(plain.completion_ids, [2], plain.completion_pad_mask))
    assert int(completion_mask(shared.completion_ids, [2], shared.completion_pad_mask).sum()) == 3 + 4 + 1


def test_update_params_is_a_plain_dataclass_whose_train_fields_default_to_train_configs():
    """Issue 58 item 4: UpdateParams was built with make_dataclass at import time (neither a reader nor mypy saw its
    fields). A plain dataclass now; its train fields are UPDATE_FIELDS with TrainConfig's defaults, one source."""
    import dataclasses

    from teamrl.core.config import TrainConfig
    from teamrl.trainer.update import UPDATE_FIELDS, UpdateParams

    fields = {f.name: f for f in dataclasses.fields(UpdateParams)}
    assert set(fields) == {"loss", "roles", *UPDATE_FIELDS}
    train = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name in UPDATE_FIELDS:
        assert (fields[name].default, fields[name].type) == (train[name].default, train[name].type), name
