"""Prometheus ``/metrics`` of a real router and a real replica, scraped over HTTP and parsed
with prometheus-client's own parser: what operators graph (requests, latency, rejections,
migrations, in-flight per replica; tokens, queue depth, weight version, update time).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from replica_proc import MODEL, ReplicaProc, start_replica, stop_replica
from router_proc import RouterProc, start_http_router
from safetensors.torch import load_file

from rlfleet.common.errors import InvalidArgument
from rlfleet.common.keys import ROLLOUT_GROUP, Keys
from rlfleet.common.queue.workqueue import WorkQueue
from rlfleet.common.redis_server import EmbeddedRedis, free_port
from rlfleet.model import weights
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]
Samples = dict[tuple[str, frozenset], float]


@dataclass
class Fleet:
    keys: Keys
    redis_url: str
    replica: ReplicaProc
    metrics_url: str
    router: RouterProc
    logs: Path


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("metrics")
    keys, port = Keys(f"t{uuid.uuid4().hex[:12]}"), free_port()
    replica = start_replica(
        redis_server.url,
        keys,
        "mx",
        logs / "mx.log",
        "rollout.backend=hf",
        f"rollout.metrics_port={port}",
    )
    try:
        router = start_http_router(redis_server.url, keys, logs / "router.log")
        try:
            yield Fleet(
                keys, redis_server.url, replica, f"http://127.0.0.1:{port}/metrics", router, logs
            )
        finally:
            router.proc.stop()
    finally:
        stop_replica(replica)


def scrape(url: str) -> Samples:
    """Every sample as ``(name, labels) -> value``."""
    text = httpx.get(url, timeout=10).raise_for_status().text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def poll(read: Callable[[], Samples], ok: Callable[[Samples], bool], timeout_s: float = 30):
    """Scrape until ``ok`` holds (metrics sampled in the background catch up)."""
    deadline = time.monotonic() + timeout_s
    while not ok(samples := read()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ok(samples), samples
    return samples


def request(**fields) -> GenerateRequest:
    sampling = SamplingParams(n=2, max_tokens=4)
    return GenerateRequest(uuid.uuid4().hex, sampling, prompt_text="12+34=", **fields)


async def test_router_counts_requests_latency_rejections_and_inflight(fleet: Fleet) -> None:
    async with RolloutClient(fleet.router.address) as client:
        await asyncio.gather(*(client.generate(request(session_id=f"s{i}")) for i in range(3)))
        await client.generate_batch([request(), request()])
        with pytest.raises(InvalidArgument):
            await client.generate(request(timeout_s=float("nan")), timeout_s=30)
    httpx.post(
        f"{fleet.router.base_url}/completions", json={"prompt": "1+2=", "max_tokens": 2}, timeout=60
    ).raise_for_status()
    samples = scrape(f"{fleet.router.http}/metrics")
    ok = value(samples, "rlfleet_router_requests_total", api="generate", code="OK")
    assert ok >= 4  # three over gRPC, one over HTTP
    assert value(samples, "rlfleet_router_requests_total", api="generate_batch", code="OK") == 2
    assert value(samples, "rlfleet_router_rejections_total", reason="INVALID_ARGUMENT") == 1
    assert value(samples, "rlfleet_router_request_seconds_count", api="generate") == ok + 1
    assert ("rlfleet_router_replica_inflight", frozenset({("replica", "mx")})) in samples
    assert value(samples, "rlfleet_router_replica_weight_version", replica="mx") == 0


async def test_router_counts_migrations_off_a_departed_replica(fleet: Fleet) -> None:
    """Work left in the stream of a replica that is gone is moved (and answered) by mx."""
    client = aioredis.Redis.from_url(fleet.redis_url)
    try:
        ghost = WorkQueue(client, fleet.keys, fleet.keys.rollout_stream("ghost"), ROLLOUT_GROUP)
        await ghost.ensure_group()
        stranded = request()
        await ghost.submit(stranded.request_id, stranded.to_json())
        assert await ghost.wait_result(stranded.request_id, 60) is not None
    finally:
        await client.aclose()
    url = f"{fleet.router.http}/metrics"
    poll(lambda: scrape(url), lambda s: value(s, "rlfleet_router_migrations_total") >= 1)


async def test_replica_reports_tokens_queue_version_and_update_time(fleet: Fleet) -> None:
    async with RolloutClient(fleet.replica.address) as client:
        await asyncio.gather(*(client.generate(request()) for _ in range(3)))
        before = scrape(fleet.metrics_url)
        assert value(before, "rlfleet_rollout_generated_tokens_total", replica="mx") >= 6
        assert value(before, "rlfleet_rollout_state", replica="mx", state="serving") == 1
        assert ("rlfleet_rollout_queue_depth", frozenset({("replica", "mx")})) in before
        # hf keeps no prefix cache: no hit-rate counters (tests/integration/test_vllm_prefix_cache.py)
        assert not [name for name, _ in before if name.startswith("rlfleet_rollout_prefix_cache")]
        poll(
            lambda: scrape(fleet.metrics_url),
            lambda s: value(s, "rlfleet_rollout_tokens_per_second", replica="mx") > 0,
        )
        header, payload = weights.encode(load_file(str(MODEL / "model.safetensors")), 1)
        assert (await client.push_weights(header, payload)).version == 1
    after = scrape(fleet.metrics_url)
    assert value(after, "rlfleet_rollout_weight_version", replica="mx") == 1
    assert value(after, "rlfleet_rollout_weight_updates_total", replica="mx") == 1
    assert value(after, "rlfleet_rollout_last_update_seconds", replica="mx") > 0
    assert value(after, "rlfleet_rollout_requests_total", replica="mx") >= 3


def test_router_with_only_a_metrics_port(fleet: Fleet, redis_server: EmbeddedRedis) -> None:
    """Without the OpenAI front, ``router.metrics_port`` serves /metrics alone."""
    port = free_port()
    bare = start_http_router(
        redis_server.url,
        fleet.keys,
        fleet.logs / "bare.log",
        "router.http_port=null",
        f"router.metrics_port={port}",
    )
    try:
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
        assert value(samples, "rlfleet_router_replica_weight_version", replica="mx") >= 0
        assert ("rlfleet_router_replica_inflight", frozenset({("replica", "mx")})) in samples
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 404
    finally:
        bare.proc.stop()
