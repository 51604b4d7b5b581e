"""The job toolkit (worker, worker pool, scatter/gather producer) against a real Redis server.

Waits poll a condition or an event under generous deadlines: the test machine is small and
shared, so nothing here depends on how fast a step happens, only on what eventually happens.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from rlfleet.common import errors
from rlfleet.common.errors import DeadlineExceeded, ErrorCode, NotFound
from rlfleet.common.keys import Keys
from rlfleet.common.queue.local_first import (
    IdleWorkers,
    LocalFirst,
    WorkerSlots,
    parts_for,
    split_evenly,
)
from rlfleet.common.queue.results import Failure
from rlfleet.common.queue.scatter import ScatterGather
from rlfleet.common.queue.workers import JobWorker, JobWorkerPool, consumer_name
from rlfleet.common.queue.workqueue import Job, WorkQueue


class EchoWorker(JobWorker):
    """Upper-cases payloads; ``b"missing"`` is NotFound, ``b"boom"`` an unexpected error,
    ``b"slow"`` waits for ``release``."""

    def __init__(
        self, queue: WorkQueue, consumer: str, reclaim_idle_s: float = 10.0, slots=None
    ) -> None:
        super().__init__(
            queue, consumer, reclaim_idle_s, read_count=2, read_block_ms=50, slots=slots
        )
        self.release = asyncio.Event()
        self.handled: list[str] = []
        self.reclaim_checks = 0  # times this worker looked for stalled jobs

    async def _reclaim_due(self) -> list[Job]:
        due = asyncio.get_running_loop().time() >= self._next_reclaim
        jobs = await super()._reclaim_due()
        self.reclaim_checks += due
        return jobs

    async def handle(self, job: Job) -> bytes:
        self.handled.append(job.request_id)
        if job.payload == b"missing":
            raise NotFound("no such thing")
        if job.payload == b"boom":
            raise KeyError("oops")
        if job.payload == b"slow":
            await self.release.wait()
        return job.payload.upper()


@pytest.fixture
async def queue(redis_client: aioredis.Redis, keys: Keys) -> WorkQueue:
    queue = WorkQueue(redis_client, keys, keys.reward_stream, "workers")
    await queue.ensure_group()
    return queue


@pytest.fixture
async def group() -> AsyncIterator[JobWorkerPool]:
    crashed = asyncio.Event()
    group = JobWorkerPool(crashed.set, stop_after_s=1.0)
    yield group
    await group.stop()


async def until(probe: Callable[[], object], timeout_s: float = 20.0) -> object:
    """``probe()``'s first truthy value (awaited if need be), polled until a generous deadline."""
    deadline = time.monotonic() + timeout_s
    while not (value := await _value(probe())):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
    return value


async def _value(value: object) -> object:
    return await value if inspect.isawaitable(value) else value


def test_failures_travel_as_codes_and_come_back_as_the_same_exception() -> None:
    assert Failure.of(errors.InvalidArgument("bad")) == Failure(ErrorCode.INVALID_ARGUMENT, "bad")
    assert Failure.of(NotFound("gone")) == Failure(ErrorCode.NOT_FOUND, "gone")
    assert Failure.of(TimeoutError("late")).code is ErrorCode.DEADLINE_EXCEEDED
    assert Failure.of(KeyError("x")) == Failure(ErrorCode.INTERNAL, "KeyError: 'x'")
    for code in ErrorCode:
        if code is not ErrorCode.OK:
            exc = errors.error_for(code, "why")
            assert errors.code_of(exc) is code and str(exc) == "why"
    assert isinstance(errors.error_for(ErrorCode.DEADLINE_EXCEEDED, "m"), TimeoutError)


async def test_answers_come_back_in_order_with_their_codes(queue, group, redis_client, keys):
    for index in range(2):
        group.add(EchoWorker(queue, consumer_name("echo", index)))
    producer = ScatterGather(queue, timeout_s=30, workers="echo workers")
    await producer.start()
    answers = await producer.run([b"a", b"missing", b"boom", b"b"])
    assert [a.payload for a in answers] == [b"A", b"", b"", b"B"]
    assert [a.code for a in answers] == [
        ErrorCode.OK,
        ErrorCode.NOT_FOUND,
        ErrorCode.INTERNAL,
        ErrorCode.OK,
    ]
    with pytest.raises(NotFound, match="no such thing"):
        answers[1].unwrap()
    assert "KeyError" in answers[2].message
    assert await redis_client.keys(keys.result("*")) == []  # read answers are dropped
    assert await queue.length() == 0


async def test_producer_gives_up_at_its_deadline(queue, redis_client, keys):
    producer = ScatterGather(queue, timeout_s=0.3, workers="echo workers")
    with pytest.raises(DeadlineExceeded, match="2 of 2 jobs .* echo workers"):
        await producer.run([b"a", b"b"])
    assert await queue.length() == 2  # still queued: a worker that starts later answers them
    assert await producer.run([]) == []


async def test_a_withdrawing_producer_takes_back_what_its_caller_gave_up(queue, redis_client):
    """Timed out (or cancelled): every unanswered job is answered "withdrawn" and its entry
    deleted, so no worker starts it, and one already busy with it sees it is answered."""
    await queue.submit("other", b"x")  # someone else's job stays queued
    producer = ScatterGather(queue, timeout_s=0.3, workers="echo workers", withdraw=True)
    with pytest.raises(DeadlineExceeded):
        await producer.run([b"a", b"b"])
    assert producer.withdrawn == 2
    assert [j.request_id for j in await queue.read("w", count=10, block_ms=0)] == ["other"]
    ids = [k.decode().rsplit(":", 1)[1] for k in await redis_client.keys(queue.keys.result("*"))]
    assert len(ids) == 2
    for answer in (await queue.get_results(ids)).values():
        assert answer.code is ErrorCode.DEADLINE_EXCEEDED and "withdrawn" in answer.message
    held = Job("0-1", ids[0], b"a", 1)
    assert await queue.answered(held)
    await asyncio.wait_for(queue.until_answered(held), 5)
    assert await queue.withdraw(ids) == 0  # answered already: nothing more to mark


async def test_a_batch_waiting_on_slow_jobs_does_not_hold_up_the_next(queue, group):
    """Waiting holds no concurrency slot: with 2 slots, a batch whose 2 jobs hang must not
    keep a later 1-job batch from being submitted and answered (head-of-line blocking)."""
    workers = [EchoWorker(queue, consumer_name("echo", index)) for index in range(3)]
    for worker in workers:
        group.add(worker)
    producer = ScatterGather(queue, timeout_s=60, workers="echo workers", concurrency=2)
    slow = asyncio.create_task(producer.run([b"slow", b"slow"]))
    try:
        await until(lambda: sum(len(w.handled) for w in workers) == 2)
        fast = await asyncio.wait_for(producer.run([b"fast"]), timeout=15)
        assert [a.payload for a in fast] == [b"FAST"] and not slow.done()
    finally:
        for worker in workers:
            worker.release.set()
    assert [a.payload for a in await slow] == [b"SLOW", b"SLOW"]


async def test_a_dead_consumers_job_is_taken_over(queue, group):
    await queue.submit("r1", b"x")
    assert len(await queue.read("dead", block_ms=100)) == 1  # its consumer dies holding it
    worker = EchoWorker(queue, "live", reclaim_idle_s=0.3)
    group.add(worker)
    answer = await queue.wait_result("r1", timeout_s=30)
    assert answer is not None and answer.payload == b"X"
    assert worker.handled == ["r1"] and await queue.pending_count() == 0


async def test_a_slow_job_is_kept_alive_not_taken_over(queue, group):
    """Another worker looks for jobs idle for 2 s every 1 s; while the job runs it looks
    many times over, yet the job is handled once, by the worker that read it.

    The holder touches its job every 2/3 s, so only an event-loop stall of over 1.3 s lets the
    other take it (with 0.6 s a 0.4 s stall did, on a loaded CI machine: the other then held
    the job on its own ``release`` and no answer came)."""
    slow = EchoWorker(queue, "slow", reclaim_idle_s=2.0)
    group.add(slow)
    await queue.submit("r1", b"slow")
    await until(lambda: slow.handled)
    other = EchoWorker(queue, "other", reclaim_idle_s=2.0)
    group.add(other)
    await until(lambda: other.reclaim_checks >= 4)  # about 3 s, past the reclaim threshold
    assert await queue.pending_count() == 1 and other.handled == []
    slow.release.set()
    answer = await queue.wait_result("r1", timeout_s=30)
    assert answer is not None and answer.payload == b"SLOW"
    assert slow.handled == ["r1"] and other.handled == []


async def test_group_reports_a_crashed_worker() -> None:
    class Broken(JobWorker):
        async def step(self) -> int:
            raise ValueError("bug")

        async def run(self, stop: asyncio.Event) -> None:  # no Redis needed to crash
            await self.step()

    crashed = asyncio.Event()
    group = JobWorkerPool(crashed.set)
    group.add(Broken(queue=None, consumer="broken"))  # type: ignore[arg-type]
    await asyncio.wait_for(crashed.wait(), timeout=30)
    assert group.crashed
    await group.stop()


async def test_stop_cancels_a_busy_worker_and_its_job_stays_pending(queue, group):
    worker = EchoWorker(queue, "busy")
    group.add(worker)
    await queue.submit("r1", b"slow")
    await until(lambda: worker.handled)
    await asyncio.wait_for(group.stop(), timeout=30)
    assert all(task.done() for task in group.tasks) and not group.crashed
    assert await queue.pending_count() == 1  # another worker will reclaim it


# ---- local first ---------------------------------------------------------------------------


async def test_local_first_uses_an_idle_slot_and_queues_otherwise() -> None:
    slots = WorkerSlots(1)
    route = LocalFirst(slots, timeout_s=30)

    async def local() -> str:
        assert slots.idle == 0  # the request holds the slot while it runs
        return "local"

    async def queued() -> str:
        return "queued"

    assert await route.run(local, queued) == "local" and slots.idle == 1
    assert slots.try_take()  # a worker busy with a job
    assert await route.run(local, queued) == "queued"
    slots.release()
    assert await LocalFirst(None, 30).run(local, queued) == "queued"
    assert (route.served_local, route.served_queued) == (1, 1)


async def test_local_path_has_the_same_deadline() -> None:
    never = asyncio.Event()
    route = LocalFirst(WorkerSlots(1), timeout_s=0.05)
    with pytest.raises(DeadlineExceeded, match="in-process"):
        await route.run(never.wait, never.wait)
    assert route.slots is not None and route.slots.idle == 1  # released on the way out


async def test_workers_leave_jobs_to_others_while_local_requests_hold_their_slots(queue):
    shared = WorkerSlots(1)
    assert shared.try_take()  # a local request holds this process's only slot
    here, elsewhere = JobWorkerPool(lambda: None, 1.0), JobWorkerPool(lambda: None, 1.0)
    mine = EchoWorker(queue, "here", slots=shared)
    here.add(mine)
    other = EchoWorker(queue, "elsewhere")
    elsewhere.add(other)
    try:
        await queue.submit("r1", b"a")
        assert (await queue.wait_result("r1", 30)).payload == b"A"
        assert (mine.handled, other.handled) == ([], ["r1"])
        await elsewhere.stop()
        shared.release()  # the local request is done: this process reads jobs again
        await queue.submit("r2", b"b")
        assert (await queue.wait_result("r2", 30)).payload == b"B"
        assert mine.handled == ["r2"]
    finally:
        await here.stop()
        await elsewhere.stop()


async def test_idle_workers_counts_consumers_waiting_for_work(queue, group, redis_client, keys):
    unused = WorkQueue(redis_client, keys, keys.refcritic_stream, "nobody")
    assert await IdleWorkers(unused).count() == 0  # no stream: nobody waits
    idle = IdleWorkers(queue, cache_s=0)
    workers = [EchoWorker(queue, "one"), EchoWorker(queue, "two")]
    for worker in workers:
        group.add(worker)
    await until(lambda: _equals(idle.count(), 2))
    await queue.submit("r1", b"slow")
    await until(lambda: any(worker.handled for worker in workers))
    await until(lambda: _equals(idle.count(), 1))  # the one holding a job is not idle
    for worker in workers:
        worker.release.set()


async def _equals(count, expected: int) -> bool:
    return await count == expected


def test_parts_spread_over_idle_workers_but_never_below_a_minimum() -> None:
    assert [parts_for(256, idle, 64) for idle in (0, 1, 3, 16)] == [1, 1, 3, 4]
    assert parts_for(10, 8, 64) == 1
    pieces = split_evenly(list(range(10)), 3)
    assert [list(p) for p in pieces] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split_evenly([1], 4) == [[1]] and split_evenly([], 2) == []
