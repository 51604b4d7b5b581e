"""Keeping a worker's claimed stream entries fresh while it works on them.

Workers reclaim entries left idle longer than some threshold (a dead consumer's work). A live
worker on a slow job must not lose it that way, so while it computes it periodically resets
the entries' idle time with ``XCLAIM ... JUSTID`` (which, unlike a re-delivery, does not
count towards the dead-letter limit). One helper for every pool of workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from rlfleet.common.workqueue import WorkQueue

log = logging.getLogger(__name__)


async def _touch_forever(queue: WorkQueue, consumer: str, entry_ids: list[str], every_s: float):
    while True:
        await asyncio.sleep(every_s)
        try:
            await queue.redis.xclaim(queue.stream, queue.group, consumer, 0, entry_ids, justid=True)
        except RedisError as exc:
            log.warning("worker %s could not refresh its jobs: %s", consumer, exc)


@contextlib.asynccontextmanager
async def kept_alive(
    queue: WorkQueue, consumer: str, entry_ids: list[str], reclaim_idle_s: float
) -> AsyncIterator[None]:
    """Within this block, ``entry_ids`` never look idle for ``reclaim_idle_s``."""
    task = asyncio.create_task(_touch_forever(queue, consumer, entry_ids, reclaim_idle_s / 3))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
