"""One stream and its consumer group: what every side of the queue stands on.

Why a shared base: the producer, the consumer and the backlog of one stream must agree on its
settings (group, deliveries before dead-lettering, answer TTL) and on how an answer is stored.
Storing an answer (``_finish``: one Lua step) and giving up on an entry (``dead_letter``) are
here because a consumer reading a poison entry and a mover bouncing one both need them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from rlfleet.common.errors import ErrorCode
from rlfleet.common.keys import Keys
from rlfleet.common.queue.answers import Answers
from rlfleet.common.queue.entries import Entry, Job, job_of, range_entries, text
from rlfleet.common.queue.results import Failure, encode_result
from rlfleet.common.queue.waiting import WaitingBoard

log = logging.getLogger(__name__)

SCAN_BATCH = 500  # entries read per XRANGE when walking a stream


class QueueStream(Answers):
    """One stream read by one consumer group (its requests' answers: ``Answers``)."""

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
        if max_deliveries < 1:
            raise ValueError("max_deliveries must be positive")
        super().__init__(redis, keys, result_ttl_s, poll_s)
        self.stream, self.group, self.max_deliveries = stream, group, max_deliveries
        self.dead_stream = keys.dead_letter(stream)
        self._board = WaitingBoard(redis, keys.waiting(stream))
        self.fence: tuple[str, str] | None = None
        """(key, token): answers are stored only while ``key`` holds ``token`` (a consumer's
        lease) and the job's entry is still in this stream; else they are discarded."""

    async def ensure_group(self) -> None:
        """Create the group (and stream); from id 0 so entries queued before it are served."""
        try:
            await self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def ping(self) -> bool:
        """Whether Redis answers (a health check for the role holding the queue)."""
        return bool(await self._redis.ping())

    async def length(self) -> int:
        """Outstanding entries, delivered or not (completed ones are deleted)."""
        return int(await self._redis.xlen(self.stream))

    async def pending_count(self) -> int:
        """Entries delivered to some consumer and not yet completed."""
        summary = await self._group_call(lambda: self._redis.xpending(self.stream, self.group))
        return int(summary["pending"]) if summary else 0

    async def waiting_consumers(self, fresh_ms: int) -> int:
        """Consumers of the group, in any process, waiting for work now: marked waiting by
        themselves (``mark_waiting``) within ``fresh_ms`` (a dead consumer's mark ages out).
        Not ``XINFO CONSUMERS``, whose ``idle`` differs between servers (``queue.waiting``)."""
        return await self._board.count(fresh_ms)

    async def mark_waiting(self, consumer: str) -> None:
        """``consumer`` is about to wait for work (call again at least every second)."""
        await self._board.waiting(consumer)

    async def mark_busy(self, consumer: str) -> None:
        """``consumer`` took work (or stopped): no longer counted as waiting."""
        await self._board.busy(consumer)

    async def dead_letter(
        self, job: Job, reason: str, code: ErrorCode = ErrorCode.INTERNAL, queued: bool = False
    ) -> bool:
        """Give up on a job: error answer for its waiters, a copy in the dead-letter stream.
        Also for a drained job, whose entry is gone already; with ``queued`` only if its
        entry is still here (a mover racing a consumer). True if it was dead-lettered."""
        fields = {
            "id": job.request_id,
            "payload": job.payload,
            "reason": reason,
            "stream": self.stream,
            "deliveries": job.deliveries,
        }
        what = (
            "dead-lettered after too many deliveries" if code is ErrorCode.INTERNAL else "refused"
        )
        answer = encode_result(b"", Failure(code, f"{what}: {reason}"))
        done = await self._finish(job, answer, dead=fields, queued=queued) >= 0
        if done:
            log.warning("dead-lettered request %s from %s: %s", job.request_id, self.stream, reason)
        return done

    async def _finish(
        self,
        job: Job,
        answer: bytes,
        dead: dict[str, Any] | None = None,
        members: dict[str, bytes] | None = None,
        queued: bool = False,
    ) -> int:
        """One step (``scripts.FINISH_LUA``): check the fence, store the answer unless one
        exists, wake waiters, ack and delete the entry, file it as dead if asked."""
        fence_key, token = self.fence or (self.stream, "")
        members = members or {}
        dead_args = [x for pair in (dead or {}).items() for x in pair]
        keys = [
            self.stream,
            fence_key,
            self.dead_stream,
            self.keys.result(job.request_id),
            self.keys.notify(job.request_id),
            self.keys.waiters(job.request_id),
            *(self.keys.result(m) for m in members),
        ]
        args = [
            self.group,
            job.entry_id,
            token,
            self.result_ttl_s,
            self._notify_ttl_s,
            "1" if token or queued else "0",
            len(dead_args),
            *dead_args,
            answer,
            *members.values(),
        ]
        return int(await self._scripts.finish(keys=keys, args=args))

    async def _entries(self) -> AsyncIterator[list[Entry]]:
        """Every entry in the stream, in id order, in batches (no delivery counts)."""
        start = "-"
        while entries := range_entries(
            await self._redis.xrange(self.stream, start, "+", count=SCAN_BATCH)
        ):
            yield entries
            start = "(" + entries[-1][0]

    async def _batches(self) -> AsyncIterator[list[Job]]:
        """Outstanding entries in id order; ``deliveries`` = deliveries so far (0 if unread)."""
        async for entries in self._entries():
            counts = await self._counts(entries)
            yield [job_of(eid, fields, counts.get(eid, 0)) for eid, fields in entries]

    async def _counts(self, entries: list[Entry]) -> dict[str, int]:
        """How often each entry was delivered so far (absent: never, or no group)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for eid, _ in entries:
                pipe.xpending_range(self.stream, self.group, eid, eid, 1)
            replies = await pipe.execute(raise_on_error=False)
        pel = [p for reply in replies if isinstance(reply, list) for p in reply]
        return {text(p["message_id"]): int(p["times_delivered"]) for p in pel}

    async def _remove(self, entry_ids: list[str]) -> None:
        """Ack and delete (XACK fails harmlessly when the stream never had a group)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.xdel(self.stream, *entry_ids)
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
