"""A stream's outstanding work as a whole: look at it, move it, count it, trim what is done.

Why: a rollout replica that dies leaves its stream full of work nobody else reads (each
replica has its own stream). Whoever rescues it (the router's janitor) walks the backlog,
moves each entry to a live stream in one Lua step (``scripts.MOVE_LUA``: an entry is in exactly
one stream at any instant), keeps in-flight counts true (``recount``) and trims memory.
Delivery counts travel with moved entries (``prior``), so a job that kills every consumer it
lands on still ends in the dead-letter stream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from redis.typing import EncodableT

from rlfleet.common.queue.entries import Job, after, id_key, text
from rlfleet.common.queue.stream import QueueStream

log = logging.getLogger(__name__)


class Backlog(QueueStream):
    """The outstanding entries of one stream (pending or unread)."""

    async def outstanding(self) -> AsyncIterator[list[Job]]:
        """Outstanding entries in id order, in batches; ``deliveries`` = so far (0: unread)."""
        async for batch in self._batches():
            yield batch

    async def drain_jobs(self) -> list[Job]:
        """Take every outstanding entry (pending or unread) out of this stream, with its
        delivery count, so whoever re-queues it can pass that on as ``prior_deliveries``."""
        taken: list[Job] = []
        async for batch in self._batches():
            await self._remove([job.entry_id for job in batch])
            taken.extend(batch)
        return taken

    async def drain_entries(self) -> list[tuple[str, bytes]]:
        """``drain_jobs`` as (request_id, payload) pairs."""
        return [(job.request_id, job.payload) for job in await self.drain_jobs()]

    async def move(self, job: Job, other: QueueStream) -> bool:
        """Move one entry (as ``outstanding`` read it) to ``other`` in one step; True if it
        went there (False: it left meanwhile, or had been answered and is just dropped)."""
        keys = [self.stream, other.stream, self.keys.result(job.request_id)]
        args: list[EncodableT] = [self.group, job.entry_id, job.deliveries]
        return await self._scripts.move(keys=keys, args=args) == 1

    async def move_to(self, other: QueueStream) -> int:
        """Move outstanding work to ``other``; returns how many entries were queued there.

        Each entry moves in one step (``move``), so a crash mid-move neither loses nor
        duplicates work, and running it again finishes the job."""
        if other.stream == self.stream:
            raise ValueError(f"cannot move {self.stream} onto itself")
        moved = 0
        async for batch in self._batches():
            for job in batch:
                moved += await self.move(job, other)
        log.info("moved %d entries from %s to %s", moved, self.stream, other.stream)
        return moved

    async def recount(self, hash_key: str, field: str) -> int:
        """Store the number of requests waiting in this stream (entries' weights) as
        ``hash_key[field]`` (deleted at 0), in one step; returns it."""
        return int(await self._scripts.recount(keys=[self.stream, hash_key], args=[field]))

    async def trim(self) -> int:
        """Trim entries every consumer is done with (ids below the oldest pending and unread
        entry) from the stream's memory; returns how many went."""
        if not await self._redis.exists(self.stream):  # a replica still starting has none yet
            return 0
        groups = await self._group_call(lambda: self._redis.xinfo_groups(self.stream))
        ours = [g for g in groups or [] if text(g["name"]) == self.group]
        if not ours:
            return 0
        boundary = after(text(ours[0]["last-delivered-id"]))
        summary = await self._redis.xpending(self.stream, self.group)
        if summary and summary["pending"]:
            boundary = min(boundary, text(summary["min"]), key=id_key)
        return int(await self._redis.xtrim(self.stream, minid=boundary, approximate=False))
