"""The one work queue behind rollout, reward and refcritic: Redis Streams with consumer groups.

Why streams: an entry stays pending until a worker acks it, so a worker dying mid-job loses
nothing, and ``XAUTOCLAIM`` lets a live worker take it over. An entry delivered more than
``max_deliveries`` times is poison: it goes to a dead-letter stream and its request gets an
error answer, so a bad input cannot crash workers forever nor leave a waiter hanging.
Answers are stored with ``SET NX`` under ``Keys.result(request_id)``: the first answer wins, so
a retried request is answered once. Completed entries are acked *and* deleted, so a stream
holds only outstanding work, which ``move_to`` can hand from a dead replica to a live one.

Request ids are idempotency keys: unique within a cluster for ``result_ttl_s``. The Redis
client must not decode responses (payloads are bytes); its socket timeout, if any, must exceed
``poll_s`` and ``block_ms``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from rlfleet.common.errors import ErrorCode
from rlfleet.common.keys import Keys
from rlfleet.common.results import Failure, Result, decode_result, encode_result

log = logging.getLogger(__name__)

NOTIFY_TTL_S = 60  # only waiters blocked right now need the token; later ones read the result
_BATCH = 500

_SUBMIT_LUA = """if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'payload', ARGV[2], 'prior', ARGV[3])
return 1"""


@dataclass(frozen=True)
class Job:
    """One delivery of a request to a consumer; ``deliveries`` counts this one too (for a
    job taken out by ``drain_jobs``: the deliveries so far, 0 if it was never read)."""

    entry_id: str
    request_id: str
    payload: bytes
    deliveries: int


class WorkQueue:
    """Producer and consumer side of one stream, read by one consumer group."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        stream: str,
        group: str,
        max_deliveries: int = 3,
        result_ttl_s: int = 3600,
        poll_s: float = 0.5,
    ) -> None:
        if redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("WorkQueue needs a Redis client with decode_responses=False")
        if max_deliveries < 1 or result_ttl_s < 1 or poll_s <= 0:
            raise ValueError("max_deliveries, result_ttl_s and poll_s must be positive")
        self._redis, self.keys, self.stream, self.group = redis, keys, stream, group
        self.max_deliveries, self.result_ttl_s, self.poll_s = max_deliveries, result_ttl_s, poll_s
        self.dead_stream = keys.dead_letter(stream)
        self._submit_script = redis.register_script(_SUBMIT_LUA)
        self._replay_from: dict[str, str | None] = {}  # consumer -> own-pending cursor, None=done
        self._claim_cursor = "0-0"
        self._notify_ttl_s = min(NOTIFY_TTL_S, result_ttl_s)

    async def ensure_group(self) -> None:
        """Create the group (and stream); from id 0 so entries queued before it are served."""
        try:
            await self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def submit(self, request_id: str, payload: bytes, prior_deliveries: int = 0) -> bool:
        """Queue a request; False (and nothing queued) when it has been answered already.

        Check and add are one Lua script, so a retry can never be queued after its answer."""
        keys = [self.stream, self.keys.result(request_id)]
        added = await self._submit_script(keys=keys, args=[request_id, payload, prior_deliveries])
        return bool(added)

    async def get_result(self, request_id: str) -> Result | None:
        raw = await self._redis.get(self.keys.result(request_id))
        return None if raw is None else decode_result(request_id, raw)

    async def wait_result(self, request_id: str, timeout_s: float) -> Result | None:
        """The answer, or None after ``timeout_s``.

        Blocks on the notify list for at most ``poll_s`` at a time and re-reads the result key
        in between, so a lost or stolen wake-up only delays a waiter, never strands it. A waiter
        woken by the token puts it back for the next one; a stale token is swallowed.
        """
        loop = asyncio.get_running_loop()
        deadline, notify, woken = loop.time() + timeout_s, self.keys.notify(request_id), False
        while (result := await self.get_result(request_id)) is None:
            if (remaining := deadline - loop.time()) <= 0:
                return None
            timeout = max(0.01, min(self.poll_s, remaining))  # BLPOP 0 would block forever
            woken = bool(await self._redis.blpop([notify], timeout=timeout))
        if woken:
            await self._pass_token_on(notify)
        return result

    async def read(self, consumer: str, count: int = 1, block_ms: int = 1000) -> list[Job]:
        """Jobs for ``consumer``: first its own never-acked entries (a restart under the same
        name), once per WorkQueue object; then new entries, waiting up to ``block_ms``
        (``<= 0``: no wait). Over-delivered entries are dead-lettered instead of returned.
        """
        start = self._replay_from.get(consumer, "0")
        if start is not None:
            entries = await self._xread(consumer, start, count, block_ms=0)
            self._replay_from[consumer] = entries[-1][0] if entries else None
            if entries:
                return await self._to_jobs(entries, await self._counts(entries))
        return await self._to_jobs(await self._xread(consumer, ">", count, block_ms))

    async def complete(self, job: Job, payload: bytes, failure: Failure | None = None) -> bool:
        """Answer a job (a payload, or why it failed) and drop it from the stream; True if this
        was the first answer."""
        return await self._finish(job, encode_result(payload, failure))

    async def touch(self, consumer: str, jobs: list[Job]) -> None:
        """Reset the idle time of ``consumer``'s jobs, so ``reclaim`` leaves them alone while it
        works on them. ``XCLAIM ... JUSTID`` does not count as a delivery (no dead-lettering)."""
        ids = [job.entry_id for job in jobs]
        await self._redis.xclaim(self.stream, self.group, consumer, 0, ids, justid=True)

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int = 10) -> list[Job]:
        """Take over entries other (likely dead) consumers have held for ``min_idle_ms``."""
        args = (self.stream, self.group, consumer, min_idle_ms, self._claim_cursor)
        reply = await self._group_call(lambda: self._redis.xautoclaim(*args, count=count))
        if not reply:
            return []
        self._claim_cursor = _text(reply[0])
        entries = [(_text(eid), fields) for eid, fields in reply[1]]
        return await self._to_jobs(entries, await self._counts(entries))

    async def pending_count(self) -> int:
        """Entries delivered to some consumer and not yet completed."""
        summary = await self._group_call(lambda: self._redis.xpending(self.stream, self.group))
        return int(summary["pending"]) if summary else 0

    async def length(self) -> int:
        """Outstanding entries, delivered or not (completed ones are deleted)."""
        return int(await self._redis.xlen(self.stream))

    async def forget(self, request_ids: list[str]) -> None:
        """Drop stored answers that their only reader has read (saves memory until the TTL)."""
        if request_ids:
            await self._redis.unlink(*[self.keys.result(rid) for rid in request_ids])

    async def ping(self) -> bool:
        """Whether Redis answers (a health check for the role holding the queue)."""
        return bool(await self._redis.ping())

    async def drain_jobs(self) -> list[Job]:
        """Take every outstanding entry (pending or unread) out of this stream, with its
        delivery count, so whoever re-queues it can pass that on as ``prior_deliveries``."""
        taken: list[Job] = []
        async for batch in self._batches():
            await self._remove(batch)
            taken.extend(batch)
        return taken

    async def drain_entries(self) -> list[tuple[str, bytes]]:
        """``drain_jobs`` as (request_id, payload) pairs."""
        return [(job.request_id, job.payload) for job in await self.drain_jobs()]

    async def move_to(self, other: WorkQueue) -> int:
        """Move outstanding work to ``other``; returns how many entries were queued there.

        Each batch is copied before it is deleted here, so a crash mid-move can duplicate work
        (answered once anyway) but never lose it. Delivery counts travel with the entries, so a
        job that kills every replica it lands on still ends in the dead-letter stream.
        """
        if other.stream == self.stream:
            raise ValueError(f"cannot move {self.stream} onto itself")
        moved = 0
        async for batch in self._batches():
            for job in batch:
                moved += await other.submit(job.request_id, job.payload, job.deliveries)
            await self._remove(batch)
        log.info("moved %d entries from %s to %s", moved, self.stream, other.stream)
        return moved

    async def _xread(self, consumer: str, start: str, count: int, block_ms: int) -> list[_Entry]:
        block = block_ms if block_ms > 0 else None  # BLOCK 0 would mean "forever"
        streams = {self.stream: start}
        reply = await self._group_call(
            lambda: self._redis.xreadgroup(self.group, consumer, streams, count=count, block=block)
        )
        return _stream_entries(reply)

    async def _to_jobs(self, entries: list[_Entry], counts: _Counts | None = None) -> list[Job]:
        """Jobs (``counts`` from the PEL; None: first delivery). Entries deleted meanwhile are
        acked away; over-delivered ones are dead-lettered instead of returned."""
        stale = [eid for eid, fields in entries if not fields]
        if stale:
            await self._redis.xack(self.stream, self.group, *stale)
        jobs = [_job(eid, fields, (counts or {}).get(eid, 1)) for eid, fields in entries if fields]
        for job in jobs:
            if job.deliveries > self.max_deliveries:
                await self.dead_letter(job, f"delivered {job.deliveries} times")
        return [job for job in jobs if job.deliveries <= self.max_deliveries]

    async def _counts(self, entries: list[_Entry]) -> _Counts:
        """How often each entry was delivered so far (absent: never, or no group)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for eid, _ in entries:
                pipe.xpending_range(self.stream, self.group, eid, eid, 1)
            replies = await pipe.execute(raise_on_error=False)
        pel = [p for reply in replies if isinstance(reply, list) for p in reply]
        return {_text(p["message_id"]): int(p["times_delivered"]) for p in pel}

    async def dead_letter(self, job: Job, reason: str) -> None:
        """Give up on a job: error answer for its waiters, a copy in the dead-letter stream.
        Also for a drained job, whose entry is gone already (XACK/XDEL then do nothing)."""
        log.warning("dead-lettering request %s from %s: %s", job.request_id, self.stream, reason)
        fields = {"id": job.request_id, "payload": job.payload, "reason": reason,
                  "stream": self.stream, "deliveries": job.deliveries}  # fmt: skip
        failure = Failure(ErrorCode.INTERNAL, f"dead-lettered after too many deliveries: {reason}")
        await self._finish(job, encode_result(b"", failure), dead=fields)

    async def _finish(self, job: Job, answer: bytes, dead: dict[str, Any] | None = None) -> bool:
        """One transaction: store the answer unless one exists (True if stored), wake waiters,
        ack and delete the entry, and file it as dead if asked."""
        notify = self.keys.notify(job.request_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.result(job.request_id), answer, nx=True, ex=self.result_ttl_s)
            pipe.rpush(notify, b"1").expire(notify, self._notify_ttl_s)
            pipe.xack(self.stream, self.group, job.entry_id).xdel(self.stream, job.entry_id)
            if dead:
                pipe.xadd(self.dead_stream, dead, maxlen=10_000, approximate=True)
            return bool((await pipe.execute())[0])

    async def _pass_token_on(self, notify: str) -> None:
        """A waiter that popped the wake-up token puts it back for the next waiter."""
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.rpush(notify, b"1").expire(notify, self._notify_ttl_s).execute()

    async def _batches(self) -> AsyncIterator[list[Job]]:
        """Outstanding entries in id order; ``deliveries`` = deliveries so far (0 if unread)."""
        start = "-"
        while raw := await self._redis.xrange(self.stream, start, "+", count=_BATCH):
            entries = [(_text(eid), fields) for eid, fields in raw]
            counts = await self._counts(entries)
            yield [_job(eid, fields, counts.get(eid, 0)) for eid, fields in entries]
            start = "(" + entries[-1][0]

    async def _remove(self, jobs: list[Job]) -> None:
        """Ack and delete (XACK fails harmlessly when the stream never had a group)."""
        ids = [job.entry_id for job in jobs]
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, *ids).xdel(self.stream, *ids)
            await pipe.execute(raise_on_error=False)

    async def _group_call(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run a group command; if the stream or group vanished, recreate it and return None."""
        try:
            return await call()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("group %s on %s missing, recreating it", self.group, self.stream)
            await self.ensure_group()
            return None


_Entry = tuple[str, dict[bytes, bytes]]
_Counts = dict[str, int]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _job(entry_id: str, fields: dict[bytes, bytes], deliveries: int) -> Job:
    prior = int(fields.get(b"prior", 0))
    return Job(entry_id, _text(fields[b"id"]), fields[b"payload"], deliveries + prior)


def _stream_entries(reply: Any) -> list[_Entry]:
    """XREADGROUP's reply for our stream (a list; a dict with ``legacy_responses=False``)."""
    if not reply:
        return []
    per_stream = list(reply.values()) if isinstance(reply, dict) else [pair[1] for pair in reply]
    return [(_text(eid), fields or {}) for eid, fields in per_stream[0]]
