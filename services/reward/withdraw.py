"""Taking back queued scoring work whose caller has gone (cancelled, timed out).

Why: a trainer that gives up on a batch must not leave workers scoring it for minutes and
delaying everyone behind it. On the producer side, ``WithdrawingJobs`` marks each unanswered
job of the batch as answered ("withdrawn", ``SET NX`` under its result key, so no worker's late
answer is taken for a real one) and deletes the entries nobody has read yet. On the worker side,
``withdrawn`` tells a worker about to start (or busy with) a job that its caller is gone, and
the worker stops scoring it.

Why a subclass of ``ScatterGather`` rather than a change to it: the toolkit is shared with
refcritic; this is the reward service's need first. (The toolkit is where it should end up.)
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from redis.asyncio import Redis

from rlfleet.common.errors import ErrorCode
from rlfleet.common.jobs import ScatterGather
from rlfleet.common.results import Failure, encode_result
from rlfleet.common.workqueue import Result, WorkQueue

log = logging.getLogger(__name__)

WITHDRAWN = "withdrawn: the caller cancelled or timed out"
WATCH_EVERY_S = 0.25
_SCAN = 500


class WithdrawingJobs(ScatterGather):
    """``ScatterGather`` that withdraws a batch's unanswered jobs when its caller gives up."""

    def __init__(self, redis: Redis, queue: WorkQueue, timeout_s: float, workers: str,
                 concurrency: int = 32) -> None:  # fmt: skip
        super().__init__(queue, timeout_s, workers, concurrency)
        self._redis = redis
        self.withdrawn = 0

    async def run(self, payloads: list[bytes]) -> list[Result]:
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        batch = uuid.uuid4().hex
        ids = [f"{self.queue.group}-{batch}-{i}" for i in range(len(payloads))]
        try:
            await self._submit_all(ids, payloads)
            answers = await self._gather(ids, deadline)
            results = self._all_answered(answers)
        except BaseException:
            await asyncio.shield(self._withdraw(ids))
            raise
        await self.queue.forget(ids)
        return results

    async def _withdraw(self, request_ids: list[str]) -> None:
        try:
            self.withdrawn += await withdraw(self._redis, self.queue, request_ids)
        except Exception as exc:  # noqa: BLE001 - the caller's error matters more than ours
            log.warning("could not withdraw %d job(s): %s", len(request_ids), exc)


async def withdraw(redis: Redis, queue: WorkQueue, request_ids: list[str]) -> int:
    """Mark the unanswered ones withdrawn; delete their unread entries. Returns how many
    were marked (the rest had an answer already)."""
    marker = encode_result(b"", Failure(ErrorCode.DEADLINE_EXCEEDED, WITHDRAWN))
    async with redis.pipeline(transaction=False) as pipe:
        for request_id in request_ids:
            pipe.set(queue.keys.result(request_id), marker, nx=True, ex=queue.result_ttl_s)
        marked = sum(bool(ok) for ok in await pipe.execute())
    await _delete_entries(redis, queue, set(request_ids))
    return marked


async def _delete_entries(redis: Redis, queue: WorkQueue, request_ids: set[str]) -> None:
    """XDEL (and XACK) the stream entries of ``request_ids``; a worker that already read one
    sees the marker instead (``withdrawn``)."""
    wanted = {rid.encode() for rid in request_ids}
    start = "-"
    while raw := await redis.xrange(queue.stream, start, "+", count=_SCAN):
        doomed = [eid for eid, fields in raw if fields.get(b"id") in wanted]
        if doomed:
            async with redis.pipeline(transaction=True) as pipe:
                pipe.xack(queue.stream, queue.group, *doomed).xdel(queue.stream, *doomed)
                await pipe.execute(raise_on_error=False)
        last = raw[-1][0]
        start = "(" + (last.decode() if isinstance(last, bytes) else last)


async def withdrawn(queue: WorkQueue, request_id: str) -> bool:
    """Whether the job already has an answer (its caller withdrew it, or another worker's)."""
    return await queue.get_result(request_id) is not None


async def until_withdrawn(queue: WorkQueue, request_id: str) -> None:
    """Returns once the job has an answer; a worker races its scoring against this."""
    while not await withdrawn(queue, request_id):
        await asyncio.sleep(WATCH_EVERY_S)
