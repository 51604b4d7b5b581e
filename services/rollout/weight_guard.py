"""Refusing weight updates whose values are absurd, though finite (``rollout.max_weight_abs``).

Why: ``check_finite`` catches NaN and infinity, but an update scaled by 1e30 is finite and
would be served, every answer garbage, until the next push. No trained model holds values
anywhere near such a bound (fp16 cannot even hold more than 65504), so one past it is a bug
upstream: the update is refused with INVALID_ARGUMENT naming the tensor, and the old weights
keep serving. Runs in the worker thread that verifies the payload; min and max are read in
one pass with no temporary as big as the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlfleet.common.errors import InvalidArgument


def check_magnitude(state_dict: Mapping[str, Any], limit: float | None) -> None:
    """InvalidArgument naming the first floating tensor with a value beyond ``limit`` in
    magnitude; None checks nothing."""
    if limit is None:
        return
    for name, tensor in state_dict.items():
        largest = _largest_magnitude(tensor)
        if largest > limit:
            raise InvalidArgument(f"weight update refused: tensor {name!r} holds a value of "
                                  f"magnitude {largest:.3g} > rollout.max_weight_abs "
                                  f"{limit:g}; the old weights keep serving")  # fmt: skip


def _largest_magnitude(tensor: Any) -> float:
    """max |x| of a floating tensor (0 for other dtypes and empty tensors)."""
    import torch

    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        return 0.0
    if tensor.numel() == 0:
        return 0.0
    low, high = torch.aminmax(tensor.reshape(-1))
    return max(abs(float(low)), abs(float(high)))
