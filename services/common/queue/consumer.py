"""The consumer side of a stream: take jobs, answer them, keep them alive, take over the dead.

A consumer reads first its own never-acked entries (a restart under the same name), then new
ones; over-delivered entries are dead-lettered instead of handed out. An answer is one Lua step
(``QueueStream._finish``): with a ``fence`` it is stored only while the consumer's lease holds
and its entry is still in this stream, so a stalled consumer that wakes up cannot answer work
that was moved elsewhere. One exception: when the server lost its data since the job was read
(an empty restart: the lease and the entry vanished with everything else, the work did not
move), a refused answer is stored all the same if the request has none (``salvage``), so
computed work is not thrown away while its caller resubmits.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

from redis.typing import EncodableT, KeyT, StreamIdT

from rlfleet.common.queue.entries import Entry, Job, job_of, stream_entries, text
from rlfleet.common.queue.results import Failure, encode_result
from rlfleet.common.queue.stream import QueueStream

WATCH_EVERY_S = 0.25  # how often ``until_answered`` looks for another answer


class Finish(enum.IntEnum):
    """What became of an answer (``Consumer.finish``)."""

    FENCED = -1  # the consumer's lease lapsed: discarded, the entry is left to whoever owns it
    GONE = -2  # the entry left the stream (moved to another consumer): discarded
    DUPLICATE = 0  # the request had an answer already (ack'd and deleted all the same)
    STORED = 1  # this is the answer


class Consumer(QueueStream):
    """Takes jobs off one stream as members of its group and answers them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # ``QueueStream``'s settings
        self._replay_from: dict[str, str | None] = {}  # consumer -> own-pending cursor, None=done
        self._claim_cursor = "0-0"
        self._epoch: str | None = None  # the server's data epoch our reads are under

    async def ensure_group(self) -> None:
        """Create the group, and note the data epoch (a group recreated after an empty
        restart starts a new one: jobs read from then on carry it)."""
        await super().ensure_group()
        self._epoch = await self.epoch()

    async def read(self, consumer: str, count: int = 1, block_ms: int = 1000) -> list[Job]:
        """Jobs for ``consumer``: first its own never-acked entries (a restart under the same
        name), once per object; then new entries, waiting up to ``block_ms`` (``<= 0``: no
        wait). Over-delivered entries are dead-lettered instead of returned.
        """
        if self._epoch is None:
            self._epoch = await self.epoch()
        start = self._replay_from.get(consumer, "0")
        if start is not None:
            entries = await self._xread(consumer, start, count, block_ms=0)
            self._replay_from[consumer] = entries[-1][0] if entries else None
            if entries:
                return await self._to_jobs(entries, await self._counts(entries))
        return await self._to_jobs(await self._xread(consumer, ">", count, block_ms))

    def replay(self, consumer: str) -> None:
        """Have the next ``read`` for ``consumer`` start again with its own pending entries
        (after it dropped the jobs it held, e.g. on losing its lease)."""
        self._replay_from.pop(consumer, None)

    async def forgive(self, consumer: str, jobs: list[Job]) -> None:
        """Take back one delivery of each of ``consumer``'s pending ``jobs``: it drops them
        through no fault of theirs and reads them again (its lease lapsed while it was
        stopped, or the key was lost), so the re-read must not bring them closer to the
        dead-letter stream. ``XCLAIM ... RETRYCOUNT`` sets the count; entries that left the
        consumer meanwhile (moved, answered) are not in its PEL and are left alone."""
        counts = await self._counts([(job.entry_id, {}) for job in jobs])
        async with self._redis.pipeline(transaction=False) as pipe:
            for entry_id, delivered in counts.items():
                pipe.xclaim(
                    self.stream,
                    self.group,
                    consumer,
                    0,
                    [entry_id],
                    retrycount=max(0, delivered - 1),
                    justid=True,
                )
            await pipe.execute()

    async def complete(self, job: Job, payload: bytes, failure: Failure | None = None) -> bool:
        """Answer a job (a payload, or why it failed) and drop it from the stream; True if this
        was the first answer."""
        return await self.finish(job, encode_result(payload, failure)) is Finish.STORED

    async def finish(
        self, job: Job, answer: bytes, members: dict[str, bytes] | None = None
    ) -> Finish:
        """Store an encoded answer (and ``members``: more request ids' encoded answers) and
        drop the job's entry, in one step; with a ``fence``, only if the lease is still ours
        and the entry still here (a job moved to another consumer is answered there), or the
        server lost its data since the job was read (``salvage``)."""
        outcome = Finish(await self._finish(job, answer, members=members or {}))
        if outcome in (Finish.FENCED, Finish.GONE):
            salvaged = await self.salvage(job, answer, members)
            return outcome if salvaged is None else salvaged  # DUPLICATE is 0: no ``or``
        return outcome

    async def salvage(
        self, job: Job, answer: bytes, members: dict[str, bytes] | None = None
    ) -> Finish | None:
        """Store an answer the fence refused if the server lost its data since ``job`` was
        read (``scripts.SALVAGE_LUA``): STORED, or DUPLICATE when the request had an answer
        already; None when there was no such loss (the answer is discarded)."""
        members = members or {}
        k = self.keys
        keys = [
            k.epoch,
            k.result(job.request_id),
            k.notify(job.request_id),
            k.waiters(job.request_id),
            *(k.result(m) for m in members),
        ]
        args: list[EncodableT] = [
            job.epoch,
            self.result_ttl_s,
            self._notify_ttl_s,
            answer,
            *members.values(),
        ]
        stored = int(await self._scripts.salvage(keys=keys, args=args))
        return None if stored < 0 else Finish(stored)

    async def discard(self, job: Job) -> None:
        """Drop a job unanswered (its caller gave up)."""
        await self._remove([job.entry_id])

    async def touch(self, consumer: str, jobs: list[Job]) -> None:
        """Reset the idle time of ``consumer``'s jobs, so ``reclaim`` leaves them alone while it
        works on them. ``XCLAIM ... JUSTID`` does not count as a delivery (no dead-lettering)."""
        ids: list[StreamIdT] = [job.entry_id for job in jobs]
        await self._redis.xclaim(self.stream, self.group, consumer, 0, ids, justid=True)

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int = 10) -> list[Job]:
        """Take over entries other (likely dead) consumers have held for ``min_idle_ms``."""
        args = (self.stream, self.group, consumer, min_idle_ms, self._claim_cursor)
        reply = await self._group_call(lambda: self._redis.xautoclaim(*args, count=count))
        if not reply:
            return []
        self._claim_cursor = text(reply[0])
        entries = [(text(eid), fields) for eid, fields in reply[1]]
        return await self._to_jobs(entries, await self._counts(entries))

    async def cancelled(self, jobs: list[Job]) -> list[Job]:
        """The jobs whose submission was cancelled (``Answers.unbind``; one round trip)."""
        tagged = [job for job in jobs if job.submission]
        if not tagged:
            return []
        marks = await self._redis.mget([self.keys.cancel(job.request_id) for job in tagged])
        return [
            job
            for job, mark in zip(tagged, marks, strict=True)
            if mark is not None and text(mark) == job.submission
        ]

    async def answered(self, job: Job) -> bool:
        """Whether the job has an answer already: its caller withdrew it
        (``Producer.withdraw``), or another consumer answered it."""
        return await self.get_result(job.request_id) is not None

    async def until_answered(self, job: Job, every_s: float = WATCH_EVERY_S) -> None:
        """Returns once the job has an answer; a consumer races its work against this."""
        while not await self.answered(job):
            await asyncio.sleep(every_s)

    async def _xread(self, consumer: str, start: str, count: int, block_ms: int) -> list[Entry]:
        block = block_ms if block_ms > 0 else None  # BLOCK 0 would mean "forever"
        streams: dict[KeyT, StreamIdT] = {self.stream: start}
        reply = await self._group_call(
            lambda: self._redis.xreadgroup(self.group, consumer, streams, count=count, block=block)
        )
        return stream_entries(reply)

    async def _to_jobs(
        self, entries: list[Entry], counts: dict[str, int] | None = None
    ) -> list[Job]:
        """Jobs (``counts`` from the PEL; None: first delivery). Entries deleted meanwhile are
        acked away; over-delivered ones are dead-lettered instead of returned."""
        stale = [eid for eid, fields in entries if not fields]
        if stale:
            await self._redis.xack(self.stream, self.group, *stale)
        epoch = self._epoch or ""
        jobs = [
            job_of(eid, fields, (counts or {}).get(eid, 1), epoch)
            for eid, fields in entries
            if fields
        ]
        for job in jobs:
            if job.deliveries > self.max_deliveries:
                await self.dead_letter(job, f"delivered {job.deliveries} times")
        return [job for job in jobs if job.deliveries <= self.max_deliveries]
