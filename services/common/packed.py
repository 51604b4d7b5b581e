"""The one packed form of a record full of numbers: magic, header length, JSON header, arrays.

Why: a generation result and an episode each hold thousands of token ids, log-probs and
weight versions, which JSON would print and parse one number at a time. Both travel (Redis,
gRPC bytes) as a 4-byte magic that names the record and is never the first byte of JSON, a
little-endian uint32 header length, a JSON header (the scalars, and how long each array is),
then the arrays back to back, little-endian on every machine, so a router and a replica on
different hosts agree. ``pack`` writes it; ``unpack`` and ``read_arrays`` read it and raise
``PackedError`` for bytes that are not such a record or whose arrays do not fill the body
exactly, so a damaged entry never decodes into a half-valid record. An env worker's answer
(``rlfleet.env.types.EpisodeOutcome``) is the same frame with no arrays and the episode's
packed bytes as its body.

Array type codes are ``array``'s: ``i`` int32, ``B`` uint8, ``f`` float32, ``q`` int64.
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

HEADER_LEN = struct.Struct("<I")
WIDTH = {"i": 4, "B": 1, "f": 4, "q": 8}
_LITTLE = struct.pack("=i", 1) == struct.pack("<i", 1)


class PackedError(ValueError):
    """Bytes that are not the packed record asked for (magic, header or sizes)."""


def pack(magic: bytes, header: Any, arrays: Iterable[tuple[str, Sequence[Any]]]) -> bytes:
    """``magic``, the header's length and JSON, then each ``(typecode, values)`` array."""
    head = json.dumps(header, separators=(",", ":"), default=str).encode()
    body = [_little(array(code, values)).tobytes() for code, values in arrays]
    return b"".join([magic, HEADER_LEN.pack(len(head)), head, *body])


def is_packed(magic: bytes, data: bytes | bytearray | memoryview) -> bool:
    return isinstance(data, bytes | bytearray | memoryview) and bytes(data[: len(magic)]) == magic


def unpack(magic: bytes, data: bytes | bytearray | memoryview) -> tuple[Any, memoryview]:
    """(the JSON header, the body after it); PackedError for anything but a ``magic`` record."""
    if not is_packed(magic, data):
        raise PackedError("bad magic: not this kind of packed record")
    start = len(magic) + HEADER_LEN.size
    if len(data) < start:
        raise PackedError("too short for its header")
    (size,) = HEADER_LEN.unpack_from(data, len(magic))
    if len(data) < start + size:
        raise PackedError(f"header says {size} bytes, {len(data) - start} follow")
    view = memoryview(bytes(data))
    try:
        header = json.loads(bytes(view[start : start + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackedError(f"header is not JSON: {exc}") from exc
    return header, view[start + size :]


def read_arrays(body: memoryview | bytes, layout: Sequence[tuple[str, int]]) -> list[list[Any]]:
    """The arrays ``layout`` names (``(typecode, count)`` each), which must fill ``body``."""
    sizes = [WIDTH[code] * count for code, count in layout]
    if len(body) != sum(sizes):
        raise PackedError(f"body is {len(body)} bytes, its header says {sum(sizes)}")
    arrays, offset = [], 0
    for (code, _), size in zip(layout, sizes, strict=True):
        values = array(code)
        values.frombytes(bytes(body[offset : offset + size]))
        arrays.append(_little(values).tolist())
        offset += size
    return arrays


def _little(values: array) -> array:
    """Little-endian on any machine (a no-op on the little-endian ones)."""
    if not _LITTLE:
        values = array(values.typecode, values)
        values.byteswap()
    return values
