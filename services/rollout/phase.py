"""A replica's state (``ReplicaState``), the pause asked for, and the waits on them.

Why one small class: the job loop runs only while serving, direct calls wait out an update,
and an update ends in a state that depends on pause and on whether the weights are intact;
each reads the same few fields, so they live together. Nothing here touches Redis: the
heartbeat (``lease.py``) publishes the state.
"""

from __future__ import annotations

import asyncio
import contextlib

from rlfleet.common.errors import Unavailable
from rlfleet.rollout.types import ReplicaState

S = ReplicaState


class Phase:
    """Where a replica is (``state``), whether pause was asked for, and events to wait on."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.state = S.STARTING
        self.paused = False  # an update in progress ends in the state this asks for
        self.serving = asyncio.Event()  # set exactly when state is SERVING
        self._changed = asyncio.Event()  # pulsed on every state change

    def set(self, state: ReplicaState) -> None:
        """Move to ``state``; wakes everyone waiting for a change."""
        self.state = state
        (self.serving.set if state is S.SERVING else self.serving.clear)()
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self, timeout_s: float | None = None) -> None:
        """Until the next state change, or ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    async def wait_until_serving(self) -> None:
        """Direct calls wait out an update; paused, starting or draining replicas refuse."""
        while self.state is not S.SERVING:
            if self.state is not S.UPDATING:
                raise Unavailable(f"replica {self.replica_id} is {self.state}")
            await self.wait_changed()

    def resting(self, weights_intact: bool) -> ReplicaState:
        """Where an update ends: failed weights take no work, whatever pause asked for."""
        if not weights_intact:
            return S.UPDATE_FAILED
        return S.PAUSED if self.paused else S.SERVING

    def ask_paused(self, paused: bool, from_state: ReplicaState, to_state: ReplicaState) -> bool:
        """Record the pause asked for and move ``from_state`` to ``to_state``; True if the
        state changed (an update in progress keeps its state and ends as asked)."""
        self.paused = paused
        if self.state != from_state:
            return False
        self.set(to_state)
        return True
