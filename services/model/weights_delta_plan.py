"""The trainer's side of element-level weight deltas: which elements of the pushed weights
changed since the last push, compared by their raw bits in the dtype that is pushed.

Why raw bits of the pushed bytes: that is what the replica holds. An fp32 actor pushed in
bfloat16 (``rollout.dtype``) changes a served element only when its bf16 rounding moves, which
at RL learning rates is a small fraction of them, though every fp32 element moved; comparing the
encoded payloads sees exactly that, and -0.0 against 0.0 or one NaN against another as what
they are on the wire.

Why keep the last push's bytes rather than digests of them: an element delta needs the old
values to find which elements changed. The trainer keeps one copy of the payload it last
encoded (the payload itself when it is private; a copy when it lives in the shared-memory file
the next push writes again), which costs one model's worth of host memory while deltas are on.

The wire form and the replica's side are ``weights_delta``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfleet.model import weights, weights_delta

if TYPE_CHECKING:
    import numpy
    import torch

SAMPLE = 4096
"""Elements of a tensor compared first, evenly spread: when far more of them changed than
pairs could pay for, the tensor goes whole without comparing the rest (an fp32 push, where
nearly every element moves each step: its plan cost 1.3 s on SmolLM2 without this)."""
INDEX_BYTES = 4
"""An index is an int32: tensors of 2**31 elements or more always go whole."""
MAX_INDEXED = 2**31 - 1


@dataclass
class Plan:
    """A delta from ``base`` to the push just encoded."""

    base: int
    state: dict[str, torch.Tensor]
    """The delta's tensors, metadata first (views of the new payload and small new arrays)."""
    nbytes: int
    """The delta's payload bytes (metadata included)."""
    full_bytes: int

    @property
    def ratio(self) -> float:
        """Delta bytes over full push bytes (``weight/delta_ratio``)."""
        return self.nbytes / self.full_bytes if self.full_bytes else 1.0


@dataclass
class _Pushed:
    version: int
    header: weights.WeightHeader
    payload: numpy.ndarray  # uint8, the bytes of that push
    owned: bool = False
    """``payload`` is our own copy (written again by the next shared push), not the push's."""


class DeltaPlanner:
    """Keeps the last push's bytes and plans the element delta of the next one on them."""

    def __init__(self) -> None:
        self._last: _Pushed | None = None

    def forget(self) -> None:
        """Drop the kept push (deltas off, or a push that must not be a base)."""
        self._last = None

    def plan(
        self,
        header: weights.WeightHeader,
        payload: weights.BytesLike,
        force: bool = False,
        private: bool = True,
    ) -> Plan | None:
        """The delta from the last push to this one (None when there is no last push, it is
        not older, ``force`` is set, or the tensors' names, dtypes or shapes differ), then
        keep this push as the next base: by reference when ``private`` (nobody writes the
        payload again), else copied."""
        import numpy

        new = numpy.frombuffer(memoryview(payload).cast("B"), dtype=numpy.uint8)
        last = self._last
        plan = None
        if last is not None and not force and last.version < header.version:
            plan = element_delta(last.header, last.payload, header, new, last.version)
        self._last = _kept(header, new, last, private)
        return plan


def _kept(
    header: weights.WeightHeader, new: numpy.ndarray, last: _Pushed | None, private: bool
) -> _Pushed:
    import numpy

    if private:
        return _Pushed(header.version, header, new)
    if last is not None and last.owned and last.payload.nbytes == new.nbytes:
        target = last.payload  # our own copy, its pages warm: write it again
    else:
        target = weights.empty_bytes(new.nbytes).numpy()
    numpy.copyto(target, new)
    return _Pushed(header.version, header, target, owned=True)


def element_delta(
    old_header: weights.WeightHeader,
    old: numpy.ndarray,
    new_header: weights.WeightHeader,
    new: numpy.ndarray,
    base: int,
) -> Plan | None:
    """The delta that turns push ``old`` (version ``base``) into push ``new``: per tensor
    nothing (unchanged), index + value pairs, or the whole tensor (when the pairs would not be
    smaller). None when the two pushes do not hold the same tensors."""
    if _layout(old_header) != _layout(new_header):
        return None
    meta_name, meta = weights_delta.meta_tensor(new_header, base)
    state = {meta_name: meta}
    new_tensors = weights.decode_unchecked(new_header, new.data)
    for entry in new_header.tensors:
        state.update(_tensor_delta(entry, old, new, new_tensors[entry.name]))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return Plan(base, state, nbytes, new_header.total_bytes)


def _layout(header: weights.WeightHeader) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(e.name, e.dtype, e.shape) for e in header.tensors]


def _tensor_delta(
    entry: weights.TensorEntry, old: numpy.ndarray, new: numpy.ndarray, tensor: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """The wire parts of one tensor's change (none when its bits are unchanged)."""
    import numpy
    import torch

    span = slice(entry.offset, entry.offset + entry.nbytes)
    itemsize = tensor.element_size()
    raw = weights_delta.int_of_size(itemsize)
    if raw is None:  # no integer of that width: whole or nothing
        if not numpy.array_equal(old[span], new[span]):
            yield weights_delta.wire_name("whole", entry.name), tensor
        return
    old_bits, new_bits = old[span].view(raw), new[span].view(raw)
    if _mostly_changed(old_bits, new_bits, itemsize):
        yield weights_delta.wire_name("whole", entry.name), tensor
        return
    changed = old_bits != new_bits
    count = int(numpy.count_nonzero(changed))
    if count == 0:
        return
    if count * (INDEX_BYTES + itemsize) >= entry.nbytes or tensor.numel() > MAX_INDEXED:
        yield weights_delta.wire_name("whole", entry.name), tensor
        return
    index = numpy.flatnonzero(changed).astype(numpy.int32)
    values = torch.from_numpy(new_bits[index]).view(tensor.dtype)
    yield weights_delta.wire_name("index", entry.name), torch.from_numpy(index)
    yield weights_delta.wire_name("value", entry.name), values


def _mostly_changed(old_bits: numpy.ndarray, new_bits: numpy.ndarray, itemsize: int) -> bool:
    """Whether a sample of ``SAMPLE`` elements says the tensor should go whole: more than 1.5x
    the changed fraction at which pairs stop being smaller (``itemsize / (4 + itemsize)``)."""
    import numpy

    if len(old_bits) <= 4 * SAMPLE:
        return False  # small: compare it all
    stride = len(old_bits) // SAMPLE
    sample = numpy.count_nonzero(old_bits[::stride] != new_bits[::stride])
    return bool(sample > 1.5 * itemsize / (INDEX_BYTES + itemsize) * len(old_bits[::stride]))
