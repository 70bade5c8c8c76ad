"""Group-relative advantages.

Every algorithm in teamrl (GRPO, MAGRPO, AT-GRPO, M-GRPO) ends in the same step: samples carry a
scalar reward and an integer comparison-group id (computed from the algorithm's group key), and
each sample's advantage is its reward measured against the other members of its group. Only the
baseline and the scale differ between the modes below.

All reductions are vectorised over integer group ids (``torch.unique`` + ``index_add_`` /
``bincount`` / ``scatter_reduce``); there is no Python loop over samples or groups.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["ADVANTAGE_MODES", "group_advantages", "group_ids_from_keys", "trajectory_advantages", "trajectory_ids"]

ADVANTAGE_MODES: tuple[str, ...] = ("group", "mean", "batch", "none", "rloo", "max")


def _check_inputs(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mode: str,
    baselines: torch.Tensor | None,
) -> None:
    """Raise ValueError for a bad mode, bad shapes/dtypes, or a baseline given to the wrong mode."""
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; allowed modes: {', '.join(ADVANTAGE_MODES)}")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            "rewards and group_ids must be 1-D tensors of the same shape; got rewards shape "
            f"{tuple(rewards.shape)} and group_ids shape {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor; got dtype {group_ids.dtype}")
    if mode == "max":
        if baselines is None:
            raise ValueError(
                "advantage mode 'max' (ReMax) needs baselines: the reward of each group's greedy completion"
            )
        if baselines.shape != rewards.shape:
            raise ValueError(
                f"baselines must have the shape of rewards; got baselines shape {tuple(baselines.shape)} "
                f"and rewards shape {tuple(rewards.shape)}"
            )
    elif baselines is not None:
        raise ValueError(f"baselines are only used by advantage mode 'max'; got them with mode {mode!r}")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mode: str = "group",
    eps: float = 1e-4,
    baselines: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compute one advantage per sample from its reward and its comparison group.

    Args:
        rewards: float ``[N]``; one scalar reward per sample. Integer/bool rewards are cast to the
            default float dtype.
        group_ids: integer ``[N]``; samples with equal ids are compared with each other. Ids may be
            arbitrary integers (negative, sparse, unordered).
        mode: one of ``ADVANTAGE_MODES``:

            * ``"group"``: ``(r - mean_g) / (std_g + eps)``, ``std_g`` the unbiased (Bessel) standard
              deviation inside the group, as ``torch.std`` and TRL's GRPOTrainer compute it.
            * ``"mean"``: ``r - mean_g`` (no scaling).
            * ``"batch"``: ``(r - mean_g) / (std_batch + eps)`` with ``std_batch`` the unbiased std of
              all N rewards (TRL ``scale_rewards="batch"``).
            * ``"none"``: identical to ``"mean"``; it is TRL's name (``scale_rewards="none"``) for the
              Dr. GRPO setting, kept so configs written for TRL read the same here.
            * ``"rloo"``: ``r_i - mean(r_j for j != i in the group)`` (leave-one-out baseline).
            * ``"max"``: ReMax, ``r - baselines``, where ``baselines[i]`` is the reward of the greedy
              (argmax-decoded) completion of sample i's group.
        eps: added to the std in ``"group"`` and ``"batch"`` modes.
        baselines: float ``[N]``; required by ``"max"`` and rejected by every other mode.

    Returns:
        float ``[N]`` advantages (dtype of ``rewards``).

    Degenerate groups (all modes except ``"max"``, whose baseline comes from outside the group):

    * a singleton group (one member) gets advantage exactly 0: there is nothing to compare with;
    * a zero-variance group (all rewards equal) gets advantage exactly 0 for every member, even where
      ``sum/n`` does not round back to the common value, and never NaN (also not in ``"batch"``
      mode with a zero-variance batch or N == 1).

    Raises:
        ValueError: unknown mode (the message lists the allowed ones); shape mismatch (the message
            names the shapes); ``baselines`` missing for ``"max"`` or given to another mode.
    """
    _check_inputs(rewards, group_ids, mode, baselines)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if rewards.numel() == 0:
        return rewards.clone()

    if mode == "max":
        # ReMax: the baseline is an external greedy rollout, so group statistics play no part and a
        # singleton or constant group still has a meaningful advantage.
        assert baselines is not None  # _check_inputs: mode 'max' needs them
        return rewards - baselines.to(device=rewards.device, dtype=rewards.dtype)

    # Map arbitrary ids to 0..G-1 so that every per-group reduction is a dense index_add over G slots.
    _, inv = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inv.max().item()) + 1
    counts = torch.bincount(inv, minlength=num_groups).to(rewards.dtype)  # [G]
    sums = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inv, rewards)
    mean_g = sums / counts  # counts >= 1 for every id produced by unique
    centered = rewards - mean_g[inv]

    # Degenerate groups are detected with min == max rather than var == 0: with rounding,
    # sum/n may differ from the common value by an ulp and give a tiny non-zero `centered`
    # that the std division would blow up to O(1).
    empty = torch.empty(num_groups, dtype=rewards.dtype, device=rewards.device)
    g_min = empty.scatter_reduce(0, inv, rewards, reduce="amin", include_self=False)
    g_max = empty.scatter_reduce(0, inv, rewards, reduce="amax", include_self=False)
    degenerate = (g_min == g_max)[inv]  # also covers singletons

    if mode in ("mean", "none"):
        adv = centered
    elif mode == "group":
        sq = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inv, centered * centered)
        # Bessel's correction; the clamp only matters for singletons, which are zeroed below anyway.
        std_g = (sq / (counts - 1).clamp(min=1)).sqrt()
        adv = centered / (std_g[inv] + eps)
    elif mode == "batch":
        n = rewards.numel()
        batch_centered = rewards - rewards.mean()
        # Unbiased like torch.std, but N == 1 gives 0 instead of NaN.
        std_b = ((batch_centered * batch_centered).sum() / max(n - 1, 1)).sqrt()
        adv = centered / (std_b + eps)
    else:  # rloo
        n_i = counts[inv]
        # Mean of the other members; the clamp keeps singletons finite (zeroed below).
        loo_mean = (sums[inv] - rewards) / (n_i - 1).clamp(min=1)
        adv = rewards - loo_mean

    return torch.where(degenerate, torch.zeros_like(adv), adv)


def group_ids_from_keys(keys: Sequence[Hashable]) -> torch.Tensor:
    """Map hashable group keys to contiguous long ids ``0..G-1`` in order of first appearance.

    Example: ``[("p1", "a", 0), ("p0", "b", 1), ("p1", "a", 0)] -> tensor([0, 1, 0])``.
    Keys are typically tuples such as ``(problem_id, role, turn)`` built from a sample's tags.
    """
    # A dict lookup per key is unavoidable for arbitrary hashables; the tensor work downstream is
    # vectorised over the resulting integer ids.
    index: dict[Hashable, int] = {}
    ids = [index.setdefault(key, len(index)) for key in keys]
    return torch.tensor(ids, dtype=torch.long)


def trajectory_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    trajectory_ids: torch.Tensor,
    mode: str = "group",
    eps: float = 1e-4,
    baselines: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`group_advantages` where each trajectory counts once in its group's statistics.

    A trajectory is the samples of one group with equal ``trajectory_ids`` (the turns of one
    rollout, which share its reward). The group's mean and std are taken over its trajectories,
    not over its samples, so a rollout that took more turns does not weigh more; every sample
    gets its trajectory's advantage. When every trajectory is one sample this is exactly
    :func:`group_advantages`.

    Raises:
        ValueError: ``trajectory_ids`` not of the shape of ``group_ids``, or the samples of one
            trajectory with different rewards or baselines (the message names the first).
    """
    if trajectory_ids.shape != group_ids.shape:
        raise ValueError(f"trajectory_ids must have the shape of group_ids; got {tuple(trajectory_ids.shape)} "
                         f"and {tuple(group_ids.shape)}")
    if rewards.numel() == 0:
        return group_advantages(rewards, group_ids, mode, eps, baselines)
    units, inv = torch.unique(torch.stack([group_ids, trajectory_ids], dim=1), dim=0, return_inverse=True)
    if len(units) == rewards.numel():
        return group_advantages(rewards, group_ids, mode, eps, baselines)
    # the first sample of each trajectory stands for it
    n = rewards.numel()
    first = torch.full((len(units),), n, dtype=torch.long).scatter_reduce(0, inv, torch.arange(n), reduce="amin")
    for name, values in (("rewards", rewards), ("baselines", baselines)):
        if values is None:
            continue
        spread = values[first][inv]
        same = (
            (values == spread) | (values.isnan() & spread.isnan()) if values.is_floating_point() else values == spread
        )
        if not bool(same.all()):
            i = int((~same).nonzero()[0])
            raise ValueError(
                f"{name}: sample {i} has {values[i].item()} but sample {int(first[inv[i]])} of its trajectory "
                f"(group id {int(group_ids[i])}, trajectory id {int(trajectory_ids[i])}) has {spread[i].item()}; "
                "the samples of one trajectory must share one value"
            )
    unit_baselines = baselines[first] if baselines is not None else None
    return group_advantages(rewards[first], units[:, 0], mode, eps, unit_baselines)[inv]


def trajectory_ids(keys: Sequence[Hashable | None]) -> torch.Tensor:
    """Integer trajectory ids from each sample's trajectory key (``Sample.trajectory``, any
    hashable); a sample whose key is None is a trajectory of its own."""
    return group_ids_from_keys([("sample", i) if k is None else ("trajectory", k) for i, k in enumerate(keys)])
