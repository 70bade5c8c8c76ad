"""Role -> policy routing: one shared policy, one LoRA adapter per role type, or separate models."""

from __future__ import annotations

import copy
import re
from typing import Collection

import torch
from transformers import PreTrainedTokenizerBase

from teamrl.core.config import ConfigError, LoraConfig
from teamrl.policies.models import load_model, quiet_peft_wrapping, resolve_device
from teamrl.policies.policy import Policy

POLICY_MODES = ("shared", "lora_per_role", "separate")


def role_type(role: str) -> str:
    """A role name without its instance number: ``generator0`` -> ``generator``.

    A rule on names only: which policy acts for a role is :func:`declared_role`'s answer
    (``gpt4`` declared by a workflow keeps its own policy)."""
    base = re.sub(r"[_-]?\d+$", "", role)
    return base or role


def declared_role(role: str, declared: Collection[str]) -> str:
    """The declared role that the role name ``role`` acts as.

    ``role`` itself when it is declared (``critic2``, ``gpt4``: each its own role), else the
    declared role it is a numbered instance of (``generator0``, ``worker_2`` -> ``generator``,
    ``worker``: instances a workflow creates at run time share their role's policy). Any other
    name raises :class:`KeyError` naming the declared roles."""
    if role in declared:
        return role
    base = role_type(role)
    if base != role and base in declared:
        return base
    raise KeyError(f"role {role!r} is not declared and is not a numbered instance (<role><n>) of a declared role; "
                   f"declared roles are {sorted(declared)}")


def check_role_map(role_map: dict[str, str], roles: list[str]) -> None:
    """An explicit ``policy.roles`` map must list every role of the team (before any model loads)."""
    missing = [r for r in roles if r not in role_map]
    if missing:
        raise ConfigError(f"policy.roles: roles {missing} have no policy; the team's roles are {list(roles)}, "
                          f"the map lists {sorted(role_map)}")


def _with_lora(model: torch.nn.Module, lora: LoraConfig, adapters: list[str]) -> torch.nn.Module:
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    # a rank above a layer's smaller side adds nothing and costs r x (in + out) weights: refused before any is made
    targets = set(lora.target_modules)
    ranks = [min(m.in_features, m.out_features) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets]
    if ranks and lora.r > max(ranks):
        raise ConfigError(f"policy.lora.r: {lora.r} is over the rank of the model's targeted layers "
                          f"({', '.join(sorted(targets))}); at most {max(ranks)}, the largest rank one of them has")
    pcfg = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    with quiet_peft_wrapping():
        peft_model = get_peft_model(model, pcfg, adapter_name=adapters[0])
    for name in adapters[1:]:
        peft_model.add_adapter(name, pcfg)
    return peft_model


class PolicyRouter:
    """Maps each role to the :class:`Policy` that acts for it and learns from its samples.

    - ``shared``: one policy named ``shared`` for every role (a LoRA adapter, or full weights).
    - ``lora_per_role``: one LoRA adapter per declared role on one base model; the instances
      ``generator0..2`` of a declared ``generator`` share the ``generator`` adapter.
    - ``separate``: one model per declared role (each with its own LoRA, or full weights).

    ``roles`` are the roles the team declares (a workflow's ``roles=(...)``, a task's ``roles``).
    By default each declared role has its own policy, named after it, whatever its name
    (``critic2`` and ``gpt4`` included); a role name used at run time that is not declared acts
    as the declared role it is a numbered instance of (:func:`declared_role`). ``role_map``
    (``policy.roles``) replaces the default: each declared role names its policy
    (``{critic: critic, critic2: critic}``) and every declared role must be listed.
    """

    def __init__(self, mode: str, roles: list[str], model_name: str, lora: LoraConfig | None,
                 lr: float, weight_decay: float = 0.0, seed: int = 0, need_reference: bool = False,
                 device: str = "cpu", dtype: str = "float32", role_map: dict[str, str] | None = None) -> None:
        if mode not in POLICY_MODES:
            raise ValueError(f"policy mode {mode!r}: choose one of {list(POLICY_MODES)}")
        if not roles:
            raise ValueError("PolicyRouter needs at least one role")
        if mode == "lora_per_role" and lora is None:
            raise ValueError("policy mode 'lora_per_role' needs a LoRA config")
        self.mode = mode
        # "auto" picks CUDA + bf16 when a GPU is present; an explicit "cuda" without one fails here, naming it.
        self.device, self.dtype = resolve_device(device, dtype)
        if role_map:
            check_role_map(role_map, roles)
        # declared role -> policy name: the explicit map, else one policy per declared role
        route = dict(role_map) if role_map else {r: r for r in dict.fromkeys(roles)}
        if mode == "shared":
            route = {t: "shared" for t in route}
        self.policies: dict[str, Policy] = {}
        self.tokenizer: PreTrainedTokenizerBase

        def build(names: list[str]) -> list[Policy]:
            base, tok = load_model(model_name, dtype=self.dtype, device=self.device, seed=seed)
            self.tokenizer = tok
            if lora is None:
                (name,) = names
                ref = copy.deepcopy(base).eval().requires_grad_(False) if need_reference else None
                return [Policy(name, base, None, lr, weight_decay, reference_model=ref)]
            model = _with_lora(base, lora, names)
            return [Policy(n, model, n, lr, weight_decay) for n in names]

        names = list(dict.fromkeys(route.values()))
        built = [p for n in names for p in build([n])] if mode == "separate" else build(names)
        self._route = route
        self.policies = {p.name: p for p in built}

    def policy_name(self, role: str) -> str:
        """Name of the policy that acts for ``role`` (a numbered instance such as ``worker2`` of a
        declared ``worker`` is fine; see :func:`declared_role`)."""
        return self._route[declared_role(role, self._route)]

    def policy_for(self, role: str) -> Policy:
        """The :class:`Policy` for ``role``."""
        return self.policies[self.policy_name(role)]
