"""The order of one weight update on a replica, and the length of its pause.

Why its own room: a replica that stops taking work for an update serves nothing for that
long, once per training step, on every replica. So everything that reads the update's bytes
happens first, with admission open and the old weights serving: the bytes arrive
(``server.py`` receives them before calling in), are verified in one pass (size, checksum,
finite values, magnitude: ``weight_updates.verified``), a delta is made whole over the kept
base and checked against the full push's checksum, and the engine checks and prepares the
swap (``Engine.stage_weights``: the transformers engine readies the changed elements, vLLM
writes the file its worker reads). A refused update stops there: the replica never paused
and nothing it serves changed. Only then is admission closed (state ``updating``) for the
part that must not overlap a request: making way for the update (``rollout.update_policy``),
the swap, the cache flush. Requests never see two versions: nothing runs in the engine while
it swaps, and the job loop and direct calls wait for ``serving``.

The pause is timed on the monotonic clock from closing admission to opening it again, and
reported in the update's reply (``UpdateOutcome.pause_seconds``; the trainer logs
``weight/pause_s``). It holds the in-flight requests' drain under ``restart``/``finish``: a
short pause needs an idle replica or ``update_policy: keep``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import Unavailable
from rlfleet.model import weights
from rlfleet.rollout.inflight import InFlight
from rlfleet.rollout.phase import Phase
from rlfleet.rollout.types import ReplicaState, UpdateOutcome
from rlfleet.rollout.weight_updates import Staged, WeightUpdater, verified

S = ReplicaState
UPDATABLE = (S.SERVING, S.PAUSED, S.UPDATE_FAILED)


class UpdateSteps:
    """Runs one weight update at a time in the order above. ``announce`` publishes the state
    (the replica's heartbeat to the registry, so routers stop routing while it updates)."""

    def __init__(
        self,
        config: RlfleetConfig,
        updater: WeightUpdater,
        phase: Phase,
        inflight: InFlight,
        announce: Callable[[], Awaitable[None]],
    ) -> None:
        self.config, self.updater, self.phase, self.inflight = config, updater, phase, inflight
        self._announce = announce

    async def run(self, header: weights.WeightHeader, payload: weights.BytesLike) -> UpdateOutcome:
        """Verify and stage while serving, then swap in a pause; see the module docstring."""
        async with self.updater.lock:
            self.updater.check(header)  # again: another update may have landed meanwhile
            started = time.perf_counter()
            state_dict = await asyncio.to_thread(self._verified, header, payload)
            verify_s = time.perf_counter() - started
            staged = await self.updater.stage(header, state_dict)
            staged.seconds += verify_s
            try:
                return await self._paused(staged)
            finally:
                staged.engine.discard()

    async def _paused(self, staged: Staged) -> UpdateOutcome:
        """Admission closed: make way, swap, flush; admission opened again whatever happened."""
        if self.phase.state not in UPDATABLE:
            raise Unavailable(f"replica {self.phase.replica_id} is {self.phase.state}")
        self.phase.set(S.UPDATING)
        closed = time.monotonic()
        try:
            await self._announce()
            rollout = self.config.rollout
            await self.inflight.make_way(
                self.updater.engine, rollout.update_policy, rollout.drain_timeout_s
            )
            outcome = await self.updater.apply(staged)
        finally:
            self.inflight.reopen()  # requests stopped for the update go on
            self.phase.set(self.phase.resting(self.updater.intact))
            pause_s = time.monotonic() - closed
            await self._announce()
        return dataclasses.replace(outcome, pause_seconds=pause_s)

    def _verified(self, header: weights.WeightHeader, payload: weights.BytesLike) -> dict:
        """The update's tensors once intact, finite and of sane magnitude (a worker thread)."""
        return verified(header, payload, self.config.rollout.max_weight_abs)
