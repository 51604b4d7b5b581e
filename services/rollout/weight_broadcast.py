"""A replica's part in a broadcast weight push (``trainer.weight_transport: broadcast``): join
the trainer's ``torch.distributed`` group the header names, take the round's handshake, and
receive the payload in one collective (``rlfleet.model.weights_broadcast`` says why and how).

What this hands back is what a streamed update hands the replica: the payload's bytes in one
buffer. Everything after that is the ordinary update path (size, checksum, finite values,
magnitude, staging, then the swap), so a damaged broadcast is refused as a damaged stream is and
changes nothing.

Failures answer UNAVAILABLE, which the trainer takes as "stream it to me instead": the round
aborted (another member was not ready), or joining, the handshake or the collective failed or
took longer than the group's ``timeout_s``. A group that failed is left (the next push names a
new epoch); an aborted round keeps it, as nothing ran on it. One round at a time: a round whose
caller gave up still holds the group until its own timeout ends it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfleet.common.errors import InvalidArgument, Unavailable
from rlfleet.common.host_address import split_host
from rlfleet.model import weights
from rlfleet.model import weights_broadcast as wb

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

log = logging.getLogger(__name__)


class RoundAborted(Exception):
    """The trainer wrote ``abort`` for this round: it streams the update instead."""


@dataclass
class _Joined:
    """The epoch this replica is a member of: the trainer's store, and the group once opened."""

    store_address: str
    epoch: int
    store: Store
    host: str
    """This replica's address on the route to the trainer (gloo binds to it)."""
    group: ProcessGroup | None = None


class BroadcastMember:
    """This replica's membership of the trainer's broadcast group, epoch by epoch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one round at a time (held in a worker thread)
        self._joined: _Joined | None = None

    async def receive(self, header: weights.WeightHeader) -> memoryview:
        """The payload of ``header`` (its ``broadcast`` set), received on the group."""
        spec = _checked(header)
        try:
            return await asyncio.to_thread(self._receive, spec, header.total_bytes)
        except Exception as exc:  # every failure: the trainer streams the update to us
            raise Unavailable(
                f"weight broadcast v{header.version} (epoch {spec.epoch}, round {spec.round}) "
                f"did not reach this replica: {type(exc).__name__}: {exc}"
            ) from exc

    def _receive(self, spec: wb.BroadcastGroup, nbytes: int) -> memoryview:
        with self._lock:
            try:
                joined = self._join(spec)
                _handshake(joined.store, spec, joined.group is not None)
                buffer = weights.empty_bytes(nbytes)
                if joined.group is None:
                    joined.group = wb.open_group(joined.store, spec, joined.host)
                wb.broadcast(joined.group, buffer, spec.backend, spec.timeout_s)
            except RoundAborted:
                raise  # nothing ran on the group: it stays
            except BaseException:
                self._leave()
                raise
            return memoryview(buffer.numpy())

    def _join(self, spec: wb.BroadcastGroup) -> _Joined:
        """The joined epoch, a new one if the header names another."""
        joined = self._joined
        if joined is not None and (joined.store_address, joined.epoch) == (spec.store, spec.epoch):
            return joined
        self._leave()
        store = wb.connect_store(spec.store, spec.timeout_s)
        host = wb.local_host_towards(split_host(spec.store))
        self._joined = _Joined(spec.store, spec.epoch, store, host)
        log.info(
            "joined weight broadcast epoch %d at %s as rank %d", spec.epoch, spec.store, spec.rank
        )
        return self._joined

    def _leave(self) -> None:
        joined, self._joined = self._joined, None
        if joined is not None:
            wb.close_group(joined.group)


def _handshake(store: Store, spec: wb.BroadcastGroup, opened: bool) -> None:
    """Say we are ready (and whether we hold the epoch's group open already, or would open
    it now), then wait for the trainer's word (RoundAborted on ``abort``)."""
    store.set(wb.ready_key(spec.round, spec.rank), wb.OPEN if opened else wb.JOINING)
    go = wb.go_key(spec.round)
    store.wait([go], datetime.timedelta(seconds=spec.timeout_s))
    if store.get(go) != wb.GO:
        raise RoundAborted("the trainer aborted this round (a member was not ready)")


def _checked(header: weights.WeightHeader) -> wb.BroadcastGroup:
    """The header's group, if this replica can be its member (InvalidArgument otherwise)."""
    spec = header.broadcast
    assert spec is not None
    if not 0 < spec.rank < spec.world_size or spec.timeout_s <= 0:
        raise InvalidArgument(f"bad broadcast group: rank {spec.rank} of {spec.world_size}")
    if spec.backend not in ("gloo", "nccl"):
        raise InvalidArgument(f"unknown broadcast backend {spec.backend!r}")
    if spec.backend == "nccl" and wb.default_backend() != "nccl":
        raise Unavailable("a weight broadcast over nccl needs CUDA on this replica")
    return spec
