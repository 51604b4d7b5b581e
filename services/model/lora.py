"""The wire form of a LoRA adapter update, shared by the trainer and the rollout engines.

Why a naming convention instead of a new header field: the weight codec, the proto and every
transport already carry named tensors; an adapter update is recognised by its names alone, so
nothing between the trainer and the engine changes. An adapter update holds, for every base
weight the adapter touches, two tensors:

- ``lora::<base weight name>::A``: ``[r, in_features]``, peft's ``lora_A``;
- ``lora::<base weight name>::B``: ``[out_features, r]``, peft's ``lora_B`` already multiplied
  by the adapter's scale ``lora_alpha / r``.

So the merged weight is ``W = W0 + B @ A`` with no configuration on the receiving side, and the
update is absolute (the whole adapter, not a difference from the previous one): a replica that
missed versions, or restarted from the base, is right after any one update. An update mixes
no plain weights with adapter tensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.common.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

PREFIX = "lora::"
PARTS = ("A", "B")


def adapter_name(base_weight: str, part: str) -> str:
    """The wire name of factor ``part`` (``A`` or ``B``) of the adapter on ``base_weight``."""
    return f"{PREFIX}{base_weight}::{part}"


def is_adapter_update(names: Mapping[str, Any] | list[str]) -> bool:
    """True when every name is an adapter tensor; InvalidArgument when only some are."""
    flags = {name.startswith(PREFIX) for name in names}
    if len(flags) > 1:
        raise InvalidArgument("a weight update mixes LoRA adapter tensors with plain weights")
    return flags == {True}


def adapter_pairs(
    state_dict: Mapping[str, torch.Tensor],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{base weight name: (A [r, in], B [out, r])}`` of an adapter update; InvalidArgument
    on a malformed name, a factor without its twin, or ranks that disagree."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        base, sep, part = name.removeprefix(PREFIX).rpartition("::")
        if not name.startswith(PREFIX) or not sep or not base or part not in PARTS:
            raise InvalidArgument(f"not a LoRA adapter tensor name: {name!r}")
        found.setdefault(base, {})[part] = tensor
    pairs = {}
    for base, parts in found.items():
        if set(parts) != set(PARTS):
            raise InvalidArgument(f"LoRA update for {base!r} lacks one of its factors A, B")
        a, b = parts["A"], parts["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise InvalidArgument(
                f"LoRA factors of {base!r} do not multiply: A {tuple(a.shape)}, B {tuple(b.shape)}"
            )
        pairs[base] = (a, b)
    return pairs


def check_pairs(
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """InvalidArgument unless each pair targets a known 2-D weight of matching shape."""
    for base, (a, b) in pairs.items():
        shape = shapes.get(base)
        if shape is None:
            raise InvalidArgument(f"LoRA update targets {base!r}, which the model does not have")
        if tuple(shape) != (b.shape[0], a.shape[1]):
            raise InvalidArgument(
                f"LoRA factors of {base!r} give {(b.shape[0], a.shape[1])}, weight is {shape}"
            )


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``base + b @ a`` in ``base``'s dtype (computed in float32 at least).

    base: [out, in]; a: [r, in]; b: [out, r] (already scaled)."""
    import torch

    wide = torch.promote_types(base.dtype, torch.float32)
    delta = b.to(wide) @ a.to(wide)
    return (base.to(wide) + delta).to(base.dtype)


class MergedAdapter:
    """An engine's merged adapter: the base values of the weights it touches are kept, and
    each update writes ``base + B @ A`` over them (exact: never ``W += new - old``).

    Why merge instead of running the adapter: generation then costs what the base costs, and
    the engine's model stays a plain one. The price is one copy of the targeted weights."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        """Base value of every weight the current adapter touches (by parameter name)."""

    def apply(
        self, params: Mapping[str, torch.Tensor], pairs: Mapping[str, tuple[Any, Any]]
    ) -> None:
        """Write the merged weights into ``params`` (in place); weights the previous adapter
        touched and this one does not get their base value back."""
        import torch

        with torch.no_grad():
            for name in [n for n in self.base if n not in pairs]:
                params[name].copy_(self.base.pop(name))
            for name, (a, b) in pairs.items():
                base = self.base.setdefault(name, params[name].detach().clone())
                params[name].copy_(merged(base, a, b))

    def forget(self) -> None:
        """A full update replaced the weights: they are the new base."""
        self.base.clear()


PEFT_KEY = "base_model.model.{module}.lora_{part}.weight"
"""How peft (and vLLM's LoRA loader) names a factor in ``adapter_model.safetensors``."""


def save_peft_adapter(
    path: str | Path, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], dtype=None
) -> Path:
    """Write an adapter update as a peft adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``), e.g. for vLLM's ``LoRARequest``. ``B`` is already scaled, so
    the config says ``lora_alpha = r`` (scale 1)."""
    import safetensors.torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, modules, ranks = {}, set(), set()
    for base, (a, b) in pairs.items():
        module = base.removesuffix(".weight")
        modules.add(module.rsplit(".", 1)[-1])
        ranks.add(a.shape[0])
        for part, tensor in (("A", a), ("B", b)):
            value = tensor.to(dtype) if dtype is not None else tensor
            tensors[PEFT_KEY.format(module=module, part=part)] = value.contiguous()
    if len(ranks) != 1:
        raise InvalidArgument(f"LoRA update mixes ranks {sorted(ranks)}")
    rank = ranks.pop()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": sorted(modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    safetensors.torch.save_file(tensors, str(path / "adapter_model.safetensors"))
    return path
