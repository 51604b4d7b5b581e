"""An env worker: takes episode jobs off the Redis stream and answers each with its episode.

Workers are interchangeable consumers of one consumer group, so adding processes
(``rlfleet env --worker-only``) adds episodes in flight; the read / reclaim / keep-alive /
answer loop is the shared ``rlfleet.common.queue.workers.JobWorker``, so a worker that dies mid-episode
loses nothing (its entry stays pending and another worker's reclaim restarts the episode,
``restarts`` = deliveries before this one) and a long episode is never mistaken for a dead
worker's (its entry is kept alive while it plays).

One worker plays ``agent.concurrency`` episodes at once as that many lanes: each lane is a
``JobWorker`` taking one episode at a time, all sharing the worker's ``EpisodeRunner``. Why
lanes rather than one consumer reading ``concurrency`` jobs: a consumer handles what it read
together and reads again only when all are answered, so one long episode would hold the
others' places idle; a lane that finishes takes the next episode at once.

The lanes of one process take turns at reading (``read_turn``: one blocked read per process
at a time). Why: Redis hands new entries to blocked readers in the order they blocked, so a
process whose 128 idle lanes all blocked before another process's took whole batches (up to
its lane count), and a worker-only process started next to the front door could play 0 of
a run's episodes. With one reader per process, the processes' reads alternate and a batch is
spread over them; a lane still starts its episode the moment it has one.
"""

from __future__ import annotations

import asyncio
import logging

from rlfleet.common.queue.consumer import Consumer
from rlfleet.common.queue.entries import Job
from rlfleet.common.queue.workers import JobWorker
from rlfleet.env.runner import EpisodeRunner
from rlfleet.env.types import EpisodeOutcome, QueuedEpisode, decode_job

WATCH_EVERY_S = 1.0  # how often a playing lane checks whether its episode was withdrawn


class EnvWorker(JobWorker):
    """One lane of a worker: one consumer of the env stream, one episode at a time."""

    LIFECYCLE_LEVEL = logging.DEBUG  # the env role logs its lanes' start and stop in one line

    def __init__(
        self,
        queue: Consumer,
        runner: EpisodeRunner,
        consumer: str,
        reclaim_idle_s: float = 10.0,
        read_turn: asyncio.Lock | None = None,
    ) -> None:
        super().__init__(queue, consumer, reclaim_idle_s, read_count=1)
        self.runner = runner
        self.read_turn = read_turn or asyncio.Lock()
        """Shared by the lanes of one process: one of them blocks on the stream at a time."""
        self.withdrawn = 0

    async def read(self) -> list[Job]:
        """An episode, when this lane's turn at reading comes (module docstring)."""
        async with self.read_turn:
            if self._stop.is_set():
                return []
            return await super().read()

    async def handle(self, job: Job) -> bytes:
        """The episode's outcome; InvalidArgument (a failed answer) when the entry is unusable.
        An episode answered already (withdrawn by its caller, or played by another worker after
        a reclaim) is not started, or stops; its answer, b"", is then never stored."""
        queued = decode_job(job.payload)
        if await self.queue.answered(job):
            return b""
        outcome = await self._play_unless_answered(job, queued)
        return b"" if outcome is None else outcome.encode()

    async def _play_unless_answered(self, job: Job, queued: QueuedEpisode) -> EpisodeOutcome | None:
        restarts = max(0, job.deliveries - 1)  # deliveries count this one
        playing = asyncio.create_task(self.runner.play(queued, restarts))
        watch = asyncio.create_task(self.queue.until_answered(job, WATCH_EVERY_S))
        try:
            await asyncio.wait({playing, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (playing, watch):
                task.cancel()
        if not playing.done() or playing.cancelled():
            self.withdrawn += 1
            return None
        return playing.result()
