"""Cutting an update into micro-batches and data-parallel shards without changing it.

Why its own module: a mini-batch's gradient and metrics must come out the same whether it
runs in one forward, in micro-batches (``trainer.ppo_micro_batch_size``) or across
data-parallel ranks; these are the pieces that keep it so (each part weighted by its share
of the loss's denominator), shared by the single actor and the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlfleet.rl.losses import TOKEN_MEAN_METRICS
from rlfleet.rl.sequences import map_micro_batches


def loss_denominator(mode: str, mask: torch.Tensor) -> torch.Tensor:
    """What ``agg_loss(mode)`` divides a batch's summed loss by, for the rows of ``mask``
    ``[B, T]``: its tokens (``token-mean``), its sequences with a token (``seq-mean-*``), or 1
    (``seq-mean-token-sum-norm``, whose divisor is a constant). A subset of rows trained on its
    own and scaled by ``denominator(subset) / denominator(all)`` adds the same gradient as
    it does inside the whole batch (the zero-advantage skip, data-parallel shards)."""
    if mode == "seq-mean-token-sum-norm":
        return torch.tensor(1.0)
    if mode == "token-mean":
        return mask.sum()
    return (mask.sum(-1) > 0).sum()


def split_bounds(rows: int, part: int, parts: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``part`` of ``rows`` cut into ``parts`` contiguous pieces whose sizes
    differ by <= 1 (a data-parallel rank's shard, a micro-batch of a shard)."""
    return rows * part // parts, rows * (part + 1) // parts


def micro_batch_count(rows: int, size: int) -> int:
    """How many micro-batches of at most ``size`` rows ``rows`` rows take (0 = one)."""
    return max(1, math.ceil(rows / size)) if size else 1


def map_row_groups(
    prompts: list[list[int]],
    responses: list[list[int]],
    size: int,
    fn: Callable[[list[list[int]], list[list[int]]], list],
) -> list:
    """``fn`` over groups of at most ``size`` rows (0 = all at once), its per-row results in
    input order. Rows of one prompt go together (the shared-prompt forward runs a prompt once
    per group), then by response length (less padding)."""
    if not size or size >= len(prompts):
        return fn(prompts, responses)
    keys = [(prompt, len(response)) for prompt, response in zip(prompts, responses, strict=True)]
    return map_micro_batches(prompts, responses, size, fn, keys)


class MetricSums:
    """A mini-batch's metrics from those of its parts (micro-batches, data-parallel shards).

    Each part's value is weighted by its share of what the metric averages over, so the sum
    over the parts is the whole mini-batch's: the losses (``agg_loss`` in the loss's mode:
    pg_loss, kl_loss, entropy) by the part's share of ``loss_denominator``, the token means
    (``TOKEN_MEAN_METRICS``: clip fractions, ppo_kl, importance weights) by its share of the
    tokens; ``/max`` metrics take the maximum. An empty part (a weight-0 row run only for the
    collectives) adds nothing."""

    def __init__(self, mode: str, mask: torch.Tensor) -> None:
        self.mode = mode
        self.denominator = float(loss_denominator(mode, mask).clamp_min(1))
        self.tokens = float(mask.sum().clamp_min(1))
        self.metrics: dict[str, float] = {}

    def add(self, metrics: dict[str, float], mask: torch.Tensor) -> float:
        """Adds the metrics of the part whose rows' response mask is ``mask`` (no rows: an
        empty part); returns the part's share of the loss denominator."""
        empty = len(mask) == 0
        loss_share = 0.0 if empty else float(loss_denominator(self.mode, mask)) / self.denominator
        token_share = float(mask.sum()) / self.tokens
        for name, value in metrics.items():
            if name.endswith("/max"):
                peak = -math.inf if empty else value
                self.metrics[name] = max(self.metrics.get(name, -math.inf), peak)
                continue
            weight = token_share if name in TOKEN_MEAN_METRICS else loss_share
            self.metrics[name] = self.metrics.get(name, 0.0) + value * weight
        return loss_share
