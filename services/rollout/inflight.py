"""The requests a replica runs right now: one asyncio task each, keyed by engine request id.

Why one place for them: a weight update (finish, then cancel the stragglers), a shutdown, a
lost lease (cancel the queue jobs) and callers that gave up (cancel one job) each have to find
running work, and the drain check asks whether anything still runs. A cancelled task is how
a request is aborted: the engine stops it (vLLM's ``generate`` on cancellation, the hf engine
by stopping its rows). Queue jobs are remembered beside their tasks, so the cancel watcher
(``job_loop.py``) can ask Redis about them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable

from rlfleet.common.workqueue import Job

log = logging.getLogger(__name__)


class InFlight:
    """Running tasks of one replica, and the queue jobs among them."""

    def __init__(self, replica_id: str) -> None:
        self._replica_id = replica_id
        self._running: dict[str, asyncio.Task] = {}  # engine request id -> task
        self._jobs: dict[str, Job] = {}  # engine request id -> the queue job it runs
        self._aborted: set[str] = set()  # engine request ids cancelled because callers left
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._running)

    def track(
        self, make: Callable[[str], Awaitable[object]], job: Job | None = None
    ) -> asyncio.Task:
        """Run ``make(engine_request_id)`` as a task that updates and shutdown can find."""
        key = f"{self._replica_id}-{next(self._ids)}"
        task = asyncio.create_task(make(key))
        self._running[key] = task
        if job is not None:
            self._jobs[key] = job
        task.add_done_callback(lambda _: self._untrack(key))
        return task

    def _untrack(self, key: str) -> None:
        self._running.pop(key, None)
        self._jobs.pop(key, None)
        self._aborted.discard(key)

    def jobs(self) -> dict[str, Job]:
        """The queue jobs running now, by engine request id (a copy)."""
        return dict(self._jobs)

    def abort(self, key: str) -> None:
        """Cancel a job because its callers gave up (``was_aborted`` tells it why)."""
        if (task := self._running.get(key)) is not None:
            self._aborted.add(key)
            task.cancel()

    def was_aborted(self, key: str) -> bool:
        return key in self._aborted

    async def finish_or_cancel(self, timeout_s: float) -> None:
        """Wait for in-flight requests, then cancel the rest (engines abort cancelled requests:
        vLLM's ``generate`` does on cancellation, the hf engine stops their rows)."""
        if tasks := list(self._running.values()):
            await asyncio.wait(tasks, timeout=timeout_s)
        stragglers = {key: task for key, task in self._running.items() if not task.done()}
        for task in stragglers.values():
            task.cancel()
        await asyncio.gather(*stragglers.values(), return_exceptions=True)
        if stragglers:
            log.debug("cancelled %d in-flight requests; queued ones will re-run", len(stragglers))

    async def cancel_jobs(self) -> None:
        """Cancel every running queue job and wait until they are done (direct calls go on)."""
        held = [self._running[key] for key in list(self._jobs) if key in self._running]
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
