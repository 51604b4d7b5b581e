"""The checksum of a weight payload: computed once by the sender, verified once by a replica.

xxh3-128 (xxhash, several times faster than memcpy) where xxhash is installed, else zlib's
crc32; receivers check xxh3_128, crc32 and sha256 (older senders' ``sha256``). A checksum
travels as ``"<algorithm>:<hex digest>"`` in the header, so a receiver knows which to run.
``Hasher`` takes the bytes piece by piece, so the codec hashes a piece while it is in cache.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

from rlfleet.common.errors import InvalidArgument

BytesLike = bytes | bytearray | memoryview


def _xxh3_128(data: BytesLike) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def _crc32(data: BytesLike) -> str:
    return f"{zlib.crc32(data):08x}"


def _sha256(data: BytesLike) -> str:
    return hashlib.sha256(data).hexdigest()


CHECKSUMS = {"xxh3_128": _xxh3_128, "crc32": _crc32, "sha256": _sha256}


def default_algorithm() -> str:
    """xxh3_128 when xxhash is importable (fast), else crc32 (stdlib)."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3_128"


class Hasher:
    """A streaming checksum: fed the bytes piece by piece, in order, it gives the same digest
    as ``CHECKSUMS[algorithm]`` over all of them. InvalidArgument for an algorithm this module
    does not know or that is not installed here (xxhash)."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm, self._crc = algorithm, 0
        self._hash: Any = None  # an xxh3_128 or a sha256: both update() and digest()
        if algorithm not in CHECKSUMS:
            raise InvalidArgument(f"weight update: unsupported checksum {algorithm[:40]!r}")
        if algorithm == "xxh3_128":
            try:
                import xxhash
            except ImportError as exc:
                raise InvalidArgument(
                    f"weight update: checksum {algorithm} unavailable here"
                ) from exc
            self._hash = xxhash.xxh3_128()
        elif algorithm == "sha256":
            self._hash = hashlib.sha256()

    def update(self, data: BytesLike) -> None:
        if self._hash is None:
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._hash.update(data)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}" if self._hash is None else self._hash.hexdigest()


def checksum(data: BytesLike, algorithm: str | None = None) -> str:
    algorithm = algorithm or default_algorithm()
    return f"{algorithm}:{CHECKSUMS[algorithm](data)}"


def verify_checksum(expected: str, data: BytesLike) -> None:
    """InvalidArgument unless ``data`` hashes to ``expected`` (one pass over the bytes)."""
    algorithm, _, digest = expected.partition(":")
    if algorithm not in CHECKSUMS or not digest:
        raise InvalidArgument(f"weight update: unsupported checksum {expected[:40]!r}")
    try:
        actual = CHECKSUMS[algorithm](data)
    except ImportError as exc:
        raise InvalidArgument(f"weight update: checksum {algorithm} unavailable here") from exc
    if actual != digest:
        raise InvalidArgument(f"weight payload checksum mismatch ({algorithm})")
