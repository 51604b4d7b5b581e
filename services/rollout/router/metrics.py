"""The router's Prometheus metrics: requests, latency, rejections, migrations, in-flight.

Why a registry per router (not prometheus-client's global one): tests run several routers in
one process, and each must count only its own traffic. Every front door (gRPC and HTTP) goes
through ``RouterCore``, which times each call here, so both are counted the same way. In-flight
counts live in Redis (shared by every router), so they are read when ``/metrics`` is scraped
(``refresh``) rather than tracked here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rlfleet.common.errors import code_of

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    """Counters and gauges of one router; ``render()`` is the text ``/metrics`` returns."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "rlfleet_router_requests",
            "Generate requests answered, by API and outcome code",
            ["api", "code"],
            registry=reg,
        )
        self.latency = Histogram(
            "rlfleet_router_request_seconds",
            "Time to answer a call",
            ["api"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.rejections = Counter(
            "rlfleet_router_rejections",
            "Requests refused or failed, by reason (status code)",
            ["reason"],
            registry=reg,
        )
        self.migrations = Counter(
            "rlfleet_router_migrations",
            "Queued requests moved off dead or departed replicas by this router's janitor",
            registry=reg,
        )
        self.inflight = Gauge(
            "rlfleet_router_replica_inflight",
            "Requests in flight per replica (fleet-wide, from Redis)",
            ["replica"],
            registry=reg,
        )
        self.weight_version = Gauge(
            "rlfleet_router_replica_weight_version",
            "Weight version each replica serves",
            ["replica"],
            registry=reg,
        )

    @contextmanager
    def track(self, api: str, requests: int = 1) -> Iterator[None]:
        """Time one call of ``api`` holding ``requests`` requests; count its outcome."""
        started = time.perf_counter()
        code = "OK"
        try:
            yield
        except BaseException as exc:
            code = _code_name(exc)
            self.rejections.labels(code).inc(requests)
            raise
        finally:
            self.latency.labels(api).observe(time.perf_counter() - started)
            self.requests.labels(api, code).inc(requests)

    def migrated(self, count: int) -> None:
        if count:
            self.migrations.inc(count)

    def set_replicas(self, replicas: Iterable[tuple[str, int, int]]) -> None:
        """(replica id, in flight, weight version) of every registered replica, replacing the
        previous values, so departed replicas stop being reported."""
        self.inflight.clear()
        self.weight_version.clear()
        for replica_id, in_flight, version in replicas:
            self.inflight.labels(replica_id).set(in_flight)
            self.weight_version.labels(replica_id).set(version)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _code_name(exc: BaseException) -> str:
    if isinstance(exc, BaseException) and not isinstance(exc, Exception):
        return "CANCELLED"
    return code_of(exc).name
