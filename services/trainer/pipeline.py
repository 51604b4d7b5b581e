"""Asynchronous training: the next batches are generated while the actor updates.

In ``trainer.mode: async`` a producer task runs ``Collector.produce`` ahead of the learner. The
batch for step ``s`` may come from weights at most ``max_staleness`` (``k``) versions older
than the ones it is trained on. The producer enforces that before it asks for anything: it
waits until version ``v0 + (s - s0) - k`` has landed on the replicas and asks the router for
at least that version (``min_weight_version``), so the router's version gating, not luck,
bounds the lag. ``k = 0`` therefore degenerates to the synchronous loop, step for step.

Responses that still arrive older than allowed (a replica that missed a push) are dropped,
whole groups at a time, and counted in ``async/dropped`` (``rlfleet.trainer.staleness``); the
rest are corrected for their lag: with the engine's old log-probs the PPO ratio is already
against the behaviour policy; with the actor's, the engine's log-probs become the behaviour
policy of AReaL's truncated importance weights (``Trainer.corrects_staleness``,
``rlfleet.rl.losses``).
Weight pushes land between requests on the replicas: by default a replica lets in-flight
requests finish and then swaps (``rollout.drain_timeout_s``); with ``drain_timeout_s: 0`` it
aborts them back onto its stream instead, and they re-run on the new weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.metrics import Timer
from rlfleet.trainer.rollout_batch import RolloutBatch

if TYPE_CHECKING:
    from rlfleet.trainer.collect import Collector
    from rlfleet.trainer.pushes import WeightPushes

log = logging.getLogger(__name__)


class AsyncRollouts:
    """Produces ``(batch, timer)`` pairs for consecutive steps, ``k`` versions ahead at most."""

    def __init__(
        self,
        collector: Collector,
        pushes: WeightPushes,
        data: Iterator[list[PromptRecord]],
        *,
        first_step: int,
        first_version: int,
        staleness: int,
    ) -> None:
        self.collector, self.pushes = collector, pushes
        self.staleness = staleness
        """``trainer.max_staleness``: how many versions a batch may lag its step."""
        self._data = data
        self._first_step, self._first_version = first_step, first_version
        self._ready: asyncio.Queue = asyncio.Queue(maxsize=self.staleness + 1)
        self._task: asyncio.Task | None = None
        self._gate = asyncio.Event()
        self._gate.set()
        self._busy = asyncio.Lock()
        self.idle_rollout_s = 0.0
        """Producer time spent waiting for a weight version (reset by ``take_idle``)."""

    def min_version(self, step: int) -> int:
        """The oldest weight version the batch of ``step`` may be generated with."""
        lag_free = self._first_version + (step - self._first_step)
        return max(self._first_version, lag_free - self.staleness)

    def start(self) -> None:
        self._task = asyncio.create_task(self._produce_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def next(self) -> tuple[RolloutBatch, Timer]:
        """The next step's batch; re-raises whatever stopped the producer."""
        item = await self._ready.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def pause(self) -> None:
        """Stop producing after the batch in hand (validation must not overlap training)."""
        self._gate.clear()
        async with self._busy:
            pass

    def resume(self) -> None:
        self._gate.set()

    def take_idle(self) -> float:
        idle, self.idle_rollout_s = self.idle_rollout_s, 0.0
        return idle

    async def _produce_forever(self) -> None:
        step = self._first_step
        try:
            for prompts in self._data:
                await self._produce(step, prompts)
                step += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the learner, which stops the run
            log.error("rollout producer stopped at step %d: %s", step, exc)
            await self._ready.put(exc)

    async def _produce(self, step: int, prompts: list[PromptRecord]) -> None:
        needed = self.min_version(step)
        waited = time.perf_counter()
        await self.pushes.wait_for_landed(needed)
        self.idle_rollout_s += time.perf_counter() - waited
        await self._gate.wait()
        timer = Timer()
        async with self._busy:
            batch = await self.collector.produce(
                prompts, step, needed, timer, refill=lambda: next(self._data)
            )
        waited = time.perf_counter()
        await self._ready.put((batch, timer))
        self.idle_rollout_s += time.perf_counter() - waited
