"""Refusing weight updates whose values are absurd, though finite (``rollout.max_weight_abs``).

Why: ``check_finite`` catches NaN and infinity, but an update scaled by 1e30 is finite and
would be served, every answer garbage, until the next push. No trained model holds values
anywhere near such a bound (fp16 cannot even hold more than 65504), so one past it is a bug
upstream: the update is refused with INVALID_ARGUMENT naming the tensor, and the old weights
keep serving. Runs in the worker thread that verifies the payload, on the magnitudes read in
the checksum's pass (``weight_updates.verified``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlfleet.common.errors import InvalidArgument
from rlfleet.model import weights_magnitude


def check_magnitude(
    state_dict: Mapping[str, Any], limit: float | None, largest: Mapping[str, float] | None = None
) -> None:
    """InvalidArgument naming the first floating tensor with a value beyond ``limit`` in
    magnitude; None checks nothing. ``largest``: magnitudes already read (``weights.
    decode_measured`` reads them in the checksum's pass); others are read here."""
    if limit is None:
        return
    for name, tensor in state_dict.items():
        known = largest.get(name) if largest is not None else None
        value = _largest_magnitude(tensor) if known is None else known
        if value > limit:
            raise InvalidArgument(
                f"weight update refused: tensor {name!r} holds a value of "
                f"magnitude {value:.3g} > rollout.max_weight_abs "
                f"{limit:g}; the old weights keep serving"
            )


def _largest_magnitude(tensor: Any) -> float:
    """max |x| of a floating tensor (0 for other dtypes and empty tensors)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return 0.0
    return weights_magnitude.largest_magnitude(tensor)
