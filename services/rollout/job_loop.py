"""When a replica's queued jobs run: read its stream, park, retry, and cancel abandoned ones.

Why a loop of its own (like a scheduler beside a model runner): it only decides what runs
next and hands each job to ``JobRunner`` as a task ``InFlight`` can find.

- Work arrives on the replica's own stream, read through the shared ``WorkQueue`` as consumer
  ``replica_id`` of group ``rollout``, never more jobs at once than
  ``rollout.max_concurrency``. Jobs cancelled by a weight update (``HeldJobs``, still
  unacknowledged in Redis) run again before anything new is read.
- An entry that needs newer weights than ours is parked, unacknowledged, until an update
  brings that version (``HeldJobs.unpark``); it is not answered FAILED_PRECONDITION, so a caller
  retrying under the same id still gets it generated.
- Callers that give up mark their submission cancelled; ``watch_cancelled`` polls for such
  jobs, cancels the running ones (the engine aborts them; ``JobRunner`` drops them
  unanswered) and drops the parked ones, one Redis round trip per poll for both.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from functools import partial

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.queue.workqueue import Job, WorkQueue
from rlfleet.rollout.inflight import InFlight
from rlfleet.rollout.job_runner import JobRunner, with_retries
from rlfleet.rollout.phase import Phase
from rlfleet.rollout.types import entry_demand

log = logging.getLogger(__name__)

READ_BLOCK_MS = 500  # how long one read waits; bounds how fast pause/stop take effect
CANCEL_POLL_S = 0.25  # how often running jobs are checked for callers that gave up


class HeldJobs:
    """Jobs a replica holds but does not run: to retry (cancelled by an update, still
    unacknowledged) and parked (waiting for the weight version they need)."""

    def __init__(self) -> None:
        self._retry: deque[Job] = deque()
        self._parked: list[tuple[int, Job]] = []  # (version needed, job)

    def __bool__(self) -> bool:
        return bool(self._retry or self._parked)

    def retry(self, job: Job) -> None:
        self._retry.append(job)

    def take(self, count: int) -> list[Job]:
        """Up to ``count`` jobs to retry, oldest first."""
        return [self._retry.popleft() for _ in range(min(count, len(self._retry)))]

    def park(self, job: Job, needed: int, version: int) -> None:
        log.debug(
            "request %s needs weights v%d (serving v%d): parked until they arrive",
            job.request_id,
            needed,
            version,
        )
        self._parked.append((needed, job))

    def unpark(self, version: int) -> None:
        """Queue for running the parked jobs the weights of ``version`` can serve."""
        ready = [job for needed, job in self._parked if needed <= version]
        self._parked = [(n, job) for n, job in self._parked if n > version]
        self._retry.extend(ready)

    def parked(self) -> list[Job]:
        return [job for _, job in self._parked]

    def all(self) -> list[Job]:
        """Every job held here, to retry and parked."""
        return [*self._retry, *self.parked()]

    def drop_parked(self, jobs: list[Job]) -> None:
        dropped = {id(job) for job in jobs}
        self._parked = [(n, job) for n, job in self._parked if id(job) not in dropped]

    def clear(self) -> None:
        """Forget every held job (our lease lapsed: they will be read again, or moved)."""
        self._retry.clear()
        self._parked.clear()


class JobLoop:
    """Reads jobs and starts them (``consume``); cancels abandoned ones (``watch_cancelled``)."""

    def __init__(
        self,
        config: RlfleetConfig,
        queue: WorkQueue,
        replica_id: str,
        phase: Phase,
        inflight: InFlight,
        held_jobs: HeldJobs,
        runner: JobRunner,
        version: Callable[[], int],
    ) -> None:
        self.config, self.queue, self.replica_id = config, queue, replica_id
        self._phase, self._inflight, self._held_jobs = phase, inflight, held_jobs
        self._runner, self._version = runner, version

    async def consume(self) -> None:
        """Run until cancelled: whenever serving and below ``max_concurrency``, start jobs."""
        while True:
            await self._phase.serving.wait()
            free = self.config.rollout.max_concurrency - len(self._inflight)
            if free <= 0:
                await self._phase.wait_changed(0.05)
                continue
            jobs = self._held_jobs.take(free) or self._not_held(await self._read(free))
            for job in jobs:
                if (needed := _needed_version(job)) > self._version():
                    self._held_jobs.park(job, needed, self._version())
                elif self._phase.serving.is_set():
                    self._inflight.track(partial(self._runner.run, job), job)
                else:
                    self._held_jobs.retry(job)  # read just as an update began: run it after

    def _not_held(self, jobs: list[Job]) -> list[Job]:
        """``jobs`` less the entries we already run or hold. After a lapse the next read
        replays our pending entries, but a read that was in flight across the lapse (blocked
        in Redis while we were stopped, say) may already have started some of them after the
        held jobs were dropped: they are pending too, and would run a second time here."""
        held = {job.entry_id for job in (*self._inflight.jobs().values(), *self._held_jobs.all())}
        return [job for job in jobs if job.entry_id not in held]

    async def _read(self, count: int) -> list[Job]:
        try:
            return await self.queue.read(self.replica_id, count=count, block_ms=READ_BLOCK_MS)
        except Exception as exc:  # noqa: BLE001 - Redis hiccups must not kill the loop
            log.warning("reading %s failed (%s); retrying in 1 s", self.queue.stream, exc)
            await asyncio.sleep(1.0)
            return []

    async def watch_cancelled(self) -> None:
        """Cancel the jobs whose callers all gave up (the engine aborts them); parked ones
        are dropped unanswered. One round trip per poll for both."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            held, parked = self._inflight.jobs(), self._held_jobs.parked()
            if not held and not parked:
                continue
            try:
                gone = {id(job) for job in await self.queue.cancelled([*held.values(), *parked])}
            except Exception as exc:  # noqa: BLE001 - Redis hiccups must not kill the loop
                log.warning("checking for cancelled requests failed: %s", exc)
                continue
            for key, job in held.items():
                if id(job) in gone:
                    self._inflight.abort(key)
            await self._drop_parked([job for job in parked if id(job) in gone])

    async def _drop_parked(self, abandoned: list[Job]) -> None:
        for job in abandoned:
            log.debug("parked request %s dropped: its callers gave up", job.request_id)
            await with_retries(job.request_id, partial(self.queue.discard, job))
        self._held_jobs.drop_parked(abandoned)


def _needed_version(job: Job) -> int:
    """The weight version a queue entry needs; 0 when unreadable (``JobRunner.run`` answers
    it)."""
    try:
        return entry_demand(job.payload)[0]
    except (ValueError, TypeError, AttributeError):
        return 0
