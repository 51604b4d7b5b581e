"""A replica's Prometheus ``/metrics``: tokens and tokens/s, queue depth, in-flight, state,
weight version, how long weight updates take, and prefix-cache hits (engines that have one).

Why a collector that reads the replica at scrape time (rather than gauges set on every
change): the replica core stays free of metric calls except one token counter, and a scrape
always shows the current state. Two things cannot be read at scrape time: the queue depth is
in Redis (the scrape runs in prometheus-client's server thread, away from the event loop), so
``poll`` samples it every second, together with the token rate; and update timings, which
``MeteredReplica`` records around ``Replica.update_weights`` without touching it.
Served by ``prometheus_client``'s WSGI app on ``rollout.metrics_port`` (0 = off), behind the
API key when the fleet has one (``Authorization: Bearer``, as Prometheus scrapers send it),
over HTTPS when the process's ``tls`` has a certificate (a client certificate required with
``tls.client_auth``, as on every other door).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rlfleet.common.http_server import bearer_wsgi, start_wsgi_server
from rlfleet.model import weights
from rlfleet.rollout.replica import Replica
from rlfleet.rollout.types import ReplicaState, UpdateOutcome

RATE_WINDOW_S = 10.0
POLL_S = 1.0


class MeteredReplica(Replica):
    """A Replica that also records each weight update's duration and outcome."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - Replica's own
        super().__init__(*args, **kwargs)
        self.updates_ok = self.updates_failed = 0
        self.last_load_s = self.last_update_s = self.last_pause_s = 0.0
        self.total_update_s = 0.0

    async def update_weights(
        self, header: weights.WeightHeader, payload: weights.BytesLike
    ) -> UpdateOutcome:
        started = time.perf_counter()
        try:
            outcome = await super().update_weights(header, payload)
        except BaseException:
            self.updates_failed += 1
            raise
        self.last_update_s = time.perf_counter() - started
        self.last_load_s, self.updates_ok = outcome.load_seconds, self.updates_ok + 1
        self.last_pause_s = outcome.pause_seconds
        self.total_update_s += self.last_update_s
        return outcome


class ReplicaCollector(Collector):
    """The metric families of one replica, read when scraped."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.queue_depth = 0
        self.tokens_per_s = 0.0
        self._samples: deque[tuple[float, int]] = deque()

    def collect(self) -> Iterator[Metric]:
        r, status = self.replica, self.replica.status()
        rid = [r.replica_id]
        yield _gauge(
            "rlfleet_rollout_weight_version", "Weight version served", rid, status.weight_version
        )
        yield _gauge(
            "rlfleet_rollout_queue_depth",
            "Requests in this replica's stream (waiting or running)",
            rid,
            self.queue_depth,
        )
        yield _gauge(
            "rlfleet_rollout_inflight", "Requests the engine works on", rid, status.in_flight
        )
        yield _gauge(
            "rlfleet_rollout_tokens_per_second",
            f"Generated tokens per second over the last {RATE_WINDOW_S:g} s",
            rid,
            self.tokens_per_s,
        )
        yield _counter(
            "rlfleet_rollout_generated_tokens",
            "Completion tokens generated",
            rid,
            r.generated_tokens,
        )
        yield _counter("rlfleet_rollout_requests", "Requests answered", rid, status.served)
        state = GaugeMetricFamily(
            "rlfleet_rollout_state", "1 for the current state", labels=["replica", "state"]
        )
        for s in ReplicaState:
            state.add_metric([*rid, s.value], float(status.state is s))
        yield state
        yield from _update_metrics(r, rid)
        yield from _in_flight_update_metrics(r, rid)
        yield from _prefix_cache_metrics(r, rid)

    def sample(self, depth: int) -> None:
        """Record the queue depth and the token count now; update the token rate."""
        now, tokens = time.monotonic(), self.replica.generated_tokens
        self.queue_depth = depth
        self._samples.append((now, tokens))
        while self._samples and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        first_t, first_n = self._samples[0]
        self.tokens_per_s = (tokens - first_n) / (now - first_t) if now > first_t else 0.0


def _update_metrics(r: Replica, rid: list[str]) -> Iterator[Metric]:
    if not isinstance(r, MeteredReplica):
        return
    yield _counter("rlfleet_rollout_weight_updates", "Weight updates applied", rid, r.updates_ok)
    yield _counter(
        "rlfleet_rollout_weight_update_failures",
        "Weight updates refused or failed",
        rid,
        r.updates_failed,
    )
    yield _gauge(
        "rlfleet_rollout_last_update_seconds",
        "Last weight update, receipt to serving (verify, drain, load, flush)",
        rid,
        r.last_update_s,
    )
    yield _gauge(
        "rlfleet_rollout_last_load_seconds",
        "Last weight update's swap and flush",
        rid,
        r.last_load_s,
    )
    yield _gauge(
        "rlfleet_rollout_last_pause_seconds",
        "Last weight update's closed admission (make way, swap, flush)",
        rid,
        r.last_pause_s,
    )
    yield _counter(
        "rlfleet_rollout_update_seconds", "Time spent in weight updates", rid, r.total_update_s
    )


def _in_flight_update_metrics(r: Replica, rid: list[str]) -> Iterator[Metric]:
    """What weight updates did to requests in flight (``rollout.update_policy``)."""
    stats = r.inflight.gate.stats
    yield _counter(
        "rlfleet_rollout_update_discarded_tokens",
        "Decoded tokens thrown away by "
        "weight updates (requests restarted from scratch; 0 under keep)",
        rid,
        stats.tokens_discarded,
    )
    yield _counter(
        "rlfleet_rollout_update_restarted_requests",
        "Requests a weight update restarted from scratch",
        rid,
        stats.requests_restarted,
    )
    yield _counter(
        "rlfleet_rollout_update_resumed_requests",
        "Samples continued under new weights after an update (keep)",
        rid,
        stats.requests_resumed,
    )
    yield _counter(
        "rlfleet_rollout_update_kept_tokens",
        "Decoded tokens carried across weight updates instead of being sampled again",
        rid,
        stats.tokens_kept,
    )


def _prefix_cache_metrics(r: Replica, rid: list[str]) -> Iterator[Metric]:
    """Prompt tokens looked up and hit in the engine's prefix cache; absent (not 0) for an
    engine without one, so a dashboard's hit rate shows no data instead of 0 %."""
    counts = r.engine.prefix_cache_tokens()
    if counts is None:
        return
    queried, hit = counts
    yield _counter(
        "rlfleet_rollout_prefix_cache_queried_tokens",
        "Prompt tokens of finished requests, looked up in the engine's prefix cache",
        rid,
        queried,
    )
    yield _counter(
        "rlfleet_rollout_prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache (KV not recomputed)",
        rid,
        hit,
    )


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["replica"])
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["replica"])
    family.add_metric(labels, value)
    return family


async def poll(collector: ReplicaCollector, interval_s: float = POLL_S) -> None:
    """Sample queue depth and token rate until cancelled (Redis hiccups are skipped)."""
    while True:
        try:
            collector.sample(await collector.replica.queue.length())
        except Exception:  # noqa: BLE001, S110 - a missed sample is taken next time
            pass
        await asyncio.sleep(interval_s)


def serve_metrics(
    replica: Replica, host: str, port: int, api_key: str | None = None
) -> tuple[WSGIServer, asyncio.Task]:
    """Start ``/metrics`` on ``host:port`` (behind ``api_key`` when one is set) and the
    sampler; returns (server, sampler task): call ``server.shutdown()`` and cancel the task."""
    registry = CollectorRegistry()
    collector = ReplicaCollector(replica)
    registry.register(collector)
    app = bearer_wsgi(make_wsgi_app(registry), api_key)
    server = start_wsgi_server(app, host, port, "replica-metrics")
    return server, asyncio.create_task(poll(collector), name="replica-metrics")
