"""A delta's changed elements written straight into an engine's parameters.

Why: after a delta the replica knows exactly which elements moved (``weights_delta.changes``);
copying the whole model into the parameters would make the replica's pause as long as a full
load. Everything but the writes is prepared while the old weights serve (values cast to the
parameter's dtype and moved to its device, indices widened for torch); only ``write`` runs
with admission closed. On CPU the writes go through numpy over the raw bits (torch's threaded
scatter crawls on a busy 2-core machine); elsewhere through ``index_copy_``.

The result is the bits the full load would give: a full load copies (``copy_``, casting) the
whole tensor, and the elements not written already hold those bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlfleet.model.weights_delta import Part, int_of_size, raw_bits


@dataclass
class ElementWrite:
    """New values for some (``index``), or all (``index`` None), elements of one parameter."""

    target: Any
    """The parameter's flat elements: a numpy array of its raw bits, or a torch view."""
    index: Any
    value: Any

    def write(self) -> None:
        if isinstance(self.target, torch.Tensor):
            if self.index is None:
                self.target.copy_(self.value)
            else:
                self.target.index_copy_(0, self.index, self.value)
        elif self.index is None:
            self.target[:] = self.value
        else:
            self.target[self.index] = self.value


def prepare(
    params: Mapping[str, torch.Tensor], changes: Mapping[str, Part], skip: frozenset[str]
) -> list[ElementWrite] | None:
    """The writes that turn ``params`` (holding the delta's base) into the new weights;
    ``skip`` names parameters that share storage with another (tied). None when a parameter
    cannot take element writes (not contiguous): then the engine loads the whole model."""
    writes = []
    for name, part in changes.items():
        if name in skip:
            continue
        param = params[name].detach()
        if not param.is_contiguous():
            return None
        writes.append(_write_for(param, part))
    return writes


def _write_for(param: torch.Tensor, part: Part) -> ElementWrite:
    source = part.whole if part.whole is not None else part.value
    if source is None:  # weights_delta.apply refuses such a delta before this
        raise ValueError("a delta part without values")
    value = source.to(dtype=param.dtype, device=param.device).reshape(-1)
    bits = int_of_size(param.element_size())
    if param.device.type == "cpu" and bits is not None:
        index = None if part.index is None else part.index.numpy()
        return ElementWrite(raw_bits(param, bits), index, raw_bits(value, bits))
    index = None if part.index is None else part.index.to(param.device, torch.int64)
    return ElementWrite(param.view(-1), index, value)


def write_all(writes: list[ElementWrite]) -> None:
    with torch.no_grad():
        for write in writes:
            write.write()


def count(writes: list[ElementWrite]) -> int:
    """Elements the writes change."""
    return sum(len(w.value) for w in writes)
