"""Several LoRA policies on one base model, computed in one batch: each row with its own adapter.

Sampling each adapter from its own merged copy of the base costs a copy of the base per policy
in memory and one decode batch per policy (a pass over the base weights per token per policy).
Here every LoRA layer computes ``base(x)`` once for the whole batch and adds to each row its own
adapter's ``lora_B(lora_A(dropout(x))) * scaling``: the formula PEFT applies for one active
adapter, so a row's log-probs equal those the trainer computes with that adapter active.
Rows of one adapter are kept contiguous by the caller where it can (then each adapter works on
a view of the batch); any order works.
"""

from __future__ import annotations

import functools
from typing import Hashable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from teamrl.policies.policy import Policy


def _lora_layers(peft_model: nn.Module) -> list[nn.Module]:
    """Every LoRA layer of ``peft_model``; refuses layer kinds and variants the per-row forward does not implement."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear

    layers = []
    for name, m in peft_model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        if not isinstance(m, LoraLinear):
            raise NotImplementedError(f"LoRA layer {name!r} is a {type(m).__name__}; per-row adapters support LoRA on "
                                      f"nn.Linear layers only (policy.lora.target_modules)")
        if getattr(m, "lora_variant", None):
            raise NotImplementedError(
                f"LoRA layer {name!r} uses a variant ({sorted(m.lora_variant)}); per-row adapters "
                f"support plain LoRA only"
            )
        if any(getattr(m, "lora_bias", {}).values()):
            raise NotImplementedError(f"LoRA layer {name!r} has a LoRA bias (lora_bias=True); per-row adapters support "
                                      f"bias-free LoRA only")
        layers.append(m)
    return layers


def _row_forward(layer: nn.Module, owner: "RowAdapterModel", x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A LoRA layer's forward with row-dependent adapters: ``base(x)`` once, then each row's adapter delta.

    A row's delta is PEFT's ``lora_B(lora_A(dropout(x))) * scaling`` for its adapter. All adapters
    are computed in three calls: ``x`` times every adapter's ``lora_A`` side by side (rank-sized
    columns: cheap), the columns of other adapters zeroed per row, then times the adapters'
    scaled ``lora_B`` side by side, added onto ``base(x)``. At decode batch sizes the per-call
    overhead of ~200 LoRA layers x adapters was a measurable share of a step, so the call count
    matters more than the wasted rank-sized columns. Active dropout (a module in training mode)
    is random per adapter: those calls take one adapter at a time.
    """
    if layer.merged:
        raise RuntimeError("a LoRA layer is merged into its base; per-row adapters need unmerged weights")
    result = layer.base_layer(x, *args, **kwargs)
    if not owner.plan:
        return result
    fused = owner.fused(layer)
    if fused is None:
        return _row_forward_per_adapter(layer, owner, x, result)
    a_cat, b_cat, mask = fused
    part = x if x.dtype == a_cat.dtype else x.to(a_cat.dtype)
    hidden = F.linear(part, a_cat) * mask.view(mask.shape[0], *([1] * (part.dim() - 2)), mask.shape[-1])
    delta = F.linear(hidden, b_cat)
    return result + (delta if delta.dtype == result.dtype else delta.to(result.dtype))


def _row_forward_per_adapter(
    layer: nn.Module, owner: "RowAdapterModel", x: torch.Tensor, result: torch.Tensor
) -> torch.Tensor:
    """:func:`_row_forward`'s deltas one adapter at a time (for dropout in training mode)."""
    for name, rows in owner.plan:
        if name not in layer.lora_A:  # this adapter does not target this layer
            continue
        a_weight, b_weight = layer.lora_A[name].weight, layer.lora_B[name].weight
        part = x if rows is None else x[rows]
        part = layer.lora_dropout[name](part)
        if part.dtype != a_weight.dtype:
            part = part.to(a_weight.dtype)
        delta = F.linear(F.linear(part, a_weight), b_weight) * layer.scaling[name]
        if delta.dtype != result.dtype:
            delta = delta.to(result.dtype)
        if rows is None:
            result = result + delta
        elif isinstance(rows, slice):
            result[rows] += delta
        else:
            result = result.index_add(0, rows, delta)
    return result


class RowAdapterModel:
    """The base model of a PEFT LoRA model, computing batch row ``i`` with adapter ``adapters[row_adapter[i]]``.

    A context manager: inside it every LoRA layer computes per row (outside, the model is the
    ordinary PEFT model again); :meth:`select` sets the rows' adapters for the forward calls that
    follow. ``model`` is the module to call (the transformer with the LoRA layers in it).
    """

    def __init__(self, peft_model: nn.Module, adapters: Sequence[str]) -> None:
        known = set(getattr(peft_model, "peft_config", {}))
        unknown = [a for a in adapters if a not in known]
        if unknown:
            raise KeyError(f"adapters {unknown} are not on this model; it has {sorted(known)}")
        self.model = peft_model.get_base_model()
        self.adapters = list(adapters)
        self.plan: list[tuple[str, slice | torch.Tensor | None]] = []
        self._row_adapter = torch.zeros(0, dtype=torch.long)
        self._layers = _lora_layers(peft_model)
        self._entered = False
        self._weights: dict[int, tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = {}  # id(layer) -> fused weights
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}  # adapter index per rank column -> [rows, columns] mask

    def select(self, row_adapter: torch.Tensor) -> None:
        """Row ``i`` of the next forward calls uses ``adapters[row_adapter[i]]`` (indices into ``adapters``)."""
        ids = row_adapter.tolist()
        self._masks = {}
        if not ids:
            self.plan = []
            return
        if any(not 0 <= i < len(self.adapters) for i in ids):
            raise IndexError(
                f"row adapter indices {sorted(set(ids))}: must index the {len(self.adapters)} adapters {self.adapters}"
            )
        if len(set(ids)) == 1:
            self.plan = [(self.adapters[ids[0]], None)]
        elif all(a <= b for a, b in zip(ids, ids[1:])):  # contiguous blocks: each adapter works on a view
            plan, start = [], 0
            for end in range(1, len(ids) + 1):
                if end == len(ids) or ids[end] != ids[start]:
                    plan.append((self.adapters[ids[start]], slice(start, end)))
                    start = end
            self.plan = plan
        else:
            self.plan = [(self.adapters[a], torch.nonzero(row_adapter == a).flatten()) for a in sorted(set(ids))]
        self._row_adapter = row_adapter

    def fused(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``layer``'s adapters side by side: ``lora_A`` weights [columns, in], scaled ``lora_B`` [out, columns], row
        mask [rows, columns].

        ``None`` where an adapter's dropout is active (training mode) or the adapters' dtypes differ.
        Without gradient recording the weights are read once per ``with`` block (they are the
        sampling weights, fixed during it); with it, at every call, so that gradients reach them.
        """
        if layer.training and any(
            not isinstance(layer.lora_dropout[a], nn.Identity) for a in self.adapters if a in layer.lora_A
        ):
            return None
        key = id(layer)
        weights = None if torch.is_grad_enabled() else self._weights.get(key)
        if weights is None:
            names = [(i, a) for i, a in enumerate(self.adapters) if a in layer.lora_A]
            if not names:
                return None
            a_weights = [layer.lora_A[a].weight for _, a in names]
            if len({w.dtype for w in a_weights} | {layer.lora_B[a].weight.dtype for _, a in names}) > 1:
                return None
            owners = tuple(i for (i, _), w in zip(names, a_weights) for _ in range(w.shape[0]))
            weights = (owners, torch.cat(a_weights),
                       torch.cat([layer.lora_B[a].weight * layer.scaling[a] for _, a in names], dim=1))
            if not torch.is_grad_enabled():
                self._weights[key] = weights
        owners, a_cat, b_cat = weights
        mask = self._masks.get(owners)
        if mask is None:
            owner_t = torch.tensor(owners, device=self._row_adapter.device)
            mask = (self._row_adapter.unsqueeze(1) == owner_t.unsqueeze(0)).to(device=a_cat.device, dtype=a_cat.dtype)
            self._masks[owners] = mask
        return a_cat, b_cat, mask

    def __enter__(self) -> "RowAdapterModel":
        if self._entered:
            raise RuntimeError("RowAdapterModel is already in use")
        for layer in self._layers:
            # instance attribute: shadows the class forward
            layer.forward = functools.partial(_row_forward, layer, self)
        self._weights, self._masks = {}, {}
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        for layer in self._layers:
            if "forward" in layer.__dict__:
                del layer.forward
        self._entered = False
        self.plan = []
        self._weights, self._masks = {}, {}


class SharedBaseAdapters:
    """Which LoRA policies share one base model, and the per-row model that samples them together.

    Given to :class:`~teamrl.rollout.hf_engine.HFEngine` as ``row_models``: a policy whose base
    holds two or more of these policies' adapters samples through the shared base (no merged
    copy; the policies of one scheduler flush decode in one batch). A LoRA policy alone on its
    base keeps sampling from its merged copy (``Policy.generation_model``), the fastest path for it.
    """

    def __init__(self, policies: Mapping[str, Policy]) -> None:
        self._policies = dict(policies)
        by_model: dict[int, list[str]] = {}
        for name, pol in self._policies.items():
            if pol.adapter is not None:
                by_model.setdefault(id(pol.model), []).append(name)
        self._base = {n: key for key, names in by_model.items() if len(names) > 1 for n in names}

    def base_of(self, policy: str) -> Hashable | None:
        """A key shared by the policies on the same multi-adapter base; ``None`` for any other policy."""
        return self._base.get(policy)

    def rows(self, policies: Sequence[str]) -> RowAdapterModel:
        """The per-row model of ``policies`` (all on one base: same :meth:`base_of`), adapter index = position in
        ``policies``."""
        keys = {self.base_of(p) for p in policies}
        if len(keys) != 1 or None in keys:
            raise ValueError(f"policies {list(policies)} do not share one multi-adapter base")
        return RowAdapterModel(self._policies[policies[0]].model, [self._policies[p].adapter for p in policies])
