"""The trainer's weight pushes: when a version goes out, and what it knows of it landing.

Why a room of its own: a push is retried through transient failures, in async mode it runs in
the background while the next batch trains (one in flight at a time, so versions arrive in
order), the async producer waits on the newest version the replicas acknowledged, and a
rollout that runs late brings stale replicas up to date. ``Trainer`` decides *which* version
to push; this decides how it gets there. The transport itself is ``Fleet.weight_sync``
(``rlfleet.trainer.weight_sync``).

Memory: an async push needs a copy of the weights that the next update does not touch. That
copy is the encoded payload itself (``WeightSync.snapshot``: the shared-memory file replicas
read), not a clone of every tensor plus the payload: SmolLM2 in fp32 kept 0.54 GB less.

With ``rollout.dtype`` set, the weights go out cast to the engines' dtype (``rollout_state``):
a bf16 push of fp32 weights is half their bytes, and the cast is that push's copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import RlfleetError
from rlfleet.trainer.fleet import Fleet, WeightSnapshot
from rlfleet.trainer.retry import retry_transient
from rlfleet.trainer.weight_check import Expected, WeightCheck

log = logging.getLogger(__name__)

T = TypeVar("T")
CATCH_UP_POLL_S = 3.0
"""How long a rollout may run before the trainer checks for replicas behind its weights."""


class WeightPushes:
    """Pushes of the actor's weights through ``fleet.weight_sync``; ``landed_version`` is the
    newest version the replicas acknowledged (async rollouts wait on it)."""

    def __init__(
        self, config: RlfleetConfig, fleet: Fleet, actor, check: WeightCheck | None = None
    ) -> None:
        self.config, self.fleet, self.actor = config, fleet, actor
        self.check = check
        """The parity probe after each push (``trainer.weight_check``), or None."""
        self.landed_version = 0
        self._landed = asyncio.Condition()
        self._task: asyncio.Task | None = None

    async def push(self, version: int, only_stale: bool = False) -> dict[str, float]:
        """Send the actor's weights as ``version`` to replicas, and wait for them."""
        state = self.rollout_state()
        flush = self.config.rollout.flush_cache_on_update
        expected = None if only_stale else await self._expect(version)
        metrics = await self._push_retrying(state, version, flush, only_stale)
        if not only_stale:
            await self._mark_landed(version)
        return {**metrics, **await self._check(expected)}

    async def publish(self, version: int) -> dict[str, float]:
        """Push a new version. Sync mode waits for it; async mode lets it land while the
        next batch trains (one push in flight at a time, so versions arrive in order)."""
        if self.config.trainer.mode == "sync":
            return await self.push(version)
        previous = await self.finish()
        flush = self.config.rollout.flush_cache_on_update
        state = self.rollout_state()
        # Encoded now, before the next update changes the weights; sent in the background.
        snapshot = await self.fleet.weight_sync.snapshot(state, version, flush)
        expected = await self._expect(version)  # the actor's side before it trains on
        self._task = asyncio.create_task(self._push_snapshot(snapshot, version, expected))
        return previous

    def rollout_state(self) -> dict:
        """The actor's weights as the engines hold them: cast to ``rollout.dtype`` where one is
        set (resolved on this host; a replica that resolves ``auto`` otherwise casts on load),
        LoRA adapter tensors left as they are (they are merged in float32 or handed over)."""
        from rlfleet.model.precision import serving_dtype

        state = self.actor.state_dict_for_rollout()
        model_dtype, rollout_dtype = self.config.model.dtype, self.config.rollout.dtype
        if rollout_dtype is None:
            return state
        return cast_weights(state, serving_dtype(model_dtype, rollout_dtype, _device_type(state)))

    async def finish(self) -> dict[str, float]:
        """Wait for the push in flight (async mode); its metrics, or {} if none."""
        task, self._task = self._task, None
        return await task if task is not None else {}

    async def wait_for_landed(self, version: int) -> None:
        """Block until replicas hold weights of at least ``version``."""
        async with self._landed:
            await self._landed.wait_for(lambda: self.landed_version >= version)

    async def catching_up_while(self, waiting: Awaitable[T], version: int) -> T:
        """Await ``waiting`` (a rollout; the actor stands still meanwhile); every
        ``CATCH_UP_POLL_S`` until it is done, replicas behind ``version`` get it.

        Why: a replica restarted under its old id parks the work it held, which needs the
        weights it lost, until a push brings them; the trainer's next regular push comes only
        after this rollout, so without this the two would wait for each other until the
        rollout timed out."""
        task = asyncio.ensure_future(waiting)
        try:
            while not (await asyncio.wait({task}, timeout=CATCH_UP_POLL_S))[0]:
                await self._catch_up_stale_replicas(version)
            return task.result()
        finally:
            task.cancel()

    async def _push_retrying(
        self, state: dict, version: int, flush: bool, only_stale: bool
    ) -> dict[str, float]:
        """A push that a transient failure (router or Redis down) retries, for up to
        ``trainer.step_retry_s``. A retry goes only to replicas still behind ``version``: those
        that took it already would refuse it again as not newer."""

        async def attempt(n: int) -> dict[str, float]:
            return await self.fleet.weight_sync.push(state, version, flush, only_stale or n > 0)

        budget = self.config.trainer.step_retry_s
        return await retry_transient(attempt, budget, f"push of weight version {version}")

    async def _expect(self, version: int) -> Expected | None:
        """The actor's scores of the parity probe for ``version``, when one is due."""
        if self.check is None or not self.check.due(version):
            return None
        return await self.check.expect(self.actor, version)

    async def _check(self, expected: Expected | None) -> dict[str, float]:
        """The parity probe of the replicas that took ``expected.version`` (ERROR and drain
        on a mismatch: ``weight_check``); its metrics, with its time."""
        if self.check is None or expected is None:
            return {}
        started = time.perf_counter()
        metrics = await self.check.check(expected)
        return {**metrics, "timing_s/weight_check": time.perf_counter() - started}

    async def _push_snapshot(
        self, snapshot: WeightSnapshot, version: int, expected: Expected | None = None
    ) -> dict[str, float]:
        """Push ``snapshot`` to every live replica, retried like any push (a retry goes only
        to replicas still behind), then free it."""

        async def attempt(n: int) -> dict[str, float]:
            return await snapshot.push(only_stale=n > 0)

        try:
            budget = self.config.trainer.step_retry_s
            metrics = await retry_transient(attempt, budget, f"push of weight version {version}")
        finally:
            snapshot.close()
        await self._mark_landed(version)
        return {**metrics, **await self._check(expected)}

    async def _mark_landed(self, version: int) -> None:
        async with self._landed:
            self.landed_version = max(self.landed_version, version)
            self._landed.notify_all()

    async def _catch_up_stale_replicas(self, version: int) -> None:
        if self._task is not None:  # its version first; its outcome is finish's
            await asyncio.wait({self._task})
        try:
            pushed = await self.push(version, only_stale=True)
        except RlfleetError as exc:
            log.warning("could not bring stale replicas to version %d: %s", version, exc)
            return
        if pushed.get("weight_sync/replicas"):
            log.debug(
                "rollout running late: brought %d stale replica(s) to version %d",
                int(pushed["weight_sync/replicas"]),
                version,
            )


def cast_weights(state: dict, dtype_name: str) -> dict:
    """``state``'s floating tensors in ``dtype_name`` (the others, and LoRA adapter tensors,
    unchanged; a tensor already in it is not copied)."""
    import torch

    from rlfleet.model import lora

    dtype = getattr(torch, dtype_name)

    def cast(name: str, tensor):
        if name.startswith(lora.PREFIX) or not tensor.is_floating_point():
            return tensor
        return tensor.to(dtype)

    return {name: cast(name, tensor) for name, tensor in state.items()}


def _device_type(state: dict) -> str:
    return next(iter(state.values())).device.type if state else "cpu"
