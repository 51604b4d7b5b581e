"""Every training client's LoRA adapter and AdamW state, on one shared base model.

Why one peft model with named adapters: the base is loaded once whatever the number of
clients; a call first makes its client's adapter the active one (peft freezes the others, so
its backward reaches only that adapter's parameters), and each client's optimizer holds only its
own adapter's parameters, so one client's calls never move another's weights. Calls run one at
a time on the compute thread, so switching the active adapter is safe.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlfleet.common.errors import InvalidArgument
from rlfleet.rl.datum_losses import DatumLoss
from rlfleet.trainer import lora
from rlfleet.trainer.tinker.compute import run_datums
from rlfleet.trainer.tinker.types import AdamStep, Datum, ForwardResult, LoraSpec

ATTENTION = re.compile(r"(^|\.)(self_attn|attention|attn)\.")
MLP = re.compile(r"(^|\.)(mlp|feed_forward|ffn)\.")
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "adapter.json"


def linear_modules(model) -> dict[str, list[str]]:
    """The short names of the base's linear layers by kind: ``attn`` and ``mlp``."""
    found: dict[str, set[str]] = {"attn": set(), "mlp": set()}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        kind = "attn" if ATTENTION.search(name) else "mlp" if MLP.search(name) else None
        if kind is not None:
            found[kind].add(name.rsplit(".", 1)[-1])
    return {kind: sorted(names) for kind, names in found.items()}


def target_modules(spec: LoraSpec, available: Mapping[str, list[str]]) -> list[str]:
    """The modules ``spec`` trains (``train_unembed`` is refused before this)."""
    return [
        *(available["attn"] if spec.train_attn else []),
        *(available["mlp"] if spec.train_mlp else []),
    ]


class AdapterPool:
    """Named LoRA adapters over ``base`` (a causal LM), each with its own AdamW."""

    def __init__(self, base, lora_alpha: float) -> None:
        self.base, self.lora_alpha = base.eval(), lora_alpha
        self.model: Any = None
        """The peft model, once the first adapter exists."""
        self.modules = linear_modules(base)
        self.optimizers: dict[str, torch.optim.AdamW] = {}
        self.specs: dict[str, LoraSpec] = {}

    def create(self, name: str, spec: LoraSpec) -> list[str]:
        """Add adapter ``name`` (B = 0: it starts as the base); returns its target modules."""
        peft = lora._peft()
        modules = target_modules(spec, self.modules)
        config = peft.LoraConfig(
            r=spec.rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=0.0,
            target_modules=modules,
            bias="none",
            task_type="CAUSAL_LM",
        )
        if spec.seed is not None:
            torch.manual_seed(spec.seed)
        if self.model is None:
            self.model = peft.get_peft_model(self.base, config, adapter_name=name)
        else:
            self.model.add_adapter(name, config)
        self.model.eval()
        self.specs[name] = spec
        self.optimizers[name] = torch.optim.AdamW(
            self.parameters(name), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0
        )
        return modules

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_parameters(name)]

    def named_parameters(self, name: str) -> list[tuple[str, torch.nn.Parameter]]:
        """Adapter ``name``'s parameters, keyed without the adapter's name (so two adapters of
        one shape have the same keys)."""
        marker = f".{name}."
        return [
            (key.replace(marker, "."), p)
            for key, p in self.model.named_parameters()
            if ".lora_" in key and marker in key
        ]

    def activate(self, name: str) -> None:
        if self.model.active_adapter != name:
            self.model.set_adapter(name)

    def forward(
        self,
        name: str,
        datums: Sequence[Datum],
        loss: DatumLoss,
        config: Mapping[str, float],
        backward: bool,
        micro_batch_tokens: int,
    ) -> ForwardResult:
        self.activate(name)
        return run_datums(self.model, datums, loss, config, backward, micro_batch_tokens)

    def step(self, name: str, adam: AdamStep) -> dict[str, float]:
        """One AdamW step with ``adam``'s hyperparameters on the gradient accumulated since the
        last step (then cleared); the gradient norm before clipping."""
        params = self.parameters(name)
        grads = [p.grad for p in params if p.grad is not None]
        norm = (
            float(
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            )
            if grads
            else 0.0
        )
        if adam.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
        optimizer = self.optimizers[name]
        for group in optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate}

    def wire_state(self, name: str) -> dict[str, torch.Tensor]:
        """A copy of adapter ``name`` in ``rlfleet.model.lora``'s wire form (what replicas take)."""
        return {key: t.clone() for key, t in lora.adapter_state(self.model, name).items()}

    def save(self, name: str, directory: Path, meta: dict) -> None:
        """Adapter tensors, optimizer state and ``meta`` (rank, modules, base) into ``directory``."""
        import safetensors.torch

        directory.mkdir(parents=True, exist_ok=True)
        tensors = {key: p.detach().contiguous() for key, p in self.named_parameters(name)}
        safetensors.torch.save_file(tensors, str(directory / ADAPTER_FILE))
        torch.save(self.optimizers[name].state_dict(), directory / OPTIMIZER_FILE)
        (directory / META_FILE).write_text(json.dumps(meta, indent=2))

    def load(self, name: str, directory: Path, with_optimizer: bool) -> None:
        """Adapter ``name``'s weights (and optimizer state) from ``save``'s ``directory``."""
        import safetensors.torch

        saved = safetensors.torch.load_file(str(directory / ADAPTER_FILE))
        mine = dict(self.named_parameters(name))
        if set(saved) != set(mine) or any(saved[k].shape != mine[k].shape for k in mine):
            raise InvalidArgument(
                f"the checkpoint in {directory.name} does not fit this "
                "adapter (another rank or other modules)"
            )
        with torch.no_grad():
            for key, param in mine.items():
                param.copy_(saved[key])
        if with_optimizer:
            state = torch.load(directory / OPTIMIZER_FILE, weights_only=True)
            self.optimizers[name].load_state_dict(state)

    def delete(self, name: str) -> None:
        """Drop adapter ``name`` (its optimizer too); the last one stays (peft needs one)."""
        self.optimizers.pop(name, None)
        self.specs.pop(name, None)
        if self.model is not None and len(self.model.peft_config) > 1:
            self.model.delete_adapter(name)


def wire_state_of(folder: Path) -> dict[str, torch.Tensor]:
    """A saved adapter (``AdapterPool.save``) in ``rlfleet.model.lora``'s wire form, ``B``
    scaled by ``lora_alpha / rank`` from its ``adapter.json``: what a sampling session on a
    ``tinker://.../sampler_weights/...`` path pushes to the replicas."""
    import safetensors.torch

    from rlfleet.model.lora import adapter_name

    meta = json.loads((folder / META_FILE).read_text())
    scale = meta["lora_alpha"] / meta["rank"]
    state = {}
    for key, tensor in safetensors.torch.load_file(str(folder / ADAPTER_FILE)).items():
        module, part = key.removeprefix(lora.PEFT_PREFIX).rsplit(".lora_", 1)
        factor = part.split(".", 1)[0]
        state[adapter_name(f"{module}.weight", factor)] = tensor * (scale if factor == "B" else 1)
    return state
