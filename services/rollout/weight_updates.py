"""The weights a replica serves: their version, whether they are intact, and how they change.

Why apart from the replica's other work: every refusal rule of an update lives here, before
anything changes. A header is checked before its bytes arrive (malformed, not newer than ours
unless ``force``, in a dtype this replica would round on load, bigger than this model can
take); the payload is verified (size, checksum, finite values, magnitude: one pass over the
bytes, ``verified``) in a worker thread while the replica still serves; then ``stage`` does
everything else that reads the bytes (a delta made whole and checked, the engine's name and
shape checks and preparation) with the old weights still serving. Only ``apply`` (the swap
and the cache flush) runs with admission closed. So a bad update leaves the old weights
serving, and the replica never stopped for it. A swap that fails midway (weights possibly
half replaced) leaves ``intact`` False, and the replica out of routing (``update_failed``),
until an update succeeds. After a swap the KV/prefix cache is flushed
(``rollout.flush_cache_on_update`` and the header's ``flush_cache``), so no answer mixes new
weights with old cache.

The order around this (verify and stage first, then stop taking work, make way for the update
as ``rollout.update_policy`` says, ``apply``, reopen) and the timing of the pause are
``update_steps.py``.

Delta updates (``weights_delta``, ``trainer.weight_delta``): with it on, the updater keeps the
full update it last loaded, plain weights or a LoRA adapter (views of that update's buffer; a
copy when they came through shared memory, whose file the trainer writes again). A delta whose
base is not the version served, or that arrives where no base is kept, is refused from its
header (FAILED_PRECONDITION); one that is accepted is assembled over the kept base (its changed
elements written into the base in place, put back if refused) and checked against the full
push's checksum before the engine sees it (all while the old weights serve: the engine holds
its own copy), and the engine is told which elements changed (``weights_delta.changes``), so
the transformers engine writes only those into its parameters in the pause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.model import lora, weights, weights_delta, weights_magnitude
from rlfleet.rollout import weight_guard
from rlfleet.rollout.engines.base import Engine, StagedWeights
from rlfleet.rollout.types import UpdateOutcome

log = logging.getLogger(__name__)


class WeightUpdater:
    """Checks and loads weight updates into one engine; holds the version it serves."""

    def __init__(
        self, config: RlfleetConfig, engine: Engine, on_new_version: Callable[[int], None]
    ) -> None:
        self.config, self.engine = config, engine
        self._on_new_version = on_new_version  # told the version just loaded (unparks jobs)
        self.version = 0
        self.intact = True  # False after a load that failed midway
        self.lock = asyncio.Lock()  # one update at a time
        self.keep_base = config.trainer.weight_delta != "never"
        self.base: dict | None = None
        """The full update last loaded (kept only with ``keep_base``), a delta's base."""

    def check(self, header: weights.WeightHeader) -> None:
        """Refuse an update before its bytes arrive: a malformed header (InvalidArgument), a
        version not newer than ours unless forced (FailedPrecondition), or a payload bigger
        than this model can take (InvalidArgument; checked before anything is allocated)."""
        weights.validate_header(header)
        if header.version <= self.version and not header.force:
            raise FailedPrecondition(
                f"weight version {header.version} is not newer than "
                f"{self.version} (set force to roll back)"
            )
        if self.config.rollout.dtype is None:  # a set rollout.dtype casts on purpose
            check_no_narrowing(header, self.config.model.dtype)
        if weights_delta.is_delta(header):
            self._check_delta(header)
        numel = self.engine.weight_numel()
        if numel and header.total_bytes > weights.max_bytes_for(numel):
            raise InvalidArgument(
                f"weight update of {header.total_bytes} bytes is larger than "
                f"this model ({numel} parameters) can take"
            )

    def _check_delta(self, header: weights.WeightHeader) -> dict:
        """The base a delta applies to; FailedPrecondition unless we keep one, it is intact, and
        it is the version the delta was made from (the trainer then pushes the full weights)."""
        if header.force:
            raise InvalidArgument("a weight delta cannot be forced (it needs its base)")
        base = weights_delta.base_version(header)
        if self.base is None or not self.intact:
            raise FailedPrecondition(
                f"weight delta on v{base} refused: this replica keeps no "
                f"base weights (trainer.weight_delta is never here, or no "
                f"full update landed yet); a full push is needed"
            )
        if base != self.version:
            raise FailedPrecondition(
                f"weight delta on v{base} refused: this replica serves "
                f"v{self.version}; a full push is needed"
            )
        return self.base

    async def stage(self, header: weights.WeightHeader, state_dict: dict) -> Staged:
        """Everything before the swap, with the old weights still serving (the replica's
        admission open): a delta made whole over the kept base and checked against the full
        push's checksum (refused, base unchanged, if it does not give the trainer's weights),
        the engine's checks and preparation (``Engine.stage_weights``), and the copy of a
        shared-memory update kept as the next base."""
        started = time.perf_counter()
        changes = None
        if weights_delta.is_delta(header):
            kept = self._check_delta(header)  # another update may have landed since
            changes = weights_delta.changes(state_dict)
            state_dict = await asyncio.to_thread(weights_delta.apply, state_dict, kept)
            self.base = None  # it now holds the new values: a base again once they load
        engine = await self.engine.stage_weights(state_dict, changes)
        try:
            base = await self._base_to_keep(header, state_dict)
        except BaseException:
            engine.discard()
            raise
        return Staged(header, engine, base, time.perf_counter() - started)

    async def apply(self, staged: Staged) -> UpdateOutcome:
        """The swap (nothing may be running: the replica's pause), then the version, then the
        cache flush."""
        started = time.perf_counter()
        intact, self.intact = self.intact, False
        try:
            await staged.engine.apply()
        except InvalidArgument:
            self.intact = intact  # engines refuse a mismatch before changing anything
            raise
        except BaseException:
            self.base = None  # half loaded: no delta may build on this
            raise
        self.base = staged.base
        old, self.version, self.intact = self.version, staged.header.version, True
        self.engine.serving_version = self.version  # vLLM's cache salt follows it
        self._on_new_version(self.version)
        flushed = False
        if staged.header.flush_cache and self.config.rollout.flush_cache_on_update:
            flushed = await self.engine.flush_cache()
        seconds = time.perf_counter() - started
        level = logging.INFO if old == 0 else logging.DEBUG  # a replica's first weights only
        log.log(
            level,
            "weights v%d -> v%d: staged in %.3f s, swapped and flushed in %.3f s "
            "(elements written: %s, cache flushed: %s)",
            old,
            self.version,
            staged.seconds,
            seconds,
            staged.engine.changed or "all",
            flushed,
        )
        return UpdateOutcome(self.version, seconds, flushed, prepare_seconds=staged.seconds)

    async def load(self, header: weights.WeightHeader, state_dict: dict) -> UpdateOutcome:
        """``stage`` then ``apply`` at once (no pause between them: tests and tools)."""
        staged = await self.stage(header, state_dict)
        try:
            return await self.apply(staged)
        finally:
            staged.engine.discard()

    async def _base_to_keep(self, header: weights.WeightHeader, state_dict: dict) -> dict | None:
        """The full update being staged (plain weights, or a whole LoRA adapter: adapter
        updates are absolute), to keep as the next delta's base once it loads. Tensors from a
        shared-memory file are copied (the trainer writes the next push into the same file),
        except under ``auto``, which sends no delta to a replica that reads the file: it
        keeps nothing."""
        auto = self.config.trainer.weight_delta == "auto"
        if not self.keep_base or (header.shared_memory and auto):
            return None
        if header.shared_memory:
            return await asyncio.to_thread(_copied, state_dict)
        return state_dict


@dataclass
class Staged:
    """An update checked and made ready while the old weights serve (``WeightUpdater.stage``);
    ``WeightUpdater.apply`` swaps it in."""

    header: weights.WeightHeader
    engine: StagedWeights
    base: dict | None
    """What to keep as the next delta's base once it loads (None: keep nothing)."""
    seconds: float
    """How long staging took."""


def _copied(state_dict: dict) -> dict:
    """Copies through numpy (torch's threaded copy crawls on a busy 2-core machine)."""
    import numpy
    import torch

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        out = weights.empty_bytes(tensor.numel() * tensor.element_size())
        numpy.copyto(out.numpy(), tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        return out.view(tensor.dtype).reshape(tensor.shape)

    return {name: copy(tensor) for name, tensor in state_dict.items()}


def check_no_narrowing(header: weights.WeightHeader, serving_dtype: str) -> None:
    """InvalidArgument when a full-weight update holds a floating tensor this replica would
    round on load (float32 pushed to a ``bfloat16`` replica, float16 to bfloat16, ...).

    Why refuse rather than cast: the engines copy pushed tensors into parameters of
    ``model.dtype``, and a narrowing copy would serve weights that differ from the actor's
    with nothing said. A bf16 actor pushes bf16 and its replicas load the same bits; widening
    (bf16 onto a float32 replica) is exact and allowed. LoRA adapter tensors are exempt: they
    are merged (``W0 + B @ A`` in float32, then the base's dtype) or handed to vLLM as an
    adapter, never copied over a parameter."""
    import torch

    target = getattr(torch, serving_dtype)
    for entry in header.tensors:
        if weights_delta.original_name(entry.name).startswith(lora.PREFIX):
            continue
        dtype = getattr(torch, entry.dtype, None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype != target:
            if torch.promote_types(dtype, target) != target:
                raise InvalidArgument(
                    f"tensor {entry.name!r} arrives in {entry.dtype}, which this replica "
                    f"(model.dtype={serving_dtype}) would round on load; give the trainer and "
                    f"the replicas the same model.dtype, or set rollout.dtype"
                )


def verified(
    header: weights.WeightHeader, payload: weights.BytesLike, max_weight_abs: float | None = None
) -> dict:
    """Tensors viewing the payload once size, checksum, finiteness and (``max_weight_abs``,
    ``weight_guard``) magnitude hold, in that order (a worker thread). Why one call: the
    checksum's pass over the bytes also reads every tensor's largest magnitude
    (``weights.decode_measured``), where a pass for each check cost 5x as much."""
    state_dict, largest = weights.decode_measured(header, payload)
    weights_magnitude.check_finite(state_dict, largest)
    weight_guard.check_magnitude(state_dict, max_weight_abs, largest)
    return state_dict
