"""Protobuf ``Struct`` / ``Value`` -> plain Python, with integral numbers back as ints.

Why: a ``Struct`` holds only doubles, so ``{"index": 3}`` comes back as ``3.0`` and a list
indexed with it fails. Every role whose proto carries free-form JSON (the reward service's
``extra_info`` and ground truth, the env service's task) reads it back through here, so they
agree on which numbers become ints: integral ones small enough to be exact in a double.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2

_MAX_EXACT_INT = 2**53


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    """The ``Struct`` as a dict, integral numbers as ints."""
    return restore_ints(json_format.MessageToDict(struct))


def value_to_python(value: struct_pb2.Value) -> Any:
    """The ``Value`` as the JSON value it holds (a dict stays a dict, ``12`` stays an int)."""
    return restore_ints(json_format.MessageToDict(value))


def restore_ints(value: Any) -> Any:
    """``value`` with every integral float (at any depth) turned back into an int."""
    if isinstance(value, dict):
        return {key: restore_ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [restore_ints(item) for item in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < _MAX_EXACT_INT:
        return int(value)
    return value
