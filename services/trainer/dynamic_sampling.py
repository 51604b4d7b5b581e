"""DAPO's dynamic sampling: keep generating until the batch holds enough groups that teach.

A prompt group whose samples all scored the same has zero group-relative advantage: it costs a
forward and backward pass and moves nothing. DAPO (Yu et al. 2025, arXiv:2503.14476) drops such
groups and samples more prompts until ``data.train_batch_size`` groups with a spread are
collected, for at most ``algorithm.filter_groups.max_num_gen_batches`` rounds (0 = no limit);
after the last round it trains on what it has. Every round is one ``GenerateBatch`` and one
``ScoreBatch``, like a normal step. Sync and async modes both use it (the async producer draws
refills from its own data stream); the counts are ``dapo/*`` (verl's) and ``batch/*``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from rlfleet.rl.shaping import groups_with_signal
from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.rollout_batch import RolloutBatch

Round = Callable[[list[PromptRecord], int], Awaitable[RolloutBatch]]
"""Generate and score one round's prompts; the int is the round number (for request ids)."""


def with_signal(batch: RolloutBatch) -> tuple[RolloutBatch, int]:
    """The rows of groups whose scores differ; returns (kept batch, dropped group count)."""
    keep = groups_with_signal(torch.tensor(batch.scores), batch.group_ids).tolist()
    rows = [i for i, kept in enumerate(keep) if kept]
    dropped = len(set(batch.group_ids)) - len({batch.group_ids[i] for i in rows})
    return batch.select(rows), dropped


def first_groups(batch: RolloutBatch, count: int) -> RolloutBatch:
    """The rows of the first ``count`` groups (in order of appearance)."""
    wanted = list(dict.fromkeys(batch.group_ids))[:count]
    chosen = set(wanted)
    return batch.select([i for i, g in enumerate(batch.group_ids) if g in chosen])


async def fill_batch(
    first: RolloutBatch,
    target_groups: int,
    max_rounds: int,
    refill: Callable[[], list[PromptRecord]],
    one_round: Round,
) -> tuple[RolloutBatch, dict[str, float]]:
    """Top ``first`` up with groups that have a spread; returns the batch and dapo metrics."""
    kept, dropped = with_signal(first)
    rounds = 1
    while _groups(kept) < target_groups and (not max_rounds or rounds < max_rounds):
        more, more_dropped = with_signal(await one_round(refill(), rounds))
        kept = kept.extend(more, group_offset=rounds * 1_000_000)
        dropped += more_dropped
        rounds += 1
    metrics = {"dapo/gen_rounds": float(rounds), "dapo/dropped_groups": float(dropped)}
    metrics["dapo/kept_groups"] = float(min(_groups(kept), target_groups))
    # The same counts under the names both modes report them by (in async mode the producer
    # refills from its own data stream, for the step's weight version: a dropped group's
    # staleness slot goes to its replacement, never to a later step).
    metrics["batch/dropped_groups"] = float(dropped)
    metrics["batch/refill_rounds"] = float(rounds - 1)
    return first_groups(kept, target_groups), metrics


def _groups(batch: RolloutBatch) -> int:
    return len(set(batch.group_ids))
