"""Prometheus metrics of one reward service process, served on its HTTP app's ``/metrics``.

Why a registry per service rather than prometheus-client's global one: tests (and a process
that builds two services) must not collide on metric names. The core only counts; the HTTP app
renders. Names follow Prometheus conventions (``_total`` counters, ``_seconds`` histograms).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rlfleet.reward.types import ScoreResult

LATENCY_BUCKETS = (0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RewardMetrics:
    """Counters of requests, items, errors and latency, by path (``local`` or ``queued``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "rlfleet_reward_requests", "Score/ScoreBatch calls", ["path"], registry=r
        )
        self.items = Counter("rlfleet_reward_items", "Items scored", ["path"], registry=r)
        self.errors = Counter(
            "rlfleet_reward_item_errors", "Items answered with an error", registry=r
        )
        self.cancelled = Counter(
            "rlfleet_reward_cancelled", "Calls whose caller gave up", registry=r
        )
        self.latency = Histogram(
            "rlfleet_reward_request_seconds",
            "Time to answer a call",
            ["path"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.score_mean = Gauge(
            "rlfleet_reward_last_batch_mean_score",
            "Mean score of the last answered call",
            registry=r,
        )

    def observe(self, path: str, results: Sequence[ScoreResult], seconds: float) -> None:
        self.requests.labels(path).inc()
        self.items.labels(path).inc(len(results))
        self.errors.inc(sum(1 for r in results if r.error))
        self.latency.labels(path).observe(seconds)
        if results:
            self.score_mean.set(sum(r.score for r in results) / len(results))

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A value read at scrape time (say, sandboxed processes replaced so far)."""
        Gauge(name, doc, registry=self.registry).set_function(read)

    def render(self) -> bytes:
        return generate_latest(self.registry)
