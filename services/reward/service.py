"""The reward service's core: validate, queue every item for the workers, collect in order.

Front doors (gRPC, HTTP) are thin wrappers around ``RewardService``; it never imports grpc.
Each item becomes one entry on the reward stream so any number of workers share a batch.
A batch that is not fully scored within ``reward.request_timeout_s`` fails with TimeoutError
(DEADLINE_EXCEEDED), which clients do not retry automatically: resubmitting to a queue that is
already behind would only add to its backlog.
Queue request ids are generated here, never taken from callers: callers reuse ids like "0"
from batch to batch, and the queue treats an id it has answered before as already done.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from redis.asyncio import Redis

from services.common.config import RewardConfig
from services.common.keys import Keys
from services.common.workqueue import Result, WorkQueue
from services.reward.scorers import ScorerRegistry
from services.reward.types import ScoreRequest, ScoreResult, ScorerInfo, validate_batch

GROUP = "reward"
MAX_DELIVERIES = 3
RESULT_TTL_S = 900
REDIS_CONCURRENCY = 32  # Redis round trips in flight per service (its pool holds 100 connections)

T = TypeVar("T")
R = TypeVar("R")


def reward_queue(redis: Redis, keys: Keys) -> WorkQueue:
    """The one queue the service produces to and every worker consumes from."""
    return WorkQueue(redis, keys, keys.reward_stream, GROUP, MAX_DELIVERIES, RESULT_TTL_S)


class RewardService:
    """Scores requests through the worker pool; results come back in request order."""

    def __init__(
        self, redis: Redis, keys: Keys, config: RewardConfig, registry: ScorerRegistry
    ) -> None:
        self.queue = reward_queue(redis, keys)
        self.keys = keys
        self.registry = registry
        self.timeout_s = config.request_timeout_s
        self._slots = asyncio.Semaphore(REDIS_CONCURRENCY)

    async def start(self) -> None:
        await self.queue.ensure_group()

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """One item; an unknown data source or scorer is NotFound (for a batch: the item's error)."""
        request.validate()
        self.registry.select(request)
        return (await self._run([request]))[0]

    async def score_batch(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Every item scored, in order; one item's failure is that item's ``error``."""
        requests = list(requests)
        validate_batch(requests)
        return await self._run(requests) if requests else []

    def list_scorers(self) -> list[ScorerInfo]:
        return self.registry.list_scorers()

    async def healthy(self) -> bool:
        return bool(await self.queue.redis.ping())

    async def _run(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        batch = uuid.uuid4().hex
        qids = [f"reward-{batch}-{i}" for i in range(len(requests))]
        try:
            await self._bounded(self._submit, list(zip(qids, requests, strict=True)))
            answers = await self._bounded(lambda qid: self._wait(qid, deadline), qids)
        finally:
            await self._forget(qids)
        missing = sum(answer is None for answer in answers)
        if missing:
            raise TimeoutError(
                f"{missing} of {len(requests)} items not scored within {self.timeout_s:g}s "
                "(are reward workers running?)"
            )
        return [_to_result(req, ans) for req, ans in zip(requests, answers, strict=True)]

    async def _submit(self, item: tuple[str, ScoreRequest]) -> None:
        qid, request = item
        await self.queue.submit(qid, request.to_json())

    async def _wait(self, qid: str, deadline: float) -> Result | None:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return await self.queue.get_result(qid)
        return await self.queue.wait_result(qid, remaining)

    async def _forget(self, qids: list[str]) -> None:
        """Drop answers once read: they are ours alone, so nothing else will ask for them."""
        result_keys = [self.keys.result(qid) for qid in qids]
        for start in range(0, len(result_keys), 1000):
            await self.queue.redis.unlink(*result_keys[start : start + 1000])

    async def _bounded(self, fn: Callable[[T], Awaitable[R]], items: list[T]) -> list[R]:
        """``fn`` over ``items`` concurrently, at most REDIS_CONCURRENCY at once service-wide."""

        async def one(item: T) -> R:
            async with self._slots:
                return await fn(item)

        return list(await asyncio.gather(*(one(item) for item in items)))


def _to_result(request: ScoreRequest, answer: Result) -> ScoreResult:
    """The worker's ScoreResult under the caller's id, or the queue's error (e.g. dead-letter)."""
    if not answer.ok:
        return ScoreResult(id=request.id, error=answer.error or "unknown queue error")
    result = ScoreResult.from_json(answer.payload)
    result.id = request.id
    return result
