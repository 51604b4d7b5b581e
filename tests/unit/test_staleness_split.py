"""A row's lag split into in-flight and in-queue versions, each bounded (issue 30, item 3)."""

from __future__ import annotations

import pytest

from rlfleet.trainer.rollout_batch import RolloutBatch
from rlfleet.trainer.staleness import bound_lag, split_lag, split_lag_metrics


def batch_of(token_versions: list[list[int]]) -> RolloutBatch:
    """One row per entry, each token sampled by the version given (-1: not sampled)."""
    rows = len(token_versions)
    return RolloutBatch(
        prompts=[[1, 2]] * rows,
        responses=[[5] * len(v) for v in token_versions],
        group_ids=list(range(rows)),
        weight_versions=[min((x for x in v if x >= 0), default=0) for v in token_versions],
        scores=[float(i) for i in range(rows)],
        token_versions=[list(v) for v in token_versions],
    )


# trainer at version 10: row 0 fresh, row 1 crossed by two updates (7 -> 9) and then waited
# one version, row 2 sampled whole by version 6 and waited four; row 3 has an env token (-1)
ROWS = [[10, 10], [7, 7, 9], [6, 6], [8, -1, 9]]


def test_the_lag_splits_into_in_flight_and_in_queue():
    in_flight, in_queue = split_lag(batch_of(ROWS), version=10)
    assert in_flight == [0, 2, 0, 1]
    assert in_queue == [0, 1, 4, 1]


def test_metrics_are_over_the_rows_that_arrived():
    metrics = split_lag_metrics(batch_of(ROWS), 10, dropped=3)
    assert metrics == {
        "off_policy/dropped": 3.0,
        "off_policy/in_flight/mean": pytest.approx(3 / 4),
        "off_policy/in_flight/max": 2.0,
        "off_policy/in_queue/mean": pytest.approx(6 / 4),
        "off_policy/in_queue/max": 4.0,
    }


def test_no_bounds_keep_everything():
    batch = batch_of(ROWS)
    kept, dropped = bound_lag(batch, 10, -1, -1)
    assert kept is batch and dropped == 0


def test_an_in_queue_bound_drops_rows_that_waited_too_long():
    kept, dropped = bound_lag(batch_of(ROWS), 10, -1, max_in_queue=1)
    assert dropped == 1 and kept.group_ids == [0, 1, 3]


def test_an_in_flight_bound_drops_rows_crossed_by_too_many_updates():
    kept, dropped = bound_lag(batch_of(ROWS), 10, max_in_flight=1, max_in_queue=-1)
    assert dropped == 1 and kept.group_ids == [0, 2, 3]


def test_in_mask_mode_an_in_flight_bound_masks_the_older_tokens_only():
    kept, dropped = bound_lag(batch_of(ROWS), 10, 1, -1, stale_tokens="mask")
    assert dropped == 0 and len(kept) == 4
    # row 1: tokens of version 7 are more than one version older than its newest (9)
    assert kept.loss_masks[1] == [0, 0, 1]
    assert kept.loss_masks[0] == [1, 1] and kept.loss_masks[3] == [1, 1, 1]
    assert kept.stale_masked_tokens == 2


def test_both_bounds_together():
    kept, dropped = bound_lag(batch_of(ROWS), 10, max_in_flight=0, max_in_queue=2)
    assert dropped == 3 and kept.group_ids == [0]  # row 2 waited 4, rows 1 and 3 crossed
