"""Requests gRPC could not parse become INVALID_ARGUMENT naming the field, not UNKNOWN.

Why: grpc parses the request before any handler (or interceptor wrapper) runs, and a parse
failure (a ``string`` field holding bytes that are not UTF-8, a truncated message) reaches the
caller as ``UNKNOWN: Unexpected DecodeError``, which says neither that the request is at fault
nor where. ``tolerant`` wraps a method's deserializer so a failure becomes an ``Undecodable``
value; the server's wrapper raises ``InvalidArgument`` for it, with the dotted name of the
string field at fault when one is (found by walking the wire format, ``bad_utf8_field``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from rlfleet.common.errors import InvalidArgument

_FIXED_WIDTH = {1: 8, 5: 4}  # wire types 1 (64-bit) and 5 (32-bit)


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request that did not parse."""

    message: str


def tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer``, returning ``Undecodable`` instead of raising."""
    if deserializer is None:
        return None
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the sender's
            return Undecodable(_describe(descriptor, bytes(raw), exc))

    return parse


def check(request: Any) -> Any:
    """``request`` itself, or InvalidArgument if it did not parse."""
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.message)
    return request


async def checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request stream whose unparsable message raises InvalidArgument where it occurs."""
    async for request in requests:
        yield check(request)


def _describe(descriptor: Descriptor | None, raw: bytes, exc: Exception) -> str:
    field = bad_utf8_field(descriptor, raw) if isinstance(descriptor, Descriptor) else None
    if field:
        return f"{field} is not valid UTF-8 (string fields must be UTF-8)"
    return f"the request could not be parsed: {exc}"


def bad_utf8_field(descriptor: Descriptor, raw: bytes, prefix: str = "") -> str | None:
    """The dotted name of the first string field in ``raw`` that is not UTF-8, else None."""
    position = 0
    try:
        while position < len(raw):
            key, position = read_varint(raw, position)
            number, wire = key >> 3, key & 7
            if wire != 2:
                position = _skip(raw, position, wire)
                continue
            size, position = read_varint(raw, position)
            chunk, position = raw[position : position + size], position + size
            if found := _field_problem(descriptor.fields_by_number.get(number), chunk, prefix):
                return found
    except ValueError:
        return None
    return None


def _field_problem(field: FieldDescriptor | None, chunk: bytes, prefix: str) -> str | None:
    if field is None:
        return None
    name = prefix + field.name
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            return name
    elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
        return bad_utf8_field(field.message_type, chunk, name + ".")
    return None


def _skip(raw: bytes, position: int, wire: int) -> int:
    if wire == 0:
        return read_varint(raw, position)[1]
    if wire in _FIXED_WIDTH:
        return position + _FIXED_WIDTH[wire]
    raise ValueError(f"wire type {wire} not walked")


def read_varint(raw: bytes | memoryview, position: int) -> tuple[int, int]:
    """(value, position after it) of the protobuf varint at ``position``; ValueError if cut."""
    value, shift = 0, 0
    while position < len(raw) and shift < 64:
        byte = raw[position]
        value |= (byte & 0x7F) << shift
        position, shift = position + 1, shift + 7
        if not byte & 0x80:
            return value, position
    raise ValueError("truncated varint")
