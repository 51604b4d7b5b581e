"""Weight codec: a small control header plus raw bytes in chunks, with a checksum.

The header (version, tensor names, dtypes, shapes, byte offsets, total size, sha256)
travels apart from the payload, as in TRL's ``vllm_serve`` split between control and
data. The receiver rebuilds tensors only after the size and checksum match, so a
truncated or corrupted update is rejected before it can touch a model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from rlfleet.common.errors import InvalidArgument

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class WeightHeader:
    version: int
    tensors: list[TensorEntry]
    total_bytes: int
    sha256: str
    flush_cache: bool = True
    extra: dict = field(default_factory=dict)


def _dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def encode(state_dict: dict, version: int, flush_cache: bool = True) -> tuple[WeightHeader, bytes]:
    """Flatten tensors into one byte payload and describe them in a header."""
    import torch

    entries, parts, offset = [], [], 0
    for name, tensor in state_dict.items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        data = flat.numpy().tobytes()
        entries.append(
            TensorEntry(name, _dtype_name(tensor), tuple(tensor.shape), offset, len(data))
        )
        parts.append(data)
        offset += len(data)
    payload = b"".join(parts)
    header = WeightHeader(version, entries, len(payload), sha256_hex(payload), flush_cache)
    return header, payload


def sha256_hex(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def iter_chunks(payload: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    view = memoryview(payload)
    for start in range(0, len(payload), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])


def join_chunks(chunks: Iterable[bytes], expected_bytes: int) -> bytes:
    """Concatenate chunks, refusing to buffer more than the header announced."""
    buffer = bytearray()
    for chunk in chunks:
        buffer.extend(chunk)
        if len(buffer) > expected_bytes:
            raise InvalidArgument(f"weight payload exceeds the announced {expected_bytes} bytes")
    return bytes(buffer)


def validate_header(header: WeightHeader) -> None:
    """Structural checks that need no payload: offsets tile the payload exactly."""
    if header.version < 1:
        raise InvalidArgument(f"weight version must be >= 1, got {header.version}")
    if not header.tensors:
        raise InvalidArgument("weight update names no tensors")
    expected_offset = 0
    for entry in header.tensors:
        if entry.offset != expected_offset or entry.nbytes < 0:
            raise InvalidArgument(f"tensor {entry.name!r} has a bad offset/size")
        expected_offset += entry.nbytes
    if expected_offset != header.total_bytes:
        raise InvalidArgument("tensor sizes do not add up to total_bytes")


def decode(header: WeightHeader, payload: bytes) -> dict:
    """Verify size and checksum, then rebuild ``{name: tensor}`` (CPU tensors)."""
    import torch

    validate_header(header)
    if len(payload) != header.total_bytes:
        raise InvalidArgument(
            f"weight payload truncated: got {len(payload)} of {header.total_bytes} bytes"
        )
    if sha256_hex(payload) != header.sha256:
        raise InvalidArgument("weight payload checksum mismatch (sha256)")
    buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return {entry.name: _rebuild(buffer, entry) for entry in header.tensors}


def _rebuild(buffer, entry: TensorEntry):
    import torch

    dtype = getattr(torch, entry.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"tensor {entry.name!r}: unknown dtype {entry.dtype!r}")
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    try:
        return raw.view(dtype).reshape(entry.shape).clone()
    except RuntimeError as exc:
        raise InvalidArgument(f"tensor {entry.name!r}: {exc}") from exc
