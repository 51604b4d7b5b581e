"""Counting gRPC calls per step: the bookkeeping (the channel interceptor is tested against a
real server in tests/integration/test_call_counting.py)."""

from __future__ import annotations

from rlfleet.common import call_counts


def test_per_step_metrics_are_the_difference_of_two_snapshots():
    before = {"GenerateBatch": 3, "ScoreBatch": 2}
    after = {"GenerateBatch": 4, "ScoreBatch": 2, "UpdateWeights": 2}
    metrics = call_counts.per_step_metrics(before, after)
    assert metrics == {
        "perf/grpc_calls/GenerateBatch": 1.0,
        "perf/grpc_calls/UpdateWeights": 2.0,
        "perf/grpc_calls": 3.0,
    }


def test_record_keeps_the_method_name():
    start = call_counts.snapshot().get("Check", 0)
    call_counts.record("/grpc.health.v1.Health/Check")
    assert call_counts.snapshot()["Check"] == start + 1
