"""The reward service's core: validate once, then score in-process or through the workers.

Front doors (gRPC, HTTP) are thin wrappers around ``RewardService``; it never imports grpc.

Fair by construction (docs/reward_service.md, "Fairness"):

- Built-in items (``waits_for_nobody``) are scored at once by the process that received them,
  with ``reward.local_first``: never queued, never behind a user function (``math`` has
  thread lanes of its own). A 256-item arith batch is ~1 ms of regex work. Without
  ``local_first`` they go to the stream as one job of their own, never cut.
- The rest (user functions, ``code``) is cut into jobs of ``CHUNK_ITEMS``; a request keeps at
  most ``window`` of them in flight (``WINDOW_MIN``, or one per waiting worker anywhere:
  ``IdleWorkers``), and submits the next when one is answered. So one caller's 1000 items sit
  in the stream as a few jobs, and another caller's 1-item job is read after those few, not
  after all 1000. Inside a process, items of different jobs take sandboxed children and
  threads round-robin (``lanes``).
- Each chunk runs in-process when one of this process's worker slots is idle (local first:
  no Redis round trip), else through the stream, where any worker (``--worker-only``
  processes too) takes it. Durability is the toolkit's story: a local chunk is answered by
  the process that accepted it, or its RPC fails and the caller retries it.

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
from typing import TypeVar, overload

from redis.asyncio import Redis

from rlfleet.common.config import RewardConfig
from rlfleet.common.errors import DeadlineExceeded, NotFound
from rlfleet.common.keys import REWARD_GROUP, Keys
from rlfleet.common.queue.consumer import Consumer
from rlfleet.common.queue.local_first import IdleWorkers, LocalFirst, WorkerSlots
from rlfleet.common.queue.producer import Producer
from rlfleet.common.queue.results import Result
from rlfleet.common.queue.scatter import ScatterGather
from rlfleet.common.queue.stream import QueueStream
from rlfleet.reward.batch_scorer import BatchScorer, ScoringLanes, waits_for_nobody
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
CHUNK_ITEMS = 16  # slow items per job: small enough that nobody waits long behind one
WINDOW_MIN = 2  # jobs one request keeps in flight at least (one scored, one queued next)
REDIS_CONCURRENCY = 32  # Redis round trips in flight per service
Side = TypeVar("Side", bound=QueueStream)
R = TypeVar("R")


@overload
def reward_queue(redis: Redis, keys: Keys) -> Consumer: ...
@overload
def reward_queue(redis: Redis, keys: Keys, side: type[Side]) -> Side: ...
def reward_queue(redis: Redis, keys: Keys, side: type[QueueStream] = Consumer) -> QueueStream:
    """One side (a worker's ``Consumer``, the default; the service's ``Producer``) of the one
    queue the service produces to and every worker consumes from."""
    return side(redis, keys, keys.reward_stream, REWARD_GROUP, MAX_DELIVERIES, RESULT_TTL_S)


class RewardService:
    """Scores requests, in-process or through the worker pool; results in request order.

    ``slots`` are this process's reward workers (None: none here, or local-first off)."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        config: RewardConfig,
        registry: ScorerRegistry,
        slots: WorkerSlots | None = None,
        item_timeout_s: float = 10.0,
        lanes: ScoringLanes | None = None,
    ) -> None:
        self.queue = reward_queue(redis, keys, Producer)
        self.registry, self.default_scorer = registry, config.default_scorer
        self.default_score = config.default_score
        self.timeout_s = timeout_s = config.request_timeout_s
        self.inline = config.local_first
        self.jobs = ScatterGather(
            self.queue, timeout_s, "reward workers", REDIS_CONCURRENCY, withdraw=True
        )
        self.metrics = RewardMetrics()
        self.metrics.gauge(
            "rlfleet_reward_withdrawn_jobs",
            "Queued jobs withdrawn (caller gone)",
            lambda: self.jobs.withdrawn,
        )
        self.idle_workers = IdleWorkers(self.queue)
        self.route = LocalFirst(slots if config.local_first else None, timeout_s)
        self.engine = BatchScorer(registry, item_timeout_s, "score-local", lanes)

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
        started, paths = time.perf_counter(), set[str]()
        try:
            results = await self._in_time(self._score(requests, paths))
        except asyncio.CancelledError:
            self.metrics.cancelled.inc()
            raise
        for result in results:
            if result.error:
                result.score = self.default_score
        path = "queued" if "queued" in paths else "local"
        self.metrics.observe(path, results, time.perf_counter() - started)
        return results

    async def _in_time(self, work: Awaitable[R]) -> R:
        """One deadline for the whole request, however many jobs it became."""
        limit = asyncio.timeout(self.timeout_s)
        try:
            async with limit:
                return await work
        except TimeoutError as exc:
            if not limit.expired():
                raise
            raise DeadlineExceeded(f"not scored within {self.timeout_s:g}s") from exc

    async def _score(self, requests: list[ScoreRequest], paths: set[str]) -> list[ScoreResult]:
        """Built-ins here and now; the rest spread in chunks; results back in request order."""
        quick, slow = self._split(requests)
        parts = [slow[i : i + CHUNK_ITEMS] for i in range(0, len(slow), CHUNK_ITEMS)]
        window = asyncio.Semaphore(await self._window(len(parts)))
        runs = [self._chunk([requests[i] for i in part], window, paths) for part in parts]
        if quick:  # microseconds an item: one part, never cut (nor queued with local_first)
            parts.append(quick)
            items = [requests[i] for i in quick]
            runs.append(self.engine.score_all(items) if self.inline else self._queued(items, paths))
        results: list[ScoreResult | None] = [None] * len(requests)
        for at, part_results in zip(parts, await asyncio.gather(*runs), strict=True):
            for index, result in zip(at, part_results, strict=True):
                results[index] = result
        return [r for r in results if r is not None]

    def _split(self, requests: list[ScoreRequest]) -> tuple[list[int], list[int]]:
        """Positions of built-in items (``waits_for_nobody``) and of the others."""
        quick: list[int] = []
        slow: list[int] = []
        for index, request in enumerate(requests):
            (quick if self._quick(request) else slow).append(index)
        return quick, slow

    def _quick(self, request: ScoreRequest) -> bool:
        try:
            return waits_for_nobody(self.registry.select(request))
        except NotFound:
            return True  # answered with its error at once

    async def _window(self, chunks: int) -> int:
        """Chunks of one request in flight: one per waiting worker anywhere, at least 2."""
        if chunks <= WINDOW_MIN:
            return WINDOW_MIN
        return max(WINDOW_MIN, await self.idle_workers.count())

    async def _chunk(
        self, chunk: list[ScoreRequest], window: asyncio.Semaphore, paths: set[str]
    ) -> list[ScoreResult]:
        async with window:
            return await self.route.run(
                lambda: self._local(chunk, paths), lambda: self._queued(chunk, paths)
            )

    def _local(self, chunk: list[ScoreRequest], paths: set[str]) -> Awaitable[list[ScoreResult]]:
        paths.add("local")
        return self.engine.score_all(chunk)

    async def _queued(self, chunk: list[ScoreRequest], paths: set[str]) -> list[ScoreResult]:
        paths.add("queued")
        (answer,) = await self.jobs.run([encode_requests(chunk)])
        return _chunk_results(chunk, answer)


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
