"""The optimizer the actor and the critic train with."""

from __future__ import annotations

from collections.abc import Iterable

import torch

FUSED_DEVICES = ("cpu", "cuda")
"""Where torch has a fused (one kernel for all parameters) AdamW."""


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float):
    """AdamW, fused when every parameter allows it.

    Why fused: the per-parameter loop of the default implementation is ~3 ms per step for the
    tiny policy's 50 tensors on CPU, several percent of an update (bench/results/actor_update.md);
    the fused kernel does the same arithmetic in one pass. The optimizer's state dict is the
    same either way, so checkpoints move between the two.
    """
    params = list(params)
    fused = bool(params) and all(
        p.device.type in FUSED_DEVICES and p.dtype in (torch.float32, torch.float16, torch.bfloat16)
        for p in params
    )
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
