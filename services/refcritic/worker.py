"""A refcritic worker: takes ref / values jobs off one Redis stream, computes, answers.

Workers of one stream are interchangeable consumers of one group, so more processes
(``rlfleet refcritic --worker-only``) add reference throughput. The read / reclaim /
keep-alive / answer loop is the shared ``rlfleet.common.queue.workers.JobWorker``: a worker that dies
mid-job loses nothing (a live one reclaims the entry after ``refcritic.reclaim_idle_s``), and a
slow forward is never mistaken for a dead worker. A failure is answered with its error code.

The model runs in a thread under the process's model lock (shared with the gRPC servicer), so
the event loop stays free for health checks and one computation runs at a time; hence one job
is taken at a time. ``in_thread_locked`` is the same call for the front door's local path
(``QueuedCompute.serve_locally``), which shares this worker's slot.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from rlfleet.common.queue.consumer import Consumer
from rlfleet.common.queue.entries import Job
from rlfleet.common.queue.local_first import WorkerSlots
from rlfleet.common.queue.workers import JobWorker
from rlfleet.refcritic.queue_service import LocalCompute, Rows, decode_job, encode_rows

Compute = Callable[[list[list[int]], list[list[int]]], Rows]


def in_thread_locked(compute: Compute, lock: threading.Lock) -> LocalCompute:
    """``compute`` as a coroutine: in a thread, under the process's model lock."""

    def locked(prompts: list[list[int]], responses: list[list[int]]) -> Rows:
        with lock:
            return compute(prompts, responses)

    async def run(prompts: list[list[int]], responses: list[list[int]]) -> Rows:
        return await asyncio.to_thread(locked, prompts, responses)

    return run


class RefCriticWorker(JobWorker):
    """One consumer of one stream; ``compute`` answers its jobs (RefPolicy / Critic method).

    ``delay_s`` is a testing aid: each job is held that long first, so it can be killed."""

    def __init__(
        self,
        queue: Consumer,
        compute: Compute,
        lock: threading.Lock,
        consumer: str,
        reclaim_idle_s: float = 10.0,
        delay_s: float = 0.0,
        slots: WorkerSlots | None = None,
    ) -> None:
        super().__init__(queue, consumer, reclaim_idle_s, read_count=1, slots=slots)
        self.compute, self.lock, self.delay_s = compute, lock, delay_s

    async def handle(self, job: Job) -> bytes:
        _, prompts, responses = decode_job(job.payload)
        return encode_rows(await asyncio.to_thread(self._locked, prompts, responses))

    def _locked(self, prompts: list[list[int]], responses: list[list[int]]):
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        with self.lock:
            return self.compute(prompts, responses)
