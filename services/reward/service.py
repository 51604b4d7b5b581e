"""The reward service's core: validate once, then score in-process or through the workers.

Front doors (gRPC, HTTP) are thin wrappers around ``RewardService``; it never imports grpc.

Local first (``reward.local_first``, ``rlfleet.common.jobs.LocalFirst``): when this process
runs reward workers and one is idle, a request is scored right here by ``BatchScorer`` (the
workers' own scoring code), with no Redis round trip and no JSON. A 256-item arith batch is
~1 ms of regex work; through the queue it was ~100 Redis commands. Otherwise the batch goes
to the stream as one job, cut into a few only when ``IdleWorkers`` sees several workers waiting
(and never into parts under ``MIN_JOB_ITEMS``), so slow user functions still spread out.
Durability is the toolkit's story: a local request is answered by the process that accepted
it, or its RPC fails and the caller retries it.

An item that could not be scored has ``error`` set and ``reward.default_score`` as its score.
A caller that cancels or times out stops its work (``_run``): its queued jobs are withdrawn
(``ScatterGather(withdraw=True)``) and a worker busy with one stops (``RewardWorker``).
Counters for ``/metrics`` are ``RewardMetrics``.

A batch not fully scored within ``reward.request_timeout_s`` fails with DeadlineExceeded
(a TimeoutError), which clients do not retry automatically: resubmitting to a queue that is
already behind would only add to its backlog.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from redis.asyncio import Redis

from rlfleet.common.config import RewardConfig
from rlfleet.common.jobs import (
    IdleWorkers,
    LocalFirst,
    ScatterGather,
    WorkerSlots,
    parts_for,
    split_evenly,
)
from rlfleet.common.keys import REWARD_GROUP, Keys
from rlfleet.common.queue.consumer import Consumer
from rlfleet.common.queue.producer import Producer
from rlfleet.common.queue.stream import QueueStream
from rlfleet.common.results import Result
from rlfleet.reward.batch_scorer import BatchScorer
from rlfleet.reward.metrics import RewardMetrics
from rlfleet.reward.scorers import ScorerRegistry
from rlfleet.reward.types import (
    ScoreRequest,
    ScoreResult,
    ScorerInfo,
    decode_results,
    encode_requests,
    fill_ids,
    validate_batch,
)

MAX_DELIVERIES = 3
RESULT_TTL_S = 900
MIN_JOB_ITEMS = 32  # a batch is cut to spread over idle workers, never into smaller jobs
REDIS_CONCURRENCY = 32  # Redis round trips in flight per service
Side = TypeVar("Side", bound=QueueStream)


def reward_queue(redis: Redis, keys: Keys, side: type[Side] = Consumer) -> Side:
    """One side (a worker's ``Consumer``, the service's ``Producer``) of the one queue the
    service produces to and every worker consumes from."""
    return side(redis, keys, keys.reward_stream, REWARD_GROUP, MAX_DELIVERIES, RESULT_TTL_S)


class RewardService:
    """Scores requests, in-process or through the worker pool; results in request order.

    ``slots`` are this process's reward workers (None: none here, or local-first off)."""

    def __init__(
        self, redis: Redis, keys: Keys, config: RewardConfig, registry: ScorerRegistry,
        slots: WorkerSlots | None = None, item_timeout_s: float = 10.0,
    ) -> None:  # fmt: skip
        self.queue = reward_queue(redis, keys, Producer)
        self.registry, self.default_scorer = registry, config.default_scorer
        self.default_score = config.default_score
        timeout_s = config.request_timeout_s
        self.jobs = ScatterGather(self.queue, timeout_s, "reward workers", REDIS_CONCURRENCY,
                                  withdraw=True)  # fmt: skip
        self.metrics = RewardMetrics()
        self.metrics.gauge("rlfleet_reward_withdrawn_jobs", "Queued jobs withdrawn (caller gone)",
                           lambda: self.jobs.withdrawn)  # fmt: skip
        self.idle_workers = IdleWorkers(self.queue)
        self.route = LocalFirst(slots if config.local_first else None, timeout_s)
        self.engine = BatchScorer(registry, item_timeout_s, name="score-local")

    async def start(self) -> None:
        await self.jobs.start()

    def close(self) -> None:
        self.engine.close()

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """One item; an unknown data source or scorer is NotFound (in a batch: an item error)."""
        fill_ids([request])
        request.validate()
        self.registry.select(request)
        return (await self._run([request]))[0]

    async def score_batch(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Every item scored, in order; one item's failure is that item's ``error``."""
        requests = list(requests)
        fill_ids(requests)
        validate_batch(requests)
        return await self._run(requests) if requests else []

    def list_scorers(self) -> list[ScorerInfo]:
        return self.registry.list_scorers()

    async def healthy(self) -> bool:
        return await self.queue.ping()

    async def _run(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        """Scored here or through the queue; an item that failed gets ``default_score``. A
        cancelled call (its caller gone) stops its work: local items not started never start,
        sandboxed ones running are killed, queued jobs are withdrawn."""
        started, path = time.perf_counter(), ["queued"]

        def local() -> Awaitable[list[ScoreResult]]:
            path[0] = "local"
            return self.engine.score_all(requests)

        try:
            results = await self.route.run(local, lambda: self._queued(requests))
        except asyncio.CancelledError:
            self.metrics.cancelled.inc()
            raise
        for result in results:
            if result.error:
                result.score = self.default_score
        self.metrics.observe(path[0], results, time.perf_counter() - started)
        return results

    async def _queued(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        parts = parts_for(len(requests), await self.idle_workers.count(), MIN_JOB_ITEMS)
        chunks = [list(chunk) for chunk in split_evenly(requests, parts)]
        answers = await self.jobs.run([encode_requests(chunk) for chunk in chunks])
        return [r for c, a in zip(chunks, answers, strict=True) for r in _chunk_results(c, a)]


def _chunk_results(chunk: list[ScoreRequest], answer: Result) -> list[ScoreResult]:
    """The worker's results under the callers' ids, or the queue's error (e.g. dead-letter)
    for every item of the chunk."""
    if not answer.ok:
        return [ScoreResult(id=request.id, error=answer.message) for request in chunk]
    results = decode_results(answer.payload)
    if len(results) != len(chunk):
        raise RuntimeError(f"worker answered {len(results)} results for {len(chunk)} items")
    for request, result in zip(chunk, results, strict=True):
        result.id = request.id
    return results
