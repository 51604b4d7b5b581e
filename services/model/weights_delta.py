"""Delta weight updates: only the tensors that changed since the version a replica holds.

Why: a full push sends every byte of the model after every step, but when some tensors do not
change (frozen layers, an embedding no gradient reached, bf16 weights whose update is below
their resolution) sending them again is wasted wire and load time. A delta carries only the
changed tensors, and nothing about it can go wrong silently:

- it names the base version it applies to, in the name of its one metadata tensor
  (``delta::meta::<base version>``), so a replica refuses it from the header alone, before any
  byte arrives, when it does not serve that version (FAILED_PRECONDITION: the trainer then
  sends that replica the full weights);
- its payload is checksummed like any update (a corrupted delta is INVALID_ARGUMENT);
- the metadata holds the checksum the *full* push of the resulting weights would carry, and the
  replica computes it over the weights it assembled (its kept base with the changed tensors in
  place) before the engine sees them: a replica whose base differs from the trainer's by one
  bit refuses (FAILED_PRECONDITION) and keeps serving what it had.

Like LoRA updates (``lora.py``) a delta is recognised by its tensor names, so the header, the
proto and every transport stay as they are: changed tensors travel as ``delta::<name>`` in the
dtype and shape of the full tensor (``check_no_narrowing`` still applies to them).

Only the changed-tensors form is built. XOR of the old and new bytes plus compression was
measured (``bench/bench_weights.py --delta``, docs/weight_delta.md): far fewer bytes for a bf16
actor, but compressing the whole model each step costs more than the push itself except over
links slower than about 1 Gbit/s, so it is not built.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.model import lora, weights, weights_checksum

if TYPE_CHECKING:
    import torch

PREFIX = "delta::"
META = f"{PREFIX}meta::"


def tensor_name(name: str) -> str:
    """The wire name of changed tensor ``name`` inside a delta."""
    return f"{PREFIX}{name}"


def is_delta(header: weights.WeightHeader) -> bool:
    """True when the update is a delta (its first tensor is the metadata)."""
    return bool(header.tensors) and header.tensors[0].name.startswith(META)


def base_version(header: weights.WeightHeader) -> int:
    """The version a delta applies to, read from the header (no payload needed)."""
    raw = header.tensors[0].name.removeprefix(META)
    if not raw.isdigit():
        raise InvalidArgument(f"weight delta: bad metadata name {header.tensors[0].name!r}")
    return int(raw)


def tensor_digests(header: weights.WeightHeader, payload: weights.BytesLike) -> dict[str, str]:
    """``{name: digest}`` of each tensor of an encoded full push (the trainer's record of what
    it sent, to find what changed next time). One pass over the payload."""
    view = memoryview(payload).cast("B")
    return {e.name: _digest(view[e.offset : e.offset + e.nbytes]) for e in header.tensors}


def _digest(data: weights.BytesLike) -> str:
    try:
        import xxhash
    except ImportError:
        return hashlib.blake2b(data, digest_size=16).hexdigest()
    return xxhash.xxh3_128_hexdigest(data)


def changed_names(old: Mapping[str, str], new: Mapping[str, str]) -> list[str] | None:
    """Names whose digest differs, in ``new``'s order; None when the names themselves differ
    (another model: only a full push makes sense)."""
    if list(old) != list(new):
        return None
    return [name for name, digest in new.items() if old[name] != digest]


def delta_state(
    full: weights.WeightHeader, payload: weights.BytesLike, changed: Iterable[str], base: int
) -> dict[str, torch.Tensor]:
    """The tensors of a delta: metadata first, then each changed tensor of the full payload
    under its ``delta::`` name (views of ``payload``; ``weights.encode`` copies them once)."""
    import torch

    meta = {"checksum": full.checksum, "names": [e.name for e in full.tensors]}
    raw = bytearray(json.dumps(meta).encode())
    state = {f"{META}{base}": torch.frombuffer(raw, dtype=torch.uint8)}
    tensors = weights.decode_unchecked(full, payload)
    for name in changed:
        state[tensor_name(name)] = tensors[name]
    return state


def delta_nbytes(full: weights.WeightHeader, changed: Iterable[str]) -> int:
    """Payload bytes of the changed tensors (the metadata adds a few KiB)."""
    sizes = {e.name: e.nbytes for e in full.tensors}
    return sum(sizes[name] for name in changed)


def apply(
    decoded: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The full weights a verified delta describes: ``base`` with the changed tensors in place,
    in the trainer's order. FailedPrecondition unless they hash to the full push's checksum
    (the base is not the trainer's); InvalidArgument for a malformed delta."""
    items = iter(decoded.items())
    meta_name, meta_tensor = next(items, ("", None))
    if meta_tensor is None or not meta_name.startswith(META):
        raise InvalidArgument("weight delta: the metadata tensor must come first")
    meta = _meta(meta_tensor)
    changed = {}
    for name, tensor in items:
        if not name.startswith(PREFIX) or name.startswith(META):
            raise InvalidArgument(f"weight delta: unexpected tensor {name!r}")
        changed[name.removeprefix(PREFIX)] = tensor
    unknown = sorted(set(changed) - set(meta["names"]))
    missing = sorted(set(meta["names"]) - set(changed) - set(base))
    if unknown or missing:
        raise FailedPrecondition(
            f"weight delta does not fit the weights held here: "
            f"unknown={unknown[:3]} missing={missing[:3]}"
        )
    full = {name: changed.get(name, base.get(name)) for name in meta["names"]}
    verify_full_checksum(meta["checksum"], full.values())
    return full


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


def applicable(state_dict: Mapping[str, object]) -> bool:
    """Whether a state dict may be sent as a delta: not a LoRA adapter update (those are
    absolute and small, and an engine drops the factors a partial one leaves out)."""
    return bool(state_dict) and not lora.is_adapter_update(list(state_dict))
