"""The producer side of a pool of queue workers: a batch of payloads in, their answers out.

``ScatterGather`` submits a batch's jobs under fresh request ids, waits for every answer until
one deadline (``Answers.wait_all``), returns them in order, and drops the stored answers;
with ``withdraw``, a caller that gives up takes its unanswered jobs back
(``Producer.withdraw``), so workers stop working for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

from rlfleet.common.errors import DeadlineExceeded
from rlfleet.common.queue.producer import Producer
from rlfleet.common.queue.results import Result

log = logging.getLogger(__name__)

R = TypeVar("R")


class ScatterGather:
    """Producer side of a queue: a batch of payloads in, their answers out, in order.

    Request ids are generated here, never taken from callers: callers reuse ids from batch to
    batch, and the queue treats an id it has answered before as done. At most ``concurrency``
    submits are in flight per producer, across batches. Waiting holds no such slot (a batch
    whose jobs are slow must not keep the next batch from being queued: head-of-line
    blocking): each batch waits on one connection (``Answers.wait_all``).

    ``withdraw``: a batch whose caller gives up (cancelled, timed out) has its unanswered jobs
    withdrawn (``Producer.withdraw``), so workers do not keep scoring for nobody and delay
    everyone behind; ``withdrawn`` counts them. Without it their answers are just dropped.
    """

    def __init__(
        self,
        queue: Producer,
        timeout_s: float,
        workers: str,
        concurrency: int = 32,
        withdraw: bool = False,
    ) -> None:
        self.queue, self.timeout_s, self.workers = queue, timeout_s, workers
        self.withdraw, self.withdrawn = withdraw, 0
        self._slots = asyncio.Semaphore(concurrency)

    async def start(self) -> None:
        await self.queue.ensure_group()

    async def run(self, payloads: list[bytes]) -> list[Result]:
        """Every payload's answer, in order; DeadlineExceeded unless all come within
        ``timeout_s`` (the answers that did come are then dropped, or withdrawn)."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        batch = uuid.uuid4().hex
        ids = [f"{self.queue.group}-{batch}-{i}" for i in range(len(payloads))]
        by_id = dict(zip(ids, payloads, strict=True))
        try:
            epoch = await self.queue.epoch()  # read first: a Redis that loses it is then seen
            await self._submit_all(ids, payloads)
            resubmit = partial(self._resubmit, by_id)  # the server lost them: queue again
            answers = await self.queue.wait_all(ids, deadline, epoch=epoch, resubmit=resubmit)
            results = self._all_answered([answers.get(i) for i in ids])
        except BaseException:
            await self._give_up(ids)
            raise
        await self.queue.forget(ids)
        return results

    async def _submit_all(self, ids: list[str], payloads: list[bytes]) -> None:
        """Queue every job; these submits take the producer's slots."""
        pairs = zip(ids, payloads, strict=True)
        await self._bounded([partial(self.queue.submit, i, p) for i, p in pairs])

    async def _resubmit(self, payloads: dict[str, bytes], lost: list[str]) -> None:
        await self._submit_all(lost, [payloads[i] for i in lost])

    async def _give_up(self, ids: list[str]) -> None:
        """Drop the answers that came; with ``withdraw`` take back the jobs still unanswered
        (shielded: a cancelled caller's work is withdrawn all the same)."""
        if self.withdraw:
            await asyncio.shield(self._withdraw(ids))
        else:
            await self.queue.forget(ids)

    async def _withdraw(self, ids: list[str]) -> None:
        try:
            self.withdrawn += await self.queue.withdraw(ids)
        except Exception as exc:  # noqa: BLE001 - the caller's error matters more than ours
            log.warning("could not withdraw %d job(s): %s", len(ids), exc)

    def _all_answered(self, answers: list[Result | None]) -> list[Result]:
        missing = sum(answer is None for answer in answers)
        if missing:
            raise DeadlineExceeded(
                f"{missing} of {len(answers)} jobs on {self.queue.stream} not answered within "
                f"{self.timeout_s:g}s (are {self.workers} running?)"
            )
        return [answer for answer in answers if answer is not None]

    async def _bounded(self, calls: list[Callable[[], Awaitable[R]]]) -> list[R]:
        """Every call's result, with at most ``concurrency`` of this producer's in flight."""

        async def one(call: Callable[[], Awaitable[R]]) -> R:
            async with self._slots:
                return await call()

        return list(await asyncio.gather(*(one(call) for call in calls)))
