"""Delta weight updates: only the elements that changed since the version a replica holds.

Why: a full push sends every byte of the model after every step. At RL learning rates most
elements of the weights the replicas serve keep their bits from one step to the next (an fp32
actor pushed in bfloat16 changes a bf16 element only when its rounding moves), so a delta
carries, per tensor, only the changed elements as index + value pairs; a tensor whose pairs
would not be smaller than the tensor goes whole, and an unchanged one not at all. The trainer's
side (comparing raw bits, choosing) is ``weights_delta_plan``; this is the wire form and the
replica's side. Nothing about it can go wrong silently:

- it names the base version it applies to, in the name of its one metadata tensor
  (``delta::meta::<base version>``), so a replica refuses it from the header alone, before any
  byte arrives, when it does not serve that version (FAILED_PRECONDITION: the trainer then
  sends that replica the full weights);
- its payload is checksummed like any update (a corrupted delta is INVALID_ARGUMENT);
- the metadata holds the checksum the *full* push of the resulting weights would carry, and the
  replica computes it over the weights it assembled (its kept base with the changes in place)
  before the engine sees them: a replica whose base differs from the trainer's by one bit
  refuses (FAILED_PRECONDITION) and keeps serving what it had.

Like LoRA updates (``lora.py``) a delta is recognised by its tensor names, so the header, the
proto and every transport stay as they are. After ``delta::`` comes a kind, then the full
tensor's name (which may itself hold ``::``, as LoRA names do; the kind is read up to the first
``::``, so the two schemes cannot clash):

- ``delta::whole::<name>``: the whole tensor, in its dtype and shape;
- ``delta::index::<name>``: int32 flat indices of the changed elements (1-D);
- ``delta::value::<name>``: their new values, in the tensor's dtype (1-D, same length).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.model import weights, weights_checksum

if TYPE_CHECKING:
    import numpy
    import torch

PREFIX = "delta::"
META = f"{PREFIX}meta::"
KINDS = ("whole", "index", "value")


def wire_name(kind: str, name: str) -> str:
    """The wire name of part ``kind`` (``whole``, ``index``, ``value``) of tensor ``name``."""
    return f"{PREFIX}{kind}::{name}"


def tensor_name(name: str) -> str:
    """The wire name of tensor ``name`` sent whole inside a delta."""
    return wire_name("whole", name)


def split_name(wire: str) -> tuple[str, str]:
    """``(kind, tensor name)`` of a delta part's wire name; InvalidArgument if it is none."""
    kind, sep, name = wire.removeprefix(PREFIX).partition("::")
    if not wire.startswith(PREFIX) or not sep or not name or kind not in KINDS:
        raise InvalidArgument(f"weight delta: unexpected tensor {wire!r}")
    return kind, name


def original_name(wire: str) -> str:
    """The full tensor's name behind a delta part's wire name (any other name unchanged)."""
    if not wire.startswith(PREFIX) or wire.startswith(META):
        return wire
    return wire.removeprefix(PREFIX).partition("::")[2] or wire


def is_delta(header: weights.WeightHeader) -> bool:
    """True when the update is a delta (its first tensor is the metadata)."""
    return bool(header.tensors) and header.tensors[0].name.startswith(META)


def base_version(header: weights.WeightHeader) -> int:
    """The version a delta applies to, read from the header (no payload needed)."""
    raw = header.tensors[0].name.removeprefix(META)
    if not raw.isdigit():
        raise InvalidArgument(f"weight delta: bad metadata name {header.tensors[0].name!r}")
    return int(raw)


def meta_tensor(full: weights.WeightHeader, base: int) -> tuple[str, torch.Tensor]:
    """The metadata tensor of a delta from version ``base`` to the push ``full`` describes:
    the full weights' names in order and the checksum of their full push."""
    import torch

    meta = {"checksum": full.checksum, "names": [e.name for e in full.tensors]}
    raw = bytearray(json.dumps(meta).encode())
    return f"{META}{base}", torch.frombuffer(raw, dtype=torch.uint8)


@dataclass
class Part:
    """What a delta carries for one tensor: the whole of it, or its changed elements."""

    whole: torch.Tensor | None = None
    index: torch.Tensor | None = None
    value: torch.Tensor | None = None


def apply(
    decoded: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The full weights a verified delta describes, in the trainer's order: ``base``'s tensors
    with the changed elements written into them *in place* (no copy of the model: the caller
    keeps ``base`` for this alone, and it becomes the new version), tensors sent whole in
    theirs. FailedPrecondition unless the result hashes to the full push's checksum (the base
    is not the trainer's), InvalidArgument for a malformed delta; either way ``base`` is left
    as it was (the elements written are put back)."""
    items = iter(decoded.items())
    meta_name, meta_tensor_ = next(items, ("", None))
    if meta_tensor_ is None or not meta_name.startswith(META):
        raise InvalidArgument("weight delta: the metadata tensor must come first")
    meta = _meta(meta_tensor_)
    parts = _parts(items)
    unknown = sorted(set(parts) - set(meta["names"]))
    missing = sorted(n for n in meta["names"] if n not in base and _whole(parts.get(n)) is None)
    if unknown or missing:
        raise FailedPrecondition(
            f"weight delta does not fit the weights held here: "
            f"unknown={unknown[:3]} missing={missing[:3]}"
        )
    full = {name: _whole(parts.get(name)) for name in meta["names"]}
    scatters = [
        Scatter.of(name, base[name], part) for name, part in parts.items() if part.whole is None
    ]
    try:
        for scatter in scatters:
            scatter.write()
        full = {name: full[name] if full[name] is not None else base[name] for name in full}
        verify_full_checksum(meta["checksum"], full.values())
    except BaseException:
        for scatter in reversed(scatters):
            scatter.undo()
        raise
    return full


def changes(decoded: Mapping[str, torch.Tensor]) -> dict[str, Part]:
    """What a delta changes, by full tensor name (its metadata, the first tensor, left out;
    unchanged tensors absent): what an engine swaps in instead of the whole model."""
    items = iter(decoded.items())
    next(items, None)
    return _parts(items)


def _parts(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Part]:
    parts: dict[str, Part] = {}
    for wire, tensor in items:
        kind, name = split_name(wire)
        part = parts.setdefault(name, Part())
        if getattr(part, kind) is not None:
            raise InvalidArgument(f"weight delta: {wire!r} appears twice")
        setattr(part, kind, tensor)
    for name, part in parts.items():
        if part.whole is not None and (part.index is not None or part.value is not None):
            raise InvalidArgument(f"weight delta: {name!r} is sent whole and as elements")
    return parts


def _whole(part: Part | None) -> torch.Tensor | None:
    return None if part is None else part.whole


@dataclass
class Scatter:
    """New values for some elements of one tensor, written into its raw bits in place (numpy:
    torch's threaded copy and scatter crawl on a busy 2-core machine), and undone on demand."""

    target: numpy.ndarray
    """The tensor's elements as integers of their width: a view, writes change the tensor."""
    positions: numpy.ndarray
    values: numpy.ndarray
    saved: numpy.ndarray | None = None

    @classmethod
    def of(cls, name: str, old: torch.Tensor, part: Part) -> Scatter:
        """InvalidArgument when the pair is malformed: a missing half, indices not 1-D int32,
        values not as many or not in ``old``'s dtype, an index out of range."""
        import torch

        index, value = part.index, part.value
        if index is None or value is None:
            raise InvalidArgument(f"weight delta: {name!r} lacks its index or value part")
        if index.dtype != torch.int32 or index.dim() != 1:
            raise InvalidArgument(f"weight delta: indices of {name!r} must be 1-D int32")
        if value.dtype != old.dtype or value.shape != index.shape:
            raise InvalidArgument(
                f"weight delta: values of {name!r} must be {len(index)} of {old.dtype}, "
                f"got {tuple(value.shape)} of {value.dtype}"
            )
        bits = int_of_size(old.element_size())
        if bits is None or not old.is_contiguous():
            raise InvalidArgument(f"weight delta: {name!r} cannot take elements; send it whole")
        positions = index.numpy()
        if len(positions) and (int(positions.min()) < 0 or int(positions.max()) >= old.numel()):
            raise InvalidArgument(f"weight delta: an index of {name!r} is out of range")
        return cls(raw_bits(old, bits), positions, raw_bits(value, bits))

    def write(self) -> None:
        self.saved = self.target[self.positions]  # a copy: fancy indexing
        self.target[self.positions] = self.values

    def undo(self) -> None:
        if self.saved is not None:
            self.target[self.positions] = self.saved
            self.saved = None


def int_of_size(itemsize: int) -> type | None:
    """The numpy integer as wide as one element, to read raw bits (None if there is none)."""
    import numpy

    return {1: numpy.int8, 2: numpy.int16, 4: numpy.int32, 8: numpy.int64}.get(itemsize)


def raw_bits(tensor: torch.Tensor, bits: type) -> numpy.ndarray:
    """A CPU tensor's elements as integers of the same width (a view, flat)."""
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().view(bits)


def _meta(tensor: torch.Tensor) -> dict:
    try:
        meta = json.loads(bytes(tensor.numpy()))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"weight delta: unreadable metadata ({exc})") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("names"), list):
        raise InvalidArgument("weight delta: metadata lacks the tensor names")
    if not isinstance(meta.get("checksum"), str):
        raise InvalidArgument("weight delta: metadata lacks the full checksum")
    return meta


def verify_full_checksum(expected: str, tensors: Iterable[torch.Tensor]) -> None:
    """FailedPrecondition unless the tensors' bytes, one after another, hash to ``expected``
    (the checksum a full push of them carries; one pass, no concatenated copy)."""
    algorithm, _, digest = expected.partition(":")
    hasher = weights_checksum.Hasher(algorithm)
    for tensor in tensors:
        hasher.update(_bytes_of(tensor))
    if hasher.hexdigest() != digest:
        raise FailedPrecondition(
            "weight delta: the weights it would give differ from the trainer's (this replica's "
            "base is not the version the delta was made from); a full push is needed"
        )


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())
