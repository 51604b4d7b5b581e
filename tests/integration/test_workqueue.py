"""The Redis Streams work queue, against a real (embedded) Redis server.

Every test runs with redis-py's default response shapes, with RESP2, and with
``legacy_responses=False``, because callers may hand the queue any of these clients.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import redis
import redis.asyncio as aioredis

from rlfleet.common.errors import ErrorCode, InvalidArgument
from rlfleet.common.keys import Keys
from rlfleet.common.queue.results import decode_result, encode_result
from rlfleet.common.queue.workqueue import Failure, Result, WorkQueue
from rlfleet.common.redis_server import EmbeddedRedis

MakeQueue = Callable[..., Awaitable[WorkQueue]]
T = TypeVar("T")


async def until(probe: Callable[[], Awaitable[T]], timeout_s: float = 20.0) -> T:
    """``probe()``'s first truthy value, polled until a generous deadline (loaded machines)."""
    deadline = time.monotonic() + timeout_s
    while not (value := await probe()):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
    return value


async def blocked_in_blpop(client: aioredis.Redis, count: int) -> bool:
    """Whether ``count`` connections are blocked in BLPOP right now (the waiters are parked)."""
    clients = await client.client_list()
    return sum(_text(c.get("cmd", "")) == "blpop" for c in clients) >= count


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@pytest.fixture(params=["default", "resp2", "unified"])
async def client(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[aioredis.Redis]:
    options = {"default": {}, "resp2": {"protocol": 2}, "unified": {"legacy_responses": False}}
    client = aioredis.Redis.from_url(redis_url, **options[request.param])
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def make_queue(client: aioredis.Redis, keys: Keys) -> MakeQueue:
    """A fresh WorkQueue object (a new one per call, like a restarted process)."""

    async def make(stream: str | None = None, **options: object) -> WorkQueue:
        queue = WorkQueue(client, keys, stream or keys.reward_stream, "workers", **options)
        await queue.ensure_group()
        return queue

    return make


async def test_complete_acks_deletes_and_answers(make_queue: MakeQueue) -> None:
    queue = await make_queue()
    assert await queue.submit("r1", b'{"x": 1}')
    [job] = await queue.read("w1", count=10, block_ms=100)
    assert (job.request_id, job.payload, job.deliveries) == ("r1", b'{"x": 1}', 1)
    assert await queue.pending_count() == 1

    assert await queue.complete(job, b"answer")
    assert await queue.pending_count() == 0
    assert await queue.length() == 0
    assert await queue.get_result("r1") == Result("r1", b"answer")
    assert await queue.wait_result("r1", timeout_s=1) == Result("r1", b"answer")


async def test_error_result_round_trips(make_queue: MakeQueue) -> None:
    queue = await make_queue()
    await queue.submit("r1", b"in")
    [job] = await queue.read("w1", block_ms=100)
    await queue.complete(job, b"partial", Failure(ErrorCode.INVALID_ARGUMENT, "bad: \nline two"))
    result = await queue.get_result("r1")
    assert result == Result("r1", b"partial", ErrorCode.INVALID_ARGUMENT, "bad: \nline two")
    assert not result.ok and result.error == "bad: \nline two"
    with pytest.raises(InvalidArgument, match="line two"):
        result.unwrap()


async def test_all_waiters_wake_on_completion_without_polling(
    make_queue: MakeQueue, client: aioredis.Redis
) -> None:
    queue = await make_queue(poll_s=30.0)  # a wake-up by polling would take 30 s
    await queue.submit("r1", b"in")
    waiters = [asyncio.create_task(queue.wait_result("r1", timeout_s=60)) for _ in range(3)]
    await until(lambda: blocked_in_blpop(client, 3))
    [job] = await queue.read("w1", block_ms=100)
    started = time.monotonic()
    await queue.complete(job, b"done")
    results = await asyncio.gather(*waiters)
    assert time.monotonic() - started < 10.0  # generous for a loaded machine, far below 30 s
    assert [r.payload for r in results] == [b"done"] * 3


async def test_wait_result_times_out_with_none(make_queue: MakeQueue) -> None:
    queue = await make_queue(poll_s=0.05)
    await queue.submit("r1", b"in")
    started = time.monotonic()
    assert await queue.wait_result("r1", timeout_s=0.3) is None
    assert 0.25 <= time.monotonic() - started < 10.0  # the upper bound only catches a hang
    assert await queue.wait_result("never-submitted", timeout_s=0) is None


def test_results_carry_a_code_and_an_unknown_code_reads_as_internal() -> None:
    raw = encode_result(b"p", Failure(ErrorCode.NOT_FOUND, "no scorer"))
    assert decode_result("r", raw) == Result("r", b"p", ErrorCode.NOT_FOUND, "no scorer")
    assert decode_result("r", b"\x63" + raw[1:]).code is ErrorCode.INTERNAL  # a newer writer
    assert decode_result("r", encode_result(b"x")) == Result("r", b"x")
    assert Result("r", b"x").unwrap() == b"x"


async def test_touch_resets_idle_time_without_a_delivery(
    make_queue: MakeQueue, client: aioredis.Redis, keys: Keys
) -> None:
    queue = await make_queue()
    await queue.submit("r1", b"in")
    [job] = await queue.read("A", block_ms=100)

    async def idle_ms() -> int:
        [entry] = await client.xpending_range(keys.reward_stream, "workers", "-", "+", 1)
        assert entry["times_delivered"] == 1
        return int(entry["time_since_delivered"])

    before = await until(lambda: _at_least(idle_ms, 300))
    await queue.touch("A", [job])
    assert await idle_ms() < before
    assert await queue.reclaim("B", min_idle_ms=before) == []


async def _at_least(probe: Callable[[], Awaitable[int]], floor: int) -> int:
    value = await probe()
    return value if value >= floor else 0


async def test_forget_drops_answers_and_ping_answers(make_queue: MakeQueue) -> None:
    queue = await make_queue()
    await queue.submit("r1", b"in")
    [job] = await queue.read("w1", block_ms=100)
    await queue.complete(job, b"done")
    await queue.forget(["r1", "never-answered"])
    await queue.forget([])
    assert await queue.get_result("r1") is None
    assert await queue.ping()


async def test_unacked_entry_is_redelivered_after_its_consumer_dies(make_queue: MakeQueue) -> None:
    queue = await make_queue()
    await queue.submit("r1", b"in")
    waiter = asyncio.create_task(queue.wait_result("r1", timeout_s=10))
    [lost] = await queue.read("A", block_ms=100)  # A dies holding the job

    assert await queue.reclaim("B", min_idle_ms=60_000) == []  # not idle long enough yet
    [job] = await until(lambda: queue.reclaim("B", min_idle_ms=200))
    assert (job.entry_id, job.payload, job.deliveries) == (lost.entry_id, b"in", 2)
    assert await queue.complete(job, b"from B")
    assert await waiter == Result("r1", b"from B")

    assert not await queue.complete(lost, b"from A, too late")  # first answer wins
    assert (await queue.get_result("r1")).payload == b"from B"
    assert await queue.pending_count() == 0


async def test_restart_under_same_name_replays_own_pending_once(make_queue: MakeQueue) -> None:
    before = await make_queue()
    await before.submit("r1", b"in")
    [job] = await before.read("A", block_ms=100)
    assert await before.read("A", block_ms=0) == []  # still in progress: not handed out again

    after = await make_queue()  # the process restarted with the same consumer name
    [again] = await after.read("A", block_ms=0)
    assert (again.entry_id, again.deliveries) == (job.entry_id, 2)
    assert await after.read("A", block_ms=0) == []
    await after.complete(again, b"ok")
    assert await after.pending_count() == 0


async def test_dead_letter_after_max_deliveries(
    make_queue: MakeQueue, client: aioredis.Redis, keys: Keys
) -> None:
    queue = await make_queue(max_deliveries=2)
    await queue.submit("poison", b"crashes workers")
    assert len(await queue.read("A", block_ms=100)) == 1  # delivery 1
    assert len(await queue.reclaim("B", min_idle_ms=0)) == 1  # delivery 2
    assert await queue.reclaim("C", min_idle_ms=0) == []  # delivery 3: given up

    result = await queue.wait_result("poison", timeout_s=5)
    assert result is not None and result.payload == b""
    assert result.code is ErrorCode.INTERNAL
    assert "dead-lettered" in result.error and "3 times" in result.error
    assert await queue.length() == 0 and await queue.pending_count() == 0
    [(_, fields)] = await client.xrange(keys.dead_letter(keys.reward_stream))
    assert fields[b"id"] == b"poison" and fields[b"payload"] == b"crashes workers"
    assert fields[b"reason"] == b"delivered 3 times"


async def test_restart_loop_on_poison_also_dead_letters(make_queue: MakeQueue) -> None:
    queue = await make_queue(max_deliveries=1)
    await queue.submit("poison", b"in")
    assert len(await queue.read("A", block_ms=100)) == 1
    restarted = await make_queue(max_deliveries=1)
    assert await restarted.read("A", block_ms=0) == []
    assert (await restarted.get_result("poison")).error is not None


async def test_retried_request_is_answered_once(make_queue: MakeQueue) -> None:
    queue = await make_queue()
    assert await queue.submit("r1", b"try 1")
    assert await queue.submit("r1", b"try 2")  # not answered yet: both attempts queued
    first, second = await queue.read("w1", count=10, block_ms=100)
    assert await queue.complete(first, b"answer 1")
    assert not await queue.complete(second, b"answer 2")
    assert (await queue.get_result("r1")).payload == b"answer 1"

    assert not await queue.submit("r1", b"try 3")  # answered: nothing queued
    assert await queue.length() == 0
    assert await queue.read("w1", block_ms=0) == []


async def test_drain_entries_takes_pending_and_unread_work(make_queue: MakeQueue) -> None:
    queue = await make_queue()
    for i in range(3):
        await queue.submit(f"r{i}", f"p{i}".encode())
    [in_progress] = await queue.read("A", count=1, block_ms=100)

    assert await queue.drain_entries() == [("r0", b"p0"), ("r1", b"p1"), ("r2", b"p2")]
    assert await queue.length() == 0 and await queue.pending_count() == 0
    assert await queue.reclaim("B", min_idle_ms=0) == []
    assert await queue.read("B", block_ms=0) == []
    assert await queue.drain_entries() == []
    assert await queue.complete(in_progress, b"late")  # the dead consumer's answer still lands


async def test_drain_jobs_keeps_delivery_counts(
    make_queue: MakeQueue, client: aioredis.Redis, keys: Keys
) -> None:
    queue = await make_queue()
    expected = [("twice", 2), ("once", 1), ("unread", 0), ("moved-in", 2)]
    for request_id, prior in [("twice", 0), ("once", 0), ("unread", 0), ("moved-in", 2)]:
        await queue.submit(request_id, request_id.encode(), prior_deliveries=prior)
    assert len(await queue.read("A", count=2, block_ms=100)) == 2  # twice, once: delivery 1
    assert [j.request_id for j in await queue.reclaim("B", min_idle_ms=0, count=1)] == ["twice"]

    jobs = await queue.drain_jobs()
    assert [(j.request_id, j.deliveries) for j in jobs] == expected
    assert [j.payload for j in jobs] == [name.encode() for name, _ in expected]
    assert await queue.length() == 0 and await queue.pending_count() == 0
    assert await queue.drain_jobs() == []
    await queue.dead_letter(jobs[0], "its consumers died")  # its entry is gone already
    assert "its consumers died" in (await queue.get_result("twice")).error
    [(_, fields)] = await client.xrange(keys.dead_letter(keys.reward_stream))
    assert (fields[b"id"], fields[b"deliveries"]) == (b"twice", b"2")


async def test_move_to_requeues_work_with_its_delivery_history(
    make_queue: MakeQueue, keys: Keys
) -> None:
    dead = await make_queue(keys.rollout_stream("replica-a"))
    alive = await make_queue(keys.rollout_stream("replica-b"))
    await dead.submit("answered", b"a")
    await dead.submit("started", b"s")
    await dead.submit("answered", b"a")  # a retry of a request answered below
    await dead.submit("queued", b"q")
    answered, _started = await dead.read("replica-a", count=2, block_ms=100)
    await dead.complete(answered, b"done")

    assert await dead.move_to(alive) == 2
    assert await dead.length() == 0 and await dead.pending_count() == 0
    moved = await alive.read("replica-b", count=10, block_ms=100)
    assert [(j.request_id, j.payload, j.deliveries) for j in moved] == [
        ("started", b"s", 2),
        ("queued", b"q", 1),
    ]


async def test_delivery_history_survives_moves_into_dead_letter(
    make_queue: MakeQueue, keys: Keys
) -> None:
    streams = [keys.rollout_stream(f"r{i}") for i in range(3)]
    queues = [await make_queue(stream, max_deliveries=2) for stream in streams]
    await queues[0].submit("poison", b"kills replicas")
    assert len(await queues[0].read("r0", block_ms=100)) == 1
    await queues[0].move_to(queues[1])
    assert [j.deliveries for j in await queues[1].read("r1", block_ms=100)] == [2]
    await queues[1].move_to(queues[2])
    assert await queues[2].read("r2", block_ms=100) == []
    assert "dead-lettered" in (await queues[2].get_result("poison")).error


async def test_group_is_recreated_when_the_stream_vanishes(
    make_queue: MakeQueue, client: aioredis.Redis
) -> None:
    queue = await make_queue()
    await client.delete(queue.stream)
    assert await queue.read("w1", block_ms=0) == []
    assert await queue.pending_count() == 0
    await queue.submit("r1", b"in")
    assert [j.request_id for j in await queue.read("w1", block_ms=100)] == ["r1"]


async def test_rejects_a_client_that_decodes_responses(redis_url: str, keys: Keys) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        with pytest.raises(ValueError, match="decode_responses"):
            WorkQueue(client, keys, keys.reward_stream, "workers")
    finally:
        await client.aclose()


# ---- what the queue stands on: key names and the embedded server --------------------------


def test_keys_are_namespaced_by_cluster() -> None:
    keys = Keys("run1")
    assert keys.result("abc") == "rlfleet:run1:result:abc"
    assert keys.rollout_stream("r0") == "rlfleet:run1:stream:rollout:r0"
    assert keys.dead_letter(keys.reward_stream) == "rlfleet:run1:stream:reward:dead"
    with pytest.raises(ValueError):
        keys.dead_letter("rlfleet:other:stream:reward")
    with pytest.raises(ValueError):
        Keys("a:b")


def test_embedded_server_persists_and_stops(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path, appendonly=True) as server:
        assert server.port != 6379
        redis.Redis.from_url(server.url).set("k", b"v")
        port = server.port
    assert not server.running
    with EmbeddedRedis(tmp_path, port=port, appendonly=True) as server:
        assert redis.Redis.from_url(server.url).get("k") == b"v"
    with pytest.raises(ValueError):
        EmbeddedRedis(tmp_path, port=6379)


def test_embedded_server_never_mistakes_another_server_for_its_own(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    server = EmbeddedRedis(tmp_path, port=redis_server.port)  # taken by the session's server
    with pytest.raises(RuntimeError, match="exited with code") as failure:
        server.start()
    assert "Address already in use" in str(failure.value)  # the error shows the server's log
    assert not server.running


async def test_stale_wakeup_token_is_swallowed_not_spun_on(
    make_queue: MakeQueue, client: aioredis.Redis
) -> None:
    queue = await make_queue(poll_s=0.05)
    notify = queue.keys.notify("r1")
    await client.rpush(notify, b"1")  # e.g. its answer expired before the token did
    assert await queue.wait_result("r1", timeout_s=0.3) is None
    assert await client.llen(notify) == 0


async def test_move_to_refuses_its_own_stream(make_queue: MakeQueue) -> None:
    queue = await make_queue()
    with pytest.raises(ValueError):
        await queue.move_to(await make_queue())
