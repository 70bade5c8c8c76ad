"""A Policy: the weights one or more roles act with, and the optimizer that updates them."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Iterator

import torch
from torch import nn


class Policy:
    """One trainable set of weights: a whole model, or one LoRA adapter on a shared base.

    ``active()`` makes this policy the one the shared model computes with (for a LoRA,
    the adapter is selected); ``reference()`` computes with the frozen reference: the base
    with adapters disabled for a LoRA, a frozen copy for full-weight training (made only
    when a KL term needs it).
    """

    def __init__(self, name: str, model: nn.Module, adapter: str | None, lr: float, weight_decay: float,
                 reference_model: nn.Module | None = None) -> None:
        self.name = name
        self.model = model
        self.adapter = adapter
        self.reference_model = reference_model
        self._params = self._own_parameters()
        if not self._params:
            raise ValueError(f"policy {name!r}: no trainable parameters found (adapter {adapter!r})")
        for p in self._params:
            p.requires_grad_(True)
        self.lr, self.weight_decay = lr, weight_decay
        self.optimizer = torch.optim.AdamW(self._params, lr=lr, weight_decay=weight_decay)
        self.version = 0  # bumped by every change of this policy's weights
        # a LoRA's KL reference when it is not the base (a warm start): its own weights by name, swapped in to compute
        self._reference_state: dict[str, torch.Tensor] | None = None
        self._merged: nn.Module | None = None
        self._merged_version = -1

    def load_optimizer_state(self, state: dict) -> None:
        """Restore the optimizer's moments from a checkpoint, keeping this policy's own learning rate and
        weight decay: a run resumed with another ``train.lr`` (RL after a warm start at its own rate) trains
        at the rate it was given, not the checkpoint's."""
        self.optimizer.load_state_dict(state)
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = self.lr, self.weight_decay

    def step(self) -> None:
        """One optimizer step (gradients must be in place)."""
        self.optimizer.step()
        self.version += 1

    def rebind_parameters(self) -> None:
        """Find this policy's parameters again after the model's were replaced (sharded by FSDP, whose parameters
        are new objects), with a new optimizer over them (no steps taken yet)."""
        self._params = self._own_parameters()
        for p in self._params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self._params, lr=self.lr, weight_decay=self.weight_decay)

    def _own_parameters(self) -> list[nn.Parameter]:
        if self.adapter is None:
            return [p for p in self.model.parameters()]
        tag = f".{self.adapter}."
        return [p for n, p in self.model.named_parameters() if "lora_" in n and tag in n]

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this policy's optimizer updates, and only those."""
        return self._params

    def named_state(self) -> dict[str, torch.Tensor]:
        """This policy's own trainable weights by name (adapter weights for a LoRA)."""
        ids = {id(p) for p in self._params}
        return {n: p.detach() for n, p in self.model.named_parameters() if id(p) in ids}

    def load_named_state(self, state: dict[str, torch.Tensor]) -> None:
        own = {n: p for n, p in self.model.named_parameters() if n in state}
        missing = set(state) - set(own)
        if missing:
            raise KeyError(f"policy {self.name!r}: checkpoint has weights the model lacks: {sorted(missing)[:3]}")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(state[n])
        self.version += 1

    def save_adapter(self, folder: str | Path) -> Path:
        """Write this policy's LoRA adapter as a PEFT adapter folder at ``folder`` and return it.

        The folder (``adapter_config.json`` + ``adapter_model.safetensors``) is what
        ``PeftModel.from_pretrained``, vLLM's and SGLang's ``load_lora_adapter`` and
        ``teamrl serve`` read. Full-weight policies have no adapter to save.
        """
        if self.adapter is None:
            raise ValueError(
                f"policy {self.name!r} trains full weights, not a LoRA adapter; there is no adapter to save"
            )
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.model, adapter_name=self.adapter)
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(folder / "adapter_model.safetensors")
        )
        self.model.peft_config[self.adapter].save_pretrained(str(folder))
        return folder

    def save_weights(self, folder: str | Path) -> Path:
        """Write this full-weight policy's model as a Hugging Face model folder at ``folder`` (``config.json`` and
        safetensors, the names vLLM's loader reads) and return it: what a server reloads its weights from
        (vLLM's ``reload_weights``, ``teamrl serve``). A LoRA policy sends its adapter instead (:meth:`save_adapter`).
        """
        if self.adapter is not None:
            raise ValueError(
                f"policy {self.name!r} trains the LoRA adapter {self.adapter!r}; save it with save_adapter"
            )
        from safetensors.torch import save_model

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.model.config.save_pretrained(str(folder))
        # save_model writes a tensor tied to another (the output embedding) once, as loaders expect
        save_model(self.model, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    @contextlib.contextmanager
    def generation_model(self) -> Iterator[nn.Module]:
        """A model for sampling with this policy's current weights.

        For a LoRA policy: a plain copy of the base with this adapter merged in, refreshed
        lazily after updates. Sampling through PEFT's unmerged adapters costs ~1.5x per token
        on CPU, and merging into the shared base in place would drift its weights over many
        merge/unmerge cycles; a separate copy avoids both. Full-weight policies sample with
        the model itself.
        """
        if self.adapter is None:
            yield self.model
            return
        if self._merged is None:
            self._merged = copy.deepcopy(self.model).unload().eval().requires_grad_(False)
            self._targets = [(n.removeprefix("base_model.model."), m) for n, m in self.model.named_modules()
                             if hasattr(m, "get_delta_weight") and self.adapter in getattr(m, "lora_A", {})]
        if self._merged_version != self.version:
            with torch.no_grad():
                for name, layer in self._targets:
                    target = self._merged.get_submodule(name)
                    target.weight.copy_(layer.base_layer.weight + layer.get_delta_weight(self.adapter))
            self._merged_version = self.version
        yield self._merged

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        """Compute with this policy's weights."""
        if self.adapter is not None:
            self.model.set_adapter(self.adapter)
            # PEFT freezes the adapters it deactivates; ours must stay trainable.
            for p in self._params:
                p.requires_grad_(True)
        yield self.model

    def set_reference(self, state: dict[str, torch.Tensor]) -> None:
        """Make ``state`` (this policy's own weights by name, as :meth:`named_state` gives them: a warm start) the
        KL reference instead of the base. A LoRA keeps a copy of its adapter's weights (no second base); full
        weights load into the reference copy, which exists when ``train.loss.kl_coef`` > 0."""
        own = self.named_state()
        if set(state) != set(own):
            diff = sorted(set(state) ^ set(own))[:3]
            raise KeyError(f"policy {self.name!r}: a reference must hold exactly this policy's weights; "
                           f"differs in {diff}")
        if self.adapter is not None:
            self._reference_state = {n: t.detach().to(own[n].device, copy=True) for n, t in state.items()}
            return
        if self.reference_model is None:
            raise RuntimeError(f"policy {self.name!r} trains full weights and has no reference copy; "
                               "set train.loss.kl_coef > 0 before building it")
        ref = dict(self.reference_model.named_parameters())
        with torch.no_grad():
            for n, t in state.items():
                ref[n].copy_(t)

    @contextlib.contextmanager
    def reference(self) -> Iterator[nn.Module]:
        """Compute with the KL reference: the base with adapters off (never a second copy of a LoRA's base), or the
        weights :meth:`set_reference` gave (a LoRA's are swapped in for the computation and swapped back after)."""
        if self.adapter is not None and self._reference_state is not None:
            own = {n: p for n, p in self.model.named_parameters() if n in self._reference_state}
            current = {n: p.detach().clone() for n, p in own.items()}
            with torch.no_grad():
                for n, p in own.items():
                    p.copy_(self._reference_state[n])
            try:
                with self.active() as model:
                    yield model
            finally:
                with torch.no_grad():
                    for n, p in own.items():
                        p.copy_(current[n])
        elif self.adapter is not None:
            with self.model.disable_adapter():
                yield self.model
        elif self.reference_model is not None:
            yield self.reference_model
        else:
            raise RuntimeError(
                f"policy {self.name!r} trains full weights and has no reference copy; "
                "set train.loss.kl_coef > 0 before building it"
            )
