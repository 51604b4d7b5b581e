"""Exactly-once pieces of the work queue, against a real (embedded) Redis server: one-step
moves, fenced answers, request ids bound to their content, cancellation marks, recounts, trims.

Runs with the same three client flavours as ``test_workqueue.py`` (its fixtures).
"""

# ruff: noqa: F811 - fixtures imported from test_workqueue are used as parameters
from __future__ import annotations

import redis.asyncio as aioredis
from test_workqueue import MakeQueue, client, make_queue  # noqa: F401 - fixtures

from rlfleet.common.errors import ErrorCode
from rlfleet.common.keys import Keys
from rlfleet.common.queue.results import encode_result
from rlfleet.common.queue.workqueue import Bound, Finish, Result


async def test_a_move_is_one_step_and_never_repeats(make_queue: MakeQueue, keys: Keys) -> None:  # noqa: F811
    source = await make_queue(keys.rollout_stream("a"))
    targets = [await make_queue(keys.rollout_stream(name)) for name in ("b", "c")]
    await source.submit("r1", b"p1", weight=3)
    [held] = await source.read("a", block_ms=100)  # delivered once, then its consumer stalls
    [job] = [j async for batch in source.outstanding() for j in batch]
    assert job.deliveries == 1 and job.weight == 3
    assert await source.move(job, targets[0])
    assert not await source.move(job, targets[1])  # a second janitor with the same view
    assert await source.length() == 0 and await targets[1].length() == 0
    [moved] = await targets[0].read("b", block_ms=100)
    assert (moved.request_id, moved.payload, moved.deliveries, moved.weight) == ("r1", b"p1", 2, 3)
    source.fence = None
    assert await source.finish(held, encode_result(b"late")) is Finish.STORED  # unfenced: legacy


async def test_an_answered_entry_is_dropped_not_moved(make_queue: MakeQueue, keys: Keys) -> None:  # noqa: F811
    source, target = await make_queue(keys.rollout_stream("a")), await make_queue()
    await source.submit("r1", b"p")
    [job] = [j async for batch in source.outstanding() for j in batch]
    await client_set_result(source, "r1")  # answered by a consumer that did not delete it
    assert not await source.move(job, target)
    assert await source.length() == 0 and await target.length() == 0


async def client_set_result(queue, request_id: str) -> None:
    await queue._redis.set(queue.keys.result(request_id), encode_result(b"done"))


async def test_fenced_answers_need_the_lease_and_the_entry(
    make_queue: MakeQueue,
    client: aioredis.Redis,
    keys: Keys,  # noqa: F811
) -> None:
    queue, other = await make_queue(keys.rollout_stream("a")), await make_queue()
    lease = keys.heartbeat("a")
    queue.fence = (lease, "token-1")
    for rid in ("r1", "r2", "r3"):
        await queue.submit(rid, b"p")
    one, two, three = await queue.read("a", count=3, block_ms=100)
    assert await queue.finish(one, encode_result(b"x")) is Finish.FENCED  # no lease at all
    assert await queue.get_result("r1") is None and await queue.pending_count() == 3
    await client.set(lease, "token-2")  # re-registered under another lease
    assert await queue.finish(one, encode_result(b"x")) is Finish.FENCED
    await client.set(lease, "token-1")
    assert await queue.move(two, other)  # the janitor moved it meanwhile
    assert await queue.finish(two, encode_result(b"x")) is Finish.GONE
    members = {"m1": encode_result(b"a"), "m2": encode_result(b"b")}
    assert await queue.finish(three, encode_result(b""), members) is Finish.STORED
    assert (await queue.get_result("m2")).payload == b"b"
    assert await client.ttl(keys.result("m2")) > 0 and await client.ttl(keys.result("r3")) > 0
    assert await queue.finish(one, encode_result(b"x")) is Finish.STORED
    assert await queue.finish(one, encode_result(b"y")) is Finish.GONE  # answered once


async def test_a_request_id_is_bound_to_its_content(
    make_queue: MakeQueue,
    client: aioredis.Redis,
    keys: Keys,  # noqa: F811
) -> None:
    queue = await make_queue(keys.rollout_stream("a"))
    assert await queue.submit_bound("r1", b"p", "f" * 64, "s1") is Bound.QUEUED
    assert await queue.submit_bound("r1", b"p", "f" * 64, "s2") is Bound.JOINED
    assert await queue.submit_bound("r1", b"q", "e" * 64, "s3") is Bound.CONFLICT
    assert await queue.length() == 1 and await queue.bound_to("r1") == "f" * 64
    assert await client.ttl(keys.request("r1")) > 0
    [job] = await queue.read("a", block_ms=100)
    assert job.submission == "s1" and await queue.cancelled([job]) == []
    assert await queue.unbind("r1")  # every caller gave up
    assert await queue.cancelled([job]) == [job]
    assert await queue.submit_bound("r1", b"p", "f" * 64, "s4") is Bound.QUEUED  # a retry
    _, retry = [j async for batch in queue.outstanding() for j in batch]
    assert await queue.cancelled([retry]) == []  # the mark names the first submission only
    assert await queue.complete(retry, b"answer")
    assert not await queue.unbind("r1")  # answered: the binding outlives it
    assert await queue.submit_bound("r1", b"p", "f" * 64, "s5") is Bound.ANSWERED
    assert await queue.submit_bound("r1", b"q", "e" * 64, "s6") is Bound.CONFLICT


async def test_recount_and_trim(
    make_queue: MakeQueue,
    client: aioredis.Redis,
    keys: Keys,  # noqa: F811
) -> None:
    queue = await make_queue(keys.rollout_stream("a"))
    for i, weight in enumerate((1, 4, 2, 1)):
        await queue.submit(f"r{i}", b"p", weight=weight)
    assert await queue.recount(keys.inflight, "a") == 8
    assert await client.hget(keys.inflight, "a") == b"8"
    jobs = await queue.read("a", count=3, block_ms=100)
    await client.xack(queue.stream, queue.group, jobs[0].entry_id)  # acked, not deleted
    await queue.complete(jobs[1], b"x")
    assert await queue.length() == 3
    assert await queue.trim() == 1  # only the acked entry: pending and unread ones stay
    assert [j.request_id for b in [b async for b in queue.outstanding()] for j in b] == ["r2", "r3"]
    await queue.complete(jobs[2], b"x")
    [last] = await queue.read("a", block_ms=100)
    await queue.complete(last, b"x")
    assert await queue.recount(keys.inflight, "a") == 0
    assert await client.hget(keys.inflight, "a") is None


async def test_unreadable_entry_is_dead_lettered_with_an_answer(
    make_queue: MakeQueue,
    client: aioredis.Redis,
    keys: Keys,  # noqa: F811
) -> None:
    queue = await make_queue(keys.rollout_stream("a"))
    await queue.submit("r1", b"not json")
    [job] = [j async for batch in queue.outstanding() for j in batch]
    assert await queue.dead_letter(job, "unreadable", ErrorCode.INVALID_ARGUMENT, queued=True)
    assert not await queue.dead_letter(job, "unreadable", ErrorCode.INVALID_ARGUMENT, queued=True)
    result = await queue.get_result("r1")
    assert result.code is ErrorCode.INVALID_ARGUMENT and "unreadable" in result.message
    assert isinstance(result, Result) and await queue.length() == 0
    assert len(await client.xrange(keys.dead_letter(queue.stream))) == 1
