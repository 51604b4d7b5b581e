"""The requests a replica runs right now: one asyncio task each, keyed by engine request id.

Why one place for them: a weight update (finish, then cancel the stragglers), a shutdown, a
lost lease (cancel the queue jobs) and callers that gave up (cancel one job) each have to find
running work, and the drain check asks whether anything still runs. A cancelled task is how
a request is aborted: the engine stops it (vLLM's ``generate`` on cancellation, the hf engine
by stopping its rows). Queue jobs are remembered beside their tasks, so the cancel watcher
(``job_loop.py``) can ask Redis about them.

Before a weight update, ``make_way`` clears the engine as ``rollout.update_policy`` says
(``continuation.py``: keep, finish or restart) and ``reopen`` lets the requests go on after.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from rlfleet.common.queue.workqueue import Job
from rlfleet.rollout.continuation import UpdateGate

if TYPE_CHECKING:
    from rlfleet.rollout.engines.base import Engine

log = logging.getLogger(__name__)

STOP_WAIT_S = 5.0
"""Least time an engine gets to stop its requests for an update (it stops them at its next
decoding step; past this, whatever still runs is cancelled and restarted)."""


class InFlight:
    """Running tasks of one replica, and the queue jobs among them."""

    def __init__(self, replica_id: str) -> None:
        self._replica_id = replica_id
        self._running: dict[str, asyncio.Task] = {}  # engine request id -> task
        self._jobs: dict[str, Job] = {}  # engine request id -> the queue job it runs
        self._aborted: set[str] = set()  # engine request ids cancelled because callers left
        self._ids = itertools.count()
        self.gate = UpdateGate()  # requests run through it, so an update can stop them

    def __len__(self) -> int:
        return len(self._running)

    def track(
        self, make: Callable[[str], Coroutine[Any, Any, object]], job: Job | None = None
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

    async def make_way(self, engine: Engine, policy: str, timeout_s: float) -> None:
        """Clear the engine for a weight update (``rollout.update_policy``): ``finish`` waits
        for every request; ``restart`` waits ``timeout_s``, then stops the rest (their tokens
        counted as discarded) and cancels them back onto the stream; ``keep`` stops every
        request where it is at once, to continue after ``reopen``."""
        tasks = list(self._running.values())
        if policy == "finish":
            if tasks:
                await asyncio.wait(tasks)
            return
        if policy == "restart" and tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        if policy == "restart" and not self._running:
            return
        self.gate.close(keep=policy == "keep")
        await engine.interrupt()
        idle = await self.gate.wait_idle(max(timeout_s, STOP_WAIT_S))
        if policy != "keep" or not idle:
            if not idle:
                log.warning(
                    "the engine did not stop %d requests in %.0f s: restarting them",
                    self.gate.running,
                    max(timeout_s, STOP_WAIT_S),
                )
                self.gate.stats.requests_restarted += len(self._running)
            await self.finish_or_cancel(0)

    def reopen(self) -> None:
        """After the update (loaded or refused): stopped requests go on."""
        self.gate.open()
