"""The mutants ``tools/mutate.py`` runs: one realistic one-line bug each in the code a training step's
numbers depend on (advantages, losses, log-probs, the update, returns, group keys, reward assignment,
sampling).

Each entry names the exact original snippet (it must occur exactly once in the file; when the code
changes, the tool reports the mutant STALE until the snippet here is updated), the replacement, the
small set of tests that should catch it, and what the bug would do. ``equivalent`` gives the reason
a mutant cannot change behaviour; such mutants are listed but not scored.
"""

from tools.mutate import Mutant

SURV = "tests/test_mutant_survivors.py::"
KILL = "tests/test_mutation_kills.py::"

ADV = "teamrl/losses/advantages.py"
LOSS = "teamrl/losses/policy_loss.py"
UPDATE = "teamrl/trainer/update.py"
LOGP = "teamrl/policies/logprobs.py"
GRPO = "teamrl/algorithms/grpo.py"
MAGRPO = "teamrl/algorithms/magrpo.py"
ATGRPO = "teamrl/algorithms/at_grpo.py"
MGRPO = "teamrl/algorithms/m_grpo.py"
REWARDS = "teamrl/workflows/__init__.py"  # the registered workflow rewards
ADAPTERS = "teamrl/workflows/adapters.py"  # the env workflow AT-GRPO runs an environment through
ENGINE = "teamrl/rollout/hf_engine.py"

T_ADV = ("tests/test_losses.py",)
T_LOSS = ("tests/test_losses.py", SURV + "test_old_logprobs_are_constants_even_when_they_carry_a_graph",
          KILL + "test_advantages_are_constants_of_the_loss", KILL + "test_dr_grpo_accepts_a_completion_of_exactly_its_length",
          KILL + "test_kl_penalty_gradient_by_hand")
T_UPDATE = ("tests/test_update.py", SURV + "test_update_computes_logprobs_at_the_sampling_temperature",
            KILL + "test_update_clips_the_gradient_norm", KILL + "test_kl_penalty_is_against_the_reference_model",
            KILL + "test_ppo_epochs_step_from_their_own_gradient_only", KILL + "test_update_trains_no_token_after_eos",
            "tests/test_policies.py")
T_LOGP = ("tests/test_update.py", "tests/test_engine.py::test_sampling_logprobs_equal_the_trainers_logprobs",
          SURV + "test_entropy_of_a_uniform_distribution_is_log_vocab",
          SURV + "test_update_computes_logprobs_at_the_sampling_temperature",
          KILL + "test_token_logprobs_at_a_temperature",
          KILL + "test_completion_logprobs_match_a_plain_forward_with_absolute_positions")
T_GRPO = (KILL + "test_grpo_groups_every_episode_of_a_problem_together",
          "tests/test_trainer.py::test_advantages_sum_to_zero_per_group_and_max_mode_uses_greedy_baseline")
T_MAGRPO = ("tests/test_magrpo.py", SURV + "test_a_joint_action_exactly_at_the_termination_threshold_terminates",
            KILL + "test_magrpo_returns_and_groups_on_a_two_turn_tree")
T_ATGRPO = (SURV + "test_a_candidate_is_scored_with_the_team_reward_of_the_state_it_produces",
            KILL + "test_at_grpo_tree_and_trajectory_rewards_by_hand", "tests/test_at_grpo.py")
T_MGRPO = (SURV + "test_sub_trajectory_validity_is_read_from_its_last_turn",
           KILL + "test_m_grpo_rewards_and_groups_by_hand", KILL + "test_m_grpo_rollout_tags_each_sub_call_with_its_own_validity",
           "tests/test_mgrpo.py::test_alignment_gives_d_max_slots_per_rollout_whatever_the_call_counts",
           "tests/test_mgrpo.py::test_sub_rewards_follow_the_parent_outcome_as_configured",
           "tests/test_mgrpo.py::test_team_rollout_rewards_reach_sub_samples_through_parent_ids",
           "tests/test_mgrpo.py::test_frozen_sub_agent_gets_no_update_and_single_agent_has_no_sub")
T_WORKFLOW = (SURV + "test_outcome_mode_ignores_role_rewards", KILL + "test_workflow_group_key_pools_role_instances",
              "tests/test_workflows.py")
T_ENGINE = (SURV + "test_mixed_max_new_tokens_in_one_call_stop_each_row_at_its_own_length",
            KILL + "test_engine_sampling_distribution",
            KILL + "test_engine_ignore_eos_and_tokens_beyond_the_first_block",
            KILL + "test_engine_logprobs_match_a_plain_forward_with_absolute_positions", "tests/test_engine.py")

TASK = "teamrl/tasks/task.py"
TRAINER = "teamrl/trainer/trainer.py"
KILL2 = "tests/test_mutation_kills_more.py::"
T_TRAJ = ("tests/test_mgrpo_groups.py",)
T_MAGRPO_TERM = ("tests/test_magrpo_termination.py",
                 SURV + "test_a_joint_action_exactly_at_the_termination_threshold_terminates")
T_ATGRPO_NEW = T_ATGRPO + ("tests/test_repeated_problems.py", "tests/test_at_grpo_parallel.py")
T_REPEATS = ("tests/test_repeated_problems.py",)
T_OLD_LP = ("tests/test_update_old_logprobs.py", SURV + "test_update_computes_logprobs_at_the_sampling_temperature",
            KILL2 + "test_old_logprobs_across_steps_are_taken_at_the_sampling_temperature",
            KILL2 + "test_the_second_of_two_steps_clips_against_the_sampling_policy")
T_NONFINITE = ("tests/test_nonfinite.py", KILL2 + "test_drop_group_returns_every_group_holding_a_non_finite_reward",
               KILL2 + "test_a_non_finite_loss_skips_the_step_even_when_its_gradient_is_finite",
               KILL2 + "test_a_non_finite_gradient_skips_the_step_even_when_the_loss_is_finite")
T_KL_BC = ("tests/test_kl_and_aggregation_names.py",)
T_TOP_P = ("tests/test_top_p_after_top_k.py", KILL + "test_engine_sampling_distribution")

MUTANTS: list[Mutant] = [
    # --- losses/advantages.py -------------------------------------------------------------------
    Mutant("adv.biased_group_std", ADV, "std_g = (sq / (counts - 1).clamp(min=1)).sqrt()", "std_g = (sq / counts).sqrt()",
           T_ADV, "group std without Bessel's correction"),
    Mutant("adv.no_eps", ADV, "adv = centered / (std_g[inv] + eps)", "adv = centered / std_g[inv]",
           T_ADV, "eps dropped from the group std"),
    Mutant("adv.only_singletons_degenerate", ADV, "degenerate = (g_min == g_max)[inv]", "degenerate = (counts == 1)[inv]",
           T_ADV, "zero-variance groups no longer zeroed, only singletons"),
    Mutant("adv.batch_std_biased", ADV, "/ max(n - 1, 1)).sqrt()", "/ n).sqrt()",
           T_ADV, "batch std without Bessel's correction"),
    Mutant("adv.rloo_includes_self", ADV, "loo_mean = (sums[inv] - rewards) / (n_i - 1).clamp(min=1)",
           "loo_mean = sums[inv] / n_i", T_ADV, "RLOO baseline includes the sample itself"),
    Mutant("adv.remax_sign", ADV, "return rewards - baselines.to(device=rewards.device, dtype=rewards.dtype)",
           "return baselines.to(device=rewards.device, dtype=rewards.dtype) - rewards",
           T_ADV, "ReMax advantage measured against the wrong reference"),
    Mutant("adv.none_mode_falls_through", ADV, 'if mode in ("mean", "none"):', 'if mode == "mean":',
           T_ADV, "'none' (Dr. GRPO) mode computed as RLOO"),
    Mutant("adv.no_degenerate_zeroing", ADV, "return torch.where(degenerate, torch.zeros_like(adv), adv)", "return adv",
           T_ADV, "degenerate groups keep rounding noise as advantage"),
    Mutant("adv.group_ids_by_hash", ADV, "ids = [index.setdefault(key, len(index)) for key in keys]",
           "ids = [index.setdefault(key, len(index)) for key in sorted(keys, key=repr)]",
           T_ADV, "keys sorted before numbering: ids no longer line up with the samples"),

    # --- losses/policy_loss.py ------------------------------------------------------------------
    Mutant("loss.old_not_detached", LOSS, "logprobs - old_logprobs.detach(), zero)", "logprobs - old_logprobs, zero)",
           T_LOSS, "old log-probs carry gradient (issue 20 survivor)"),
    Mutant("loss.adv_not_detached", LOSS, "adv = advantages.detach().to(logprobs.dtype)", "adv = advantages.to(logprobs.dtype)",
           T_LOSS, "advantages carry gradient"),
    Mutant("loss.upper_clip_uses_eps_low", LOSS, "1.0 - cfg.eps_low, 1.0 + cfg.eps_high)", "1.0 - cfg.eps_low, 1.0 + cfg.eps_low)",
           T_LOSS, "clip-higher ignored: upper clip at 1 + eps_low"),
    Mutant("loss.max_instead_of_min", LOSS, "loss_t = -torch.minimum(ratio * adv, clipped_ratio * adv)",
           "loss_t = -torch.maximum(ratio * adv, clipped_ratio * adv)", T_LOSS, "pessimistic bound inverted"),
    Mutant("loss.dual_clip_sign", LOSS, "loss_t = torch.where(adv < 0, torch.minimum", "loss_t = torch.where(adv > 0, torch.minimum",
           T_LOSS, "dual clip applied to positive advantages"),
    Mutant("loss.dual_clip_max", LOSS, "torch.minimum(loss_t, -cfg.dual_clip * adv)", "torch.maximum(loss_t, -cfg.dual_clip * adv)",
           T_LOSS, "dual clip raises instead of caps the loss"),
    Mutant("loss.kl_direction", LOSS, "delta = torch.where(m, ref_logprobs.detach() - logprobs, zero)",
           "delta = torch.where(m, logprobs - ref_logprobs.detach(), zero)", T_LOSS, "k3 of the reversed log-ratio"),
    Mutant("loss.kl_no_grad", LOSS, "delta = torch.where(m, ref_logprobs.detach() - logprobs, zero)",
           "delta = torch.where(m, ref_logprobs - logprobs.detach(), zero)", T_LOSS, "KL penalty gives no gradient to the policy"),
    Mutant("loss.k3_minus_one_missing", LOSS, "kl_t = torch.exp(delta) - delta - 1.0", "kl_t = torch.exp(delta) - delta",
           T_LOSS, "k3 estimator off by a constant 1"),
    Mutant("loss.masked_loss_kept", LOSS, "loss_t = torch.where(m, loss_t, zero)\n", "\n",
           T_LOSS, "masked positions keep their -A loss"),
    Mutant("loss.token_mean_over_all_positions", LOSS, "loss = loss_t.sum() / n_tokens", "loss = loss_t.mean()",
           T_LOSS, "token_mean divides by padded positions"),
    Mutant("loss.seq_mean_token_mean_no_batch_division", LOSS,
           "(loss_t.sum(dim=1) / m_f.sum(dim=1).clamp(min=1.0)).sum() / max(batch_size, 1)",
           "(loss_t.sum(dim=1) / m_f.sum(dim=1).clamp(min=1.0)).sum()", T_LOSS, "seq_mean_token_mean sums over sequences"),
    Mutant("loss.seq_mean_token_sum_token_mean", LOSS, "loss = loss_t.sum(dim=1).sum() / max(batch_size, 1)",
           "loss = loss_t.sum(dim=1).sum() / n_tokens", T_LOSS, "seq_mean_token_sum divided by tokens"),
    Mutant("loss.dr_grpo_boundary", LOSS, "if longest > cfg.max_completion_length:", "if longest >= cfg.max_completion_length:",
           T_LOSS, "dr_grpo rejects a completion of exactly max_completion_length"),
    Mutant("loss.dr_grpo_no_batch", LOSS, "loss_t.sum() / max(batch_size * cfg.max_completion_length, 1)",
           "loss_t.sum() / max(cfg.max_completion_length, 1)", T_LOSS, "dr_grpo denominator misses the batch size"),
    Mutant("loss.mask_drops_first_eos", LOSS, "eos_before = torch.cumsum(is_eos.to(torch.int32), dim=1) - is_eos.to(torch.int32)",
           "eos_before = torch.cumsum(is_eos.to(torch.int32), dim=1)", T_LOSS, "the EOS token itself gets no loss"),
    Mutant("loss.mask_eos_in_padding", LOSS, "is_eos = torch.isin(completion_ids, eos_tensor) & real",
           "is_eos = torch.isin(completion_ids, eos_tensor)", T_LOSS, "an EOS id at a padding position truncates"),

    # --- trainer/update.py ----------------------------------------------------------------------
    Mutant("update.ignores_temperature", UPDATE, "t = sample_temperatures(samples[sl])\n", "t = 1.0\n",
           T_UPDATE, "training log-probs ignore the sampling temperature (issue 20 survivor)"),
    Mutant("update.token_weight_per_micro_batch", UPDATE, "token_share = int(mr.sum()) / plan.total_tokens",
           "token_share = 1 / len(plan.micro_batches)", T_UPDATE, "micro-batches weighted equally, not by tokens"),
    Mutant("update.old_logprobs_recomputed", UPDATE, "old_lp = logp.detach() if mb.old is None else mb.old[rows]",
           "old_lp = logp.detach()", T_UPDATE, "later PPO epochs never clip (old log-probs follow the policy)"),
    Mutant("update.no_grad_clip", UPDATE, "clip_grad_norm_(policy.parameters(), settings.max_grad_norm)",
           "clip_grad_norm_(policy.parameters(), float('inf'))", T_UPDATE, "gradient norm not clipped"),
    Mutant("update.post_eos_tokens_trained", UPDATE, "completion_mask(b.completion_ids, list(eos_ids), b.completion_pad_mask)",
           "completion_mask(b.completion_ids, [], b.completion_pad_mask)", T_UPDATE, "tokens after EOS carry loss"),
    Mutant("update.total_tokens_padded", UPDATE,
           "tokens = int(_loss_mask([s.completion_ids for s in samples], eos_ids, pad_id).sum()) if samples else 0",
           "tokens = sum(len(s.completion_ids) for s in samples)", T_UPDATE,
           "token weights count the tokens after EOS"),
    Mutant("update.kl_to_itself", UPDATE, "mb.ref = _logprobs(ref_model, mb.batch, mb.temperature)[0]",
           "mb.ref = _logprobs(model, mb.batch, mb.temperature)[0]", T_UPDATE, "KL measured against the policy itself"),
    Mutant("update.grads_accumulate_over_epochs", UPDATE,
           "    for epoch in range(settings.ppo_epochs):\n        policy.optimizer.zero_grad(set_to_none=True)\n",
           "    for epoch in range(settings.ppo_epochs):\n", T_UPDATE, "gradients of earlier PPO epochs leak into later steps"),
    Mutant("update.micro_batch_size_plus_one", UPDATE, "full = bool(lens) and group_end - start > size",
           "full = bool(lens) and group_end - start > size + 1",
           T_UPDATE, "micro-batches one sample larger than configured"),
    Mutant("update.always_shared_prefix", UPDATE, "if share and len({tuple(p) for p in prompts}) < len(prompts):",
           "if share and len({tuple(p) for p in prompts}) <= len(prompts):", T_UPDATE, "shared-prefix pass also for distinct prompts",
           equivalent="the shared-prefix pass is exact for any batch (test_shared_prompt_pass_gives_the_same_logprobs_"
                      "and_gradients); only its speed differs"),

    # --- policies/logprobs.py -------------------------------------------------------------------
    Mutant("logprobs.entropy_mean", LOGP, "entropy = -(logp_all.exp() * logp_all).sum(-1)",
           "entropy = -(logp_all.exp() * logp_all).mean(-1)", T_LOGP, "entropy averaged over the vocabulary (issue 20 survivor)"),
    Mutant("logprobs.temperature_multiplies", LOGP, "return logits / temperature if", "return logits * temperature if",
           T_LOGP, "logits multiplied by the temperature"),
    Mutant("logprobs.logits_shifted", LOGP, "out.logits[:, :-1, :]", "out.logits[:, 1:, :]",
           T_LOGP, "each token scored by the logits of the next position"),
    Mutant("logprobs.positions_from_one", LOGP, "pos = (mask.cumsum(-1) - 1).clamp(min=0)", "pos = mask.cumsum(-1).clamp(min=0)",
           T_LOGP, "position ids start at 1"),
    Mutant("logprobs.completion_not_attended", LOGP, "mask[i, P - len(p):P + len(c)] = 1", "mask[i, P - len(p):P + len(c) - 1] = 1",
           T_LOGP, "the last completion token is masked out"),
    Mutant("logprobs.shared_positions_off_by_one", LOGP, "cpos = plen.unsqueeze(1) + torch.arange(T",
           "cpos = plen.unsqueeze(1) + 1 + torch.arange(T", T_LOGP, "shared-prefix completion positions shifted"),
    Mutant("logprobs.shared_pad_mask_short", LOGP, "cmask[i, :len(c)] = True", "cmask[i, :len(c) - 1] = True",
           T_LOGP, "shared-prefix batch drops each completion's last token"),
    Mutant("logprobs.passes_drop_prompt_gradient", LOGP, "    if outputs:\n        torch.autograd.backward(",
           "    if False:\n        torch.autograd.backward(", T_LOGP,
           "completions run in passes never carry their gradient back through the prompt pass"),
    Mutant("logprobs.shared_prompt_mask_pad", LOGP, "pmask[i, P - len(p):] = 1", "pmask[i, :] = 1",
           T_LOGP, "shared-prefix prompts attend to their left padding"),

    # --- algorithms/grpo.py ---------------------------------------------------------------------
    Mutant("grpo.group_per_episode", GRPO, "s.group = (s.problem_id,) if per_problem", "s.group = (s.problem_id, s.episode) if per_problem",
           T_GRPO, "every episode its own group (all advantages 0)"),
    Mutant("grpo.one_episode_short", GRPO, "run, self.group_size, extra)", "run, self.group_size - 1, extra)",
           T_GRPO, "G - 1 episodes per problem"),
    Mutant("grpo.baseline_not_greedy", GRPO, 'extra = [(p, -1, {"greedy": True})', 'extra = [(p, -1, {})',
           T_GRPO, "ReMax baseline sampled instead of greedy"),

    # --- algorithms/magrpo.py -------------------------------------------------------------------
    Mutant("magrpo.threshold_strict", MAGRPO, "reward / self.max_reward >= t", "reward / self.max_reward > t",
           T_MAGRPO, "a reward exactly at the threshold does not terminate (issue 20 survivor)"),
    Mutant("magrpo.threshold_unnormalised", MAGRPO, "reward / self.max_reward >= t", "reward >= t",
           T_MAGRPO, "termination threshold compared with the raw reward"),
    Mutant("magrpo.no_discount", MAGRPO, "return reward + (gamma * sum(child_returns)", "return reward + (sum(child_returns)",
           T_MAGRPO, "gamma ignored"),
    Mutant("magrpo.children_summed", MAGRPO, "sum(child_returns) / len(child_returns) if child_returns",
           "sum(child_returns) if child_returns", T_MAGRPO, "children's returns summed, not averaged"),
    Mutant("magrpo.group_key_without_path", MAGRPO, 'return (sample.problem_id, sample.role, sample.turn, sample.tags.get("path", ()))',
           "return (sample.problem_id, sample.role, sample.turn)", T_MAGRPO, "sibling nodes of a turn pooled in one group"),
    Mutant("magrpo.one_turn_too_many", MAGRPO, "call_position(branch.ctx.calls, c) < self.config.num_turns",
           "call_position(branch.ctx.calls, c) <= self.config.num_turns",
           T_MAGRPO + ("tests/test_magrpo_depth.py",), "each role's calls branched one turn more than num_turns"),
    Mutant("magrpo.returns_not_used", MAGRPO, "per_sample = completion_returns(joint, returns, G, len(frontier))",
           "per_sample = completion_returns(joint, rewards, G, len(frontier))", T_MAGRPO, "sample rewards ignore later turns"),
    Mutant("magrpo.cross_count_once", MAGRPO, "count[a][j] += 1", "count[a][j] = 1",
           T_MAGRPO, "cross-mode return is a sum, not a mean"),
    Mutant("magrpo.child_without_history", MAGRPO, "self._walk(real, copies[k], depth + 1,",
           "self._walk(real, copies[0], depth + 1,",
           T_MAGRPO, "a child node continues from the first joint action's history, not its parent's"),

    # --- algorithms/at_grpo.py ------------------------------------------------------------------
    Mutant("at_grpo.team_reward_of_old_state", ADAPTERS, '"team_reward", environment.team_reward(new_state)',
           '"team_reward", environment.team_reward(state)', T_ATGRPO,
           "candidate scored with the team reward of the pre-action state (issue 20 survivor)"),
    Mutant("at_grpo.tree_key_without_turn", ATGRPO, "return (sample.problem_id, sample.turn, sample.role)",
           "return (sample.problem_id, sample.role)", T_ATGRPO, "tree groups pool every turn"),
    Mutant("at_grpo.trajectory_key_with_turn", ATGRPO, "return (sample.problem_id, sample.role)\n",
           "return (sample.problem_id, sample.turn, sample.role)\n", T_ATGRPO, "trajectory groups split by turn"),
    Mutant("at_grpo.alpha_ignored_tree", ATGRPO, "s.reward = local + self.config.alpha * team",
           "s.reward = local + team", T_ATGRPO, "tree scores ignore alpha"),
    Mutant("at_grpo.alpha_ignored_trajectory", ATGRPO, "s.reward = local + self.config.alpha * result.team_return",
           "s.reward = local + result.team_return", T_ATGRPO, "trajectory rewards ignore alpha"),
    Mutant("at_grpo.first_branch_continues", ATGRPO, "branch = copies[chosen[0]]", "branch = copies[0]",
           T_ATGRPO, "the first candidate's state continues, not the chosen one's"),
    Mutant("at_grpo.greedy_picks_min", ATGRPO, "best = max(scores)", "best = min(scores)",
           T_ATGRPO, "greedy selection picks the worst candidate"),
    # one line of the env workflow now serves the tree and trajectory groupings: the old tree-only mutant
    # at_grpo.parallel_observes_state is this one
    Mutant("at_grpo.trajectory_parallel_sees_state", ADAPTERS, "environment.observe(before if environment.parallel else state, role)",
           "environment.observe(state, role)", T_ATGRPO_NEW, "parallel agents see the turn's earlier actions"),
    Mutant("at_grpo.max_turns_ignored", ATGRPO, "max_turns=self.config.max_turns)", "max_turns=0)",
           T_ATGRPO, "at_grpo.max_turns ignored"),
    Mutant("at_grpo.silent_role_not_played_out", ATGRPO, "            if played:  #", "            if False:  #",
           ("tests/test_every_key.py",), "an early role whose reward arrives after its segment scores 0 (issue 35)"),

    # --- algorithms/m_grpo.py -------------------------------------------------------------------
    Mutant("m_grpo.validity_from_first_turn", MGRPO, 'valid = bool(samples[-1].tags.get("format_valid", False))',
           'valid = bool(samples[0].tags.get("format_valid", False))', T_MGRPO,
           "sub-trajectory validity read from its first turn (issue 20 survivor)"),
    Mutant("m_grpo.sub_key_pooled_with_main", MGRPO, 'return (sample.problem_id, "sub")', "return (sample.problem_id,)",
           T_MGRPO, "sub samples compared with main samples"),
    Mutant("m_grpo.outcome_of_first_rollout", MGRPO, "r = sub_reward(outcomes[(pid, eps[i])], valid, mode)",
           "r = sub_reward(outcomes[(pid, eps[0])], valid, mode)", T_MGRPO, "sub reward from the question's first rollout"),
    Mutant("m_grpo.one_duplicate_short", MGRPO, "rng.choices(range(n), k=d_max - n)", "rng.choices(range(n), k=d_max - n - 1)",
           T_MGRPO, "rollouts with few calls get d_max - 1 slots"),
    Mutant("m_grpo.no_call_rollout_short", MGRPO, "slots[i] = rng.choices(pool, k=d_max)", "slots[i] = rng.choices(pool, k=d_max - 1)",
           T_MGRPO, "rollouts without calls get d_max - 1 slots"),
    Mutant("m_grpo.duplicates_not_copied", MGRPO, "dup = key in used", "dup = False",
           T_MGRPO, "duplicates are the same Sample objects, not tagged copies"),
    Mutant("m_grpo.validity_of_first_call", MGRPO, 'calls[s.tags["call"]].format_valid if calls', "calls[0].format_valid if calls",
           T_MGRPO, "every call's validity taken from the rollout's first call"),
    Mutant("m_grpo.frozen_ignored", MGRPO, 'frozen=self.config.sub_agent == "frozen")', "frozen=False)",
           T_MGRPO, "a frozen sub-agent is trained"),
    Mutant("m_grpo.keep_all_at_d_max", MGRPO, "if n >= d_max:", "if n > d_max:", T_MGRPO,
           "a rollout with exactly d_max calls takes the duplicate branch",
           equivalent="with n == d_max both branches keep calls 0..n-1 in order and add no duplicate; only the "
                      "RNG stream (which later random draws are made) differs, not their distribution"),

    # --- the workflow study's GRPO (algorithms/grpo.py) and its rewards (workflows/__init__.py) --
    Mutant("workflow.role_reward_in_outcome_mode", REWARDS, '(1 or 0)."""\n    return outcome.reward',
           '(1 or 0)."""\n    return own_reward(sample) if own_reward(sample) is not None else outcome.reward',
           T_WORKFLOW, "per-role reward used in outcome mode (issue 20 survivor)"),
    Mutant("workflow.role_reward_ignored", REWARDS, "return own if own is not None else outcome.reward",
           "return outcome.reward", T_WORKFLOW, "per_role mode never uses the role's reward"),
    Mutant("workflow.key_by_instance", GRPO, "return (sample.problem_id, role_type(sample.role), sample.turn)",
           "return (sample.problem_id, sample.role, sample.turn)", T_WORKFLOW, "generator instances not pooled"),
    Mutant("workflow.key_without_turn", GRPO, "return (sample.problem_id, role_type(sample.role), sample.turn)",
           "return (sample.problem_id, role_type(sample.role))", T_WORKFLOW, "a role's steps pooled across turns"),

    # --- rollout/hf_engine.py (sampling) --------------------------------------------------------
    Mutant("engine.length_off_by_one", ENGINE, "length_hit = max_new.index_select(0, live) <= t + 1",
           "length_hit = max_new.index_select(0, live) <= t", T_ENGINE,
           "max_new_tokens off by one with mixed lengths (issue 20 survivor)"),
    Mutant("engine.top_k_keeps_one_more", ENGINE, "(rank >= k.unsqueeze(1))", "(rank > k.unsqueeze(1))",
           T_ENGINE, "top-k keeps k + 1 tokens"),
    Mutant("engine.top_p_drops_crossing_token", ENGINE, "mass_before = (kept.cumsum(-1) - kept) /",
           "mass_before = kept.cumsum(-1) /", T_ENGINE, "top-p drops the token that crosses p"),
    Mutant("engine.top_p_ignored_without_top_k", ENGINE, "filt = ((top_k > 0) & (top_k < V)) | (top_p < 1)",
           "filt = (top_k > 0) & (top_k < V)", T_ENGINE, "top-p only applied together with top-k"),
    Mutant("engine.logprob_unnormalised", ENGINE, "logp = scaled.gather(-1, tok.unsqueeze(1)) - peak - log_z",
           "logp = scaled.gather(-1, tok.unsqueeze(1)) - peak", T_ENGINE, "sampling log-probs not normalised"),
    Mutant("engine.temperature_multiplies", ENGINE, "scaled = scaled / torch.where(greedy", "scaled = scaled * torch.where(greedy",
           T_ENGINE, "logits multiplied by the temperature"),
    Mutant("engine.ignore_eos_ignored", ENGINE, "eos_hit = torch.isin(nxt, self.eos_ids) & ~ignore_eos.index_select(0, live)",
           "eos_hit = torch.isin(nxt, self.eos_ids)", T_ENGINE, "ignore_eos has no effect"),
    Mutant("engine.inverse_cdf_block_offset", ENGINE, "return (b * _BLOCK + j).squeeze(1)", "return (b * (_BLOCK - 1) + j).squeeze(1)",
           T_ENGINE, "tokens past the first block of 256 drawn one index low per block"),
    Mutant("engine.inverse_cdf_left", ENGINE, "j = torch.searchsorted(inner, target - before, right=True)",
           "j = torch.searchsorted(inner, target - before, right=False)", T_ENGINE, "inverse CDF can pick a zero-weight token",
           equivalent="differs only when a uniform draw lands exactly on a cumulative weight (probability ~2^-24 per "
                      "draw); then it picks the token before, whose weight may be 0"),
    Mutant("engine.positions_not_advanced", ENGINE, "last_pos = last_pos + 1\n", "last_pos = last_pos\n",
           T_ENGINE, "decode steps reuse the last position id"),
    Mutant("engine.prefill_positions_from_one", ENGINE, "pos = (attn.cumsum(-1) - 1).clamp(min=0)", "pos = attn.cumsum(-1).clamp(min=0)",
           T_ENGINE, "prompt position ids start at 1"),
    Mutant("engine.greedy_samples", ENGINE, "tok = torch.where(greedy, scaled.argmax(-1), tok)", "tok = tok",
           T_ENGINE, "temperature 0 samples instead of taking the argmax"),
    Mutant("engine.prefill_group_boundary", ENGINE, "<= MAX_PREFILL_PADDING and", "< MAX_PREFILL_PADDING and",
           T_ENGINE, "prefill groups split at exactly 5% padding",
           equivalent="prefill grouping only changes how the prompts' forward is split; the cache and logits are the "
                      "same (test_prefill_grouped_by_length_equals_one_padded_prefill)"),
    # --- code added by issue 13's fixes -----------------------------------------------------------
    # M-GRPO trajectory groups (losses/advantages.py)
    Mutant("adv.trajectory_samples_weighted", ADV, "if len(units) == rewards.numel():", "if len(units) <= rewards.numel():",
           T_TRAJ, "every sample counts in its group's statistics, not every trajectory once"),
    Mutant("adv.trajectory_id_as_group", ADV, "group_advantages(rewards[first], units[:, 0], mode",
           "group_advantages(rewards[first], units[:, 1], mode", T_TRAJ,
           "trajectories grouped by their trajectory id instead of their group id"),
    Mutant("adv.trajectory_rewards_unchecked", ADV, "if not bool(same.all()):", "if False:", T_TRAJ,
           "turns of one trajectory with different rewards accepted (the first one's reward silently used)"),
    Mutant("adv.trajectory_tag_ignored", ADV, 'else ("trajectory", k) for i, k', 'else ("trajectory", i) for i, k',
           T_TRAJ, "trajectory keys ignored: every sample its own trajectory"),
    Mutant("adv.untagged_sample_joins_a_trajectory", ADV, '("sample", i) if k is None', '("trajectory", i) if k is None',
           T_TRAJ, "a sample without a trajectory key i shares the trajectory keyed i"),
    # MAGRPO: a terminated success is credited for every remaining turn
    Mutant("magrpo.terminated_own_turn_not_counted", MAGRPO, "left = max(self.config.num_turns - first, levels - depth)\n",
           "left = max(self.config.num_turns - first, levels - depth) - 1\n", T_MAGRPO_TERM, "a terminated action credited one turn short"),
    Mutant("magrpo.terminated_levels_from_call_position", MAGRPO, "left = max(self.config.num_turns - first, levels - depth)\n",
           "left = self.config.num_turns - first\n", T_MAGRPO_TERM,
           "a terminated action in a sequential workflow credited once, not for every level below it (the audit of d3e8a20)"),
    Mutant("context.sub_episode_not_refused", "teamrl/workflows/context.py", "        if self.refuse_sub_episodes:",
           "        if False:", ("tests/test_protocol_algorithms.py",),
           "a sub-episode opened under grpo, magrpo or at_grpo runs on silently, unaligned"),
    Mutant("magrpo.terminated_undiscounted", MAGRPO, "return reward * sum(gamma ** k for k in range(remaining_levels))",
           "return reward * remaining_levels", T_MAGRPO_TERM, "remaining turns of a terminated action not discounted"),
    Mutant("magrpo.terminated_discount_from_one", MAGRPO, "sum(gamma ** k for k in range(remaining_levels))",
           "sum(gamma ** k for k in range(1, remaining_levels + 1))", T_MAGRPO_TERM,
           "a terminated action's own turn discounted by gamma"),
    Mutant("magrpo.terminated_reward_once", MAGRPO, "else terminated_return(r, left, self.config.gamma) if stop[k]",
           "else r if stop[k]", T_MAGRPO_TERM, "a terminated action credited with its own reward only (the old behaviour)"),
    Mutant("magrpo.repeated_problem_one_instance", MAGRPO, "ctxs = [make_ctx(inst, 0, {}) for inst in batch_instances(problems)]",
           "ctxs = [make_ctx(inst, 0, {}) for inst in problems]", T_REPEATS + T_MAGRPO,
           "a problem drawn twice in a batch shares its groups"),
    # AT-GRPO: scoring on the post-action state, unused candidates, repeated problems
    # since the episode protocol, roles whose turn never came are not sampled at all (no unused candidates to tag):
    # the old mutants at_grpo.unused_candidates_{of_the_stopping_role,trained} become this one
    Mutant("at_grpo.unused_candidates_trained", ADAPTERS, "            if environment.done(state):\n                break\n",
           "            if False:\n                break\n", T_ATGRPO_NEW,
           "roles after the action that ended the episode still act (and are trained) in that turn"),
    Mutant("at_grpo.tree_repeated_problem_one_instance", ATGRPO,
           'ctxs = [make_ctx(inst, 0, {"grouping": "tree"}) for inst in instances]',
           'ctxs = [make_ctx(inst, 0, {"grouping": "tree"}) for inst in problems]', T_ATGRPO_NEW,
           "tree grouping: a problem drawn twice shares its groups"),
    Mutant("at_grpo.trajectory_repeated_problem_one_instance", ATGRPO, 'jobs = [(p, make_ctx(inst, e, {"grouping": "trajectory"}))',
           'jobs = [(p, make_ctx(p, e, {"grouping": "trajectory"}))', T_ATGRPO_NEW,
           "trajectory grouping: a problem drawn twice shares its groups"),
    # M-GRPO trajectory tags
    Mutant("m_grpo.sub_slots_one_trajectory", MGRPO, 't.trajectory = (eps[rollout], slot)',
           't.trajectory = eps[rollout]', T_MGRPO + T_TRAJ, "all sub slots of a rollout counted as one trajectory"),
    Mutant("m_grpo.main_turns_untagged", MGRPO, 's.trajectory = ctx.episode  #', 's.tags["turns"] = ctx.episode  #',
           T_MGRPO + T_TRAJ, "a rollout's main turns each count in the group statistics"),
    # tasks/task.py: batch_instances
    Mutant("task.third_copy_reuses_second_id", TASK, "seen[p.id] = n + 1", "seen[p.id] = n", T_REPEATS,
           "the next copy of a problem starts its search at the last copy's id",
           equivalent="the last copy's id is in `taken`, so the `while` loop steps past it to the same id as the "
                      "original (one more loop iteration, same ids)"),
    Mutant("task.copy_ids_from_one", TASK, "seen[p.id] = 2  #", "seen[p.id] = 1  #", T_REPEATS,
           "copies numbered from #1"),
    Mutant("task.copy_id_collision_unchecked", TASK, 'while f"{p.id}#{n}" in taken:', 'while False:', T_REPEATS,
           "a copy may take the id of another problem of the batch (e.g. a problem named 'x#2')"),
    # trainer/update.py: old log-probs across steps, non-finite handling
    Mutant("update.old_logprobs_ignore_temperature", UPDATE, "logp = _logprobs(model, batch, sample_temperatures(part))",
           "logp = _logprobs(model, batch, 1.0)", T_OLD_LP, "old log-probs across steps computed at temperature 1"),
    Mutant("update.two_steps_without_old_logprobs", UPDATE, "if len(parts) < 2:", "if len(parts) < 3:", T_OLD_LP,
           "with two steps the second one clips against the moved policy"),
    Mutant("update.steps_old_logprobs_dropped", UPDATE, "eos_ids, old_logprobs=o, ranks=ranks,",
           "eos_ids, old_logprobs=None, ranks=ranks,", T_OLD_LP,
           "old log-probs computed but not passed to the steps"),
    Mutant("update.given_old_logprobs_ignored", UPDATE, "if given_old:", "if False:", T_OLD_LP,
           "update_policy ignores the old log-probs it is given"),
    Mutant("update.inf_reward_accepted", UPDATE, "not math.isfinite(s.reward)]", "math.isnan(s.reward)]", T_NONFINITE,
           "an infinite reward passes the check"),
    Mutant("update.drop_only_first_group", UPDATE, "return {s.group for s in bad}", "return {s.group for s in bad[:1]}",
           T_NONFINITE, "drop_group drops only the first group holding a NaN/inf reward"),
    Mutant("update.nonfinite_loss_not_checked", UPDATE, 'totals.finite = totals.finite and math.isfinite(st["loss"])',
           "totals.finite = True", T_NONFINITE, "a non-finite loss is stepped on when its gradient norm is finite"),
    Mutant("update.nonfinite_grad_not_checked", UPDATE, "if not (totals.finite and math.isfinite(grad_norm)):",
           "if not totals.finite:", T_NONFINITE, "a non-finite gradient with a finite loss is stepped on"),
    Mutant("trainer.dropped_groups_trained", TRAINER, "train = [s for s in train if s.group not in dropped]",
           "train = [s for s in train if s.group is not dropped]", T_NONFINITE, "drop_group leaves the groups in"),
    # losses/policy_loss.py: bias-corrected KL
    Mutant("loss.kl_bias_ratio_detached", LOSS, "kl_t = kl_t * ratio\n", "kl_t = kl_t * ratio.detach()\n", T_KL_BC,
           "the bias-corrected KL's ratio carries no gradient"),
    Mutant("loss.kl_bias_ratio_clipped", LOSS, "kl_t = kl_t * ratio\n", "kl_t = kl_t * clipped_ratio\n", T_KL_BC,
           "the bias-corrected KL uses the clipped ratio"),
    Mutant("loss.kl_bias_always", LOSS, "if cfg.kl_bias_correction:", "if True:", T_KL_BC,
           "KL bias correction applied whatever the option"),
    # rollout/hf_engine.py: top-p after top-k
    Mutant("engine.top_p_before_top_k", ENGINE, "kept = sorted_w.masked_fill(drop, 0.0)", "kept = sorted_w", T_TOP_P,
           "top-p measured on the full distribution, not the top-k-renormalised one"),
    Mutant("engine.top_p_mass_of_full_distribution", ENGINE, "/ kept.sum(-1, keepdim=True)", "/ sorted_w.sum(-1, keepdim=True)",
           T_TOP_P, "top-p mass normalised by the full distribution's mass"),
]
