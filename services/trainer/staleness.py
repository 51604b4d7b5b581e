"""What the trainer does with tokens older than its weights: drop or mask the too old, measure.

Why a module of its own: the learner (``Trainer.train_step_async``) applies these to every
asynchronous batch, and the producer (``rlfleet.trainer.pipeline``) is what makes batches
stale; both sit above this, so neither has to import the other for it.

Staleness is per token: ``trainer version - the version that sampled the token``. A request
that a weight update crossed (``rollout.update_policy: keep``) holds tokens of several
versions, so a row's tokens may differ in age; a row's own version (``weight_versions``) is
its oldest token's. ``trainer.stale_tokens`` says what a token older than ``max_staleness``
costs its row: ``drop_sample`` (the row goes, ``async/dropped``) or ``mask`` (only that token
leaves the loss, ``async/masked_tokens``; a row with nothing left goes).
``trainer.mask_pre_update_segments`` also masks every token sampled before the row's newest
version (slime's choice: train only on the segment after the last update). Masks travel as
the rows' loss masks, so losses, entropy, KL and the reward's position all skip those tokens;
the off-policy weight of every kept token uses that token's own behaviour log-prob.

A row's lag splits in two (``split_lag``, prime-rl's split): **in flight**, the versions that
landed while it was being generated (its newest sampled token's version - its oldest's), and
**in queue**, the versions the trainer published after it was done and before it was trained
(trainer version - its newest token's version). Each has its own bound
(``trainer.max_in_flight_lag``, ``trainer.max_in_queue_lag``; -1 = none beyond
``max_staleness``), applied by ``bound_lag`` and reported as ``off_policy/*``.
"""

from __future__ import annotations

from typing import Literal

from rlfleet.trainer.rollout_batch import RolloutBatch

StaleTokens = Literal["drop_sample", "mask"]


def drop_stale(
    batch: RolloutBatch,
    oldest: int,
    stale_tokens: StaleTokens = "drop_sample",
    mask_pre_update: bool = False,
) -> tuple[RolloutBatch, int]:
    """Drop (or mask) what is older than version ``oldest``; returns (kept, dropped rows).
    Tokens masked here are added to ``batch.stale_masked_tokens``."""
    if stale_tokens not in ("drop_sample", "mask"):
        raise ValueError(f"unknown trainer.stale_tokens {stale_tokens!r}")
    if stale_tokens == "drop_sample":
        keep = [i for i, version in enumerate(row_oldest(batch)) if version >= oldest]
        batch, dropped = _only(batch, keep)
        return (_masked(batch, _newest) if mask_pre_update else batch), dropped
    batch = _masked(
        batch, lambda versions: max(_newest(versions) if mask_pre_update else 0, oldest)
    )
    return _only(batch, [i for i, mask in enumerate(_loss_masks(batch)) if any(mask)])


def _only(batch: RolloutBatch, keep: list[int]) -> tuple[RolloutBatch, int]:
    if len(keep) == len(batch):
        return batch, 0
    return batch.select(keep), len(batch) - len(keep)


def _newest(versions: list[int]) -> int:
    return max(versions, default=0)


def _loss_masks(batch: RolloutBatch) -> list[list[int]]:
    return batch.row_loss_masks() or [[1] * len(r) for r in batch.responses]


def row_oldest(batch: RolloutBatch) -> list[int]:
    """Each row's oldest sampled token's version (its ``weight_versions`` entry when the
    batch carries no per-token versions)."""
    rows = batch_token_versions(batch)
    return [
        min((v for v in row if v >= 0), default=version)
        for row, version in zip(rows, batch.weight_versions, strict=True)
    ]


def batch_token_versions(batch: RolloutBatch) -> list[list[int]]:
    """Per row, the version of every response token (-1 where nothing was sampled); rows
    without per-token versions take the row's version for every token."""
    if len(batch.token_versions) == len(batch):
        return batch.token_versions
    return [[v] * len(r) for v, r in zip(batch.weight_versions, batch.responses, strict=True)]


def _masked(batch: RolloutBatch, floor) -> RolloutBatch:
    """Loss masks with 0 on every sampled token whose version is below ``floor(row's sampled
    versions)``; counted in ``stale_masked_tokens``."""
    masks = _loss_masks(batch)
    new_masks, masked = [], 0
    for row, mask in zip(batch_token_versions(batch), masks, strict=True):
        low = floor([v for v, m in zip(row, mask, strict=True) if m and v >= 0])
        new = [int(m and not (0 <= v < low)) for v, m in zip(row, mask, strict=True)]
        masked += sum(mask) - sum(new)
        new_masks.append(new)
    if not masked:
        return batch
    batch.loss_masks = new_masks
    batch.stale_masked_tokens += masked
    return batch


def staleness_metrics(batch: RolloutBatch, version: int, dropped: int) -> dict[str, float]:
    """Rows' lag behind ``version`` (a row's is its oldest token's), and per sampled token
    (every row carries per-token versions: single-turn completions and agent episodes)."""
    lags = [version - v for v in batch.weight_versions] or [0]
    tokens = [version - v for row in batch.token_versions for v in row if v >= 0] or lags
    return {
        "async/staleness/mean": sum(lags) / len(lags),
        "async/staleness/max": float(max(lags)),
        "async/staleness/token_mean": sum(tokens) / len(tokens),
        "async/staleness/token_max": float(max(tokens)),
        "async/dropped": float(dropped),
        "async/masked_tokens": float(batch.stale_masked_tokens),
    }


def split_lag(batch: RolloutBatch, version: int) -> tuple[list[int], list[int]]:
    """Per row: ``(in_flight, in_queue)`` lags behind trainer ``version`` (module docstring);
    their sum is the row's whole lag (``version`` - its oldest token's version)."""
    in_flight, in_queue = [], []
    for row, row_version in zip(batch_token_versions(batch), batch.weight_versions, strict=True):
        sampled = [v for v in row if v >= 0] or [row_version]
        in_flight.append(max(sampled) - min(sampled))
        in_queue.append(version - max(sampled))
    return in_flight, in_queue


def bound_lag(
    batch: RolloutBatch,
    version: int,
    max_in_flight: int,
    max_in_queue: int,
    stale_tokens: StaleTokens = "drop_sample",
) -> tuple[RolloutBatch, int]:
    """Apply the two bounds (-1 = none): a row whose in-queue lag is over its bound goes
    (every token of it is at least that old); a row whose in-flight lag is over its bound goes
    (``drop_sample``) or keeps only the tokens sampled within ``max_in_flight`` versions of
    its newest (``mask``). Returns (kept, rows dropped)."""
    in_flight, in_queue = split_lag(batch, version)
    keep = [i for i, lag in enumerate(in_queue) if max_in_queue < 0 or lag <= max_in_queue]
    if max_in_flight >= 0 and stale_tokens == "drop_sample":
        keep = [i for i in keep if in_flight[i] <= max_in_flight]
    batch, dropped = _only(batch, keep)
    if max_in_flight < 0 or stale_tokens == "drop_sample":
        return batch, dropped
    batch = _masked(batch, lambda versions: _newest(versions) - max_in_flight)
    batch, emptied = _only(batch, [i for i, mask in enumerate(_loss_masks(batch)) if any(mask)])
    return batch, dropped + emptied


def split_lag_metrics(batch: RolloutBatch, version: int, dropped: int) -> dict[str, float]:
    """``off_policy/in_flight/{mean,max}``, ``off_policy/in_queue/{mean,max}`` over the rows
    that arrived, and ``off_policy/dropped`` (rows dropped by any staleness bound)."""
    in_flight, in_queue = split_lag(batch, version)
    metrics = {"off_policy/dropped": float(dropped)}
    for name, lags in (("in_flight", in_flight or [0]), ("in_queue", in_queue or [0])):
        metrics[f"off_policy/{name}/mean"] = sum(lags) / len(lags)
        metrics[f"off_policy/{name}/max"] = float(max(lags))
    return metrics
