"""How one version of the actor's weights reaches the replicas: the ``WeightTransport`` seam
and its gRPC implementation.

``GrpcWeightTransport`` encodes the weights once and streams them over
``Rollout.UpdateWeights`` to every target in parallel, or, for replicas on the trainer's
machine, sends only the header and lets them read one shared-memory payload. Each push answers
one ``PushResult`` per target: the version the replica reports serving after it (its reply).

With ``trainer.weight_delta`` (``grpc_weight_sync(delta=...)``), a replica serving the version
of the previous push gets only the elements that changed since (``weights_delta``, planned by
``weights_delta_plan``), streamed: with ``always`` whatever its size, with ``auto`` when it is
at most ``AUTO_DELTA_FRACTION`` of the full push and only to replicas the bytes are streamed to
(one reading the shared-memory file takes the full push faster: docs/weight_delta.md). A
replica that refuses the delta (FAILED_PRECONDITION: another base; INVALID_ARGUMENT: damaged)
gets the full push at once, in the same push."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from rlfleet.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rlfleet.common.host_address import on_this_host
from rlfleet.model import weights, weights_delta_plan, weights_shm
from rlfleet.rollout.types import ReplicaState, ReplicaStatus, UpdateOutcome

if TYPE_CHECKING:
    import torch

    from rlfleet.rollout.client import PreparedUpdate

log = logging.getLogger(__name__)

StateDict = Mapping[str, "torch.Tensor"]  # parameter name -> tensor


@dataclass
class PushResult:
    """What one replica made of one push."""

    replica_id: str
    ok: bool
    version: int = 0  # the version the replica reports serving after the push (its reply)
    seconds: float = 0.0
    bytes: int = 0
    error: str = ""
    delta: bool = False  # the replica took a delta (only the changed elements)
    pause_s: float = 0.0  # how long the replica's admission was closed for it (its reply)


class WeightTransport(Protocol):
    """Delivers one version of the weights to replicas; one result per target, in order.
    ``prepare`` encodes a version once (after it returns the state dict may change: the
    encoding is the copy), ``deliver`` sends it (as often as retries need) and ``release``
    frees it; ``push`` is the three in one."""

    async def prepare(
        self,
        state_dict: StateDict,
        version: int,
        flush_cache: bool,
        force: bool = False,
        targets: Sequence[ReplicaStatus] | None = None,
    ) -> Prepared: ...

    async def deliver(
        self, prepared: Prepared, targets: Sequence[ReplicaStatus]
    ) -> list[PushResult]: ...

    def release(self, prepared: Prepared, reusable: bool) -> None: ...

    async def push(
        self,
        state_dict: StateDict,
        version: int,
        flush_cache: bool,
        targets: Sequence[ReplicaStatus],
        force: bool = False,
    ) -> list[PushResult]: ...

    async def close(self) -> None: ...


DeltaMode = str  # "never" | "auto" | "always" (``trainer.weight_delta``)
AUTO_DELTA_FRACTION = 0.25
"""``auto`` sends a delta only when it is at most this fraction of the full push (measured on
SmolLM2: docs/weight_delta.md)."""


class WeightReceiver(Protocol):
    """One replica's end of the gRPC transport (``RolloutClient``)."""

    async def push_prepared(self, update: PreparedUpdate) -> UpdateOutcome: ...

    async def close(self) -> None: ...


Prepare = Callable[[weights.WeightHeader, weights.BytesLike, int], "PreparedUpdate"]


class GrpcWeightTransport:
    """Encode and serialize once, stream to every target in parallel over
    ``Rollout.UpdateWeights``: one copy of the weights, one checksum, however many replicas.

    With ``shared_memory`` the payload is encoded into one ``/dev/shm`` file instead and each
    replica on this host gets only a header naming it (``weights_shm``). One at an address of
    another host (``_streams``), or one that answered NOT_FOUND, gets the bytes streamed.

    The file of a push every target took is written again by the next push of the same size
    (a fresh file's pages are faulted in as first written: on SmolLM2, 257 MiB in bf16, 0.73 s
    against 0.1 s into warm pages). Safe: a replica reads it only until it answers, and
    overlapping pushes never share a file; a push with a failed target removes its file."""

    def __init__(
        self,
        connect: Callable[[str], WeightReceiver],
        prepare: Prepare,
        chunk_bytes: int,
        shared_memory: bool = False,
    ) -> None:
        self._connect, self._prepare = connect, prepare
        self._clients: dict[str, WeightReceiver] = {}
        self._chunk_bytes = chunk_bytes
        self._shared_memory = shared_memory and weights_shm.available()
        if self._shared_memory:  # files of trainers that died mid-push, once per trainer
            weights_shm.remove_orphans()
        self._streamed: set[str] = set()
        """Addresses that cannot read our shared memory: they get the bytes."""
        self._spare: weights_shm.SharedPayload | None = None
        """The file of the last push every target took, to be written again."""
        self._spare_lock = threading.Lock()  # encodes run in worker threads
        self.delta: DeltaMode = "never"
        self._planner = weights_delta_plan.DeltaPlanner()  # keeps the last push's bytes

    async def push(
        self,
        state_dict: StateDict,
        version: int,
        flush_cache: bool,
        targets: Sequence[ReplicaStatus],
        force: bool = False,
    ) -> list[PushResult]:
        prepared = await self.prepare(state_dict, version, flush_cache, force, targets)
        results: list[PushResult] = []
        try:
            results = await self.deliver(prepared, targets)
            return results
        finally:
            self.release(prepared, reusable=bool(results) and all(r.ok for r in results))

    async def prepare(
        self,
        state_dict: StateDict,
        version: int,
        flush_cache: bool,
        force: bool = False,
        targets: Sequence[ReplicaStatus] | None = None,
    ) -> Prepared:
        """Encode once (into shared memory unless every target, or every replica met so
        far when ``targets`` is None, needs the bytes streamed) and plan the delta (in
        ``auto``, only when some target is streamed to)."""
        addresses = [t.address for t in targets] if targets is not None else list(self._clients)
        streamed = [self._streams(a) for a in addresses]
        shared = self._shared_memory and not (streamed and all(streamed))
        encoded = await asyncio.to_thread(
            self._encode, state_dict, version, flush_cache, force, shared
        )
        streams = any(streamed) or not shared
        try:
            plan = self._plan_delta
            delta = await asyncio.to_thread(plan, state_dict, encoded, version, force, streams)
        except BaseException:
            self._release(encoded, reusable=False)
            raise
        return Prepared(encoded, delta)

    async def deliver(
        self, prepared: Prepared, targets: Sequence[ReplicaStatus]
    ) -> list[PushResult]:
        """The prepared version to every target at once (the delta to those on its base;
        in ``auto`` not to those that read the shared-memory file)."""
        pushes = [self._push_one(t, prepared.encoded, self._delta_to(t, prepared)) for t in targets]
        return list(await asyncio.gather(*pushes))

    def _delta_to(self, target: ReplicaStatus, prepared: Prepared) -> _Encoded | None:
        by_reference = prepared.encoded.shared is not None and not self._streams(target.address)
        return None if by_reference and self.delta == "auto" else _delta_for(target, prepared.delta)

    def release(self, prepared: Prepared, reusable: bool) -> None:
        """Keep the shared file for the next push if every target took it, else remove it."""
        self._release(prepared.encoded, reusable)

    def _plan_delta(
        self, state_dict: StateDict, encoded: _Encoded, version: int, force: bool, streams=True
    ) -> _Delta | None:
        """The element delta on the previous push's version (its ``encoded`` None when
        ``auto`` finds it too big; ``always`` sends it whatever its size); records this push
        as the next base. None, keeping no base, in ``auto`` when no target is ``streams``."""
        if self.delta == "never" or not state_dict or (self.delta == "auto" and not streams):
            self._planner.forget()
            return None
        full = encoded.header
        plan = self._planner.plan(full, encoded.payload, force, private=encoded.shared is None)
        if plan is None:
            return None
        if self.delta == "auto" and plan.ratio > AUTO_DELTA_FRACTION:
            return _Delta(plan.base, None, plan.ratio)
        header, payload = weights.encode(plan.state, version, full.flush_cache)
        sent = _Encoded(header, payload, self._prepare, self._chunk_bytes)
        return _Delta(plan.base, sent, plan.ratio)

    def _encode(
        self, state_dict: StateDict, version: int, flush_cache: bool, force: bool, shared: bool
    ) -> _Encoded:
        holder: list[weights_shm.SharedPayload] = []

        def allocate(nbytes: int) -> torch.Tensor:
            try:
                holder.append(self._take_spare(nbytes) or weights_shm.SharedPayload(nbytes))
            except OSError as exc:  # no room in /dev/shm: stream this push
                log.warning(
                    "no shared memory for %d bytes of weights (%s): streaming them", nbytes, exc
                )
                return weights.empty_bytes(nbytes)
            return holder[0].tensor()

        try:
            header, payload = weights.encode(
                state_dict, version, flush_cache, force, allocate if shared else None
            )
        except BaseException:
            for unused in holder:  # never handed to a replica
                unused.close()
            raise
        for file in holder:  # written: its bytes live in the file, not in the trainer
            file.drop_pages()
        return _Encoded(header, payload, self._prepare, self._chunk_bytes, *holder[:1])

    def _take_spare(self, nbytes: int) -> weights_shm.SharedPayload | None:
        """The kept file when it has the size wanted (it is then this push's alone)."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.nbytes != nbytes:
            spare.close()
            return None
        return spare

    def _release(self, encoded: _Encoded, reusable: bool) -> None:
        """Keep this push's file for the next one if every target took it (unmapped: in
        /dev/shm, not in the trainer's resident memory), else remove it."""
        if (file := encoded.shared) is None:
            return
        if reusable:
            file.unmap()
            with self._spare_lock:
                file, self._spare = self._spare, file  # an overlapping push's file goes
        if file is not None:
            file.close()

    async def _push_one(
        self, target: ReplicaStatus, encoded: _Encoded, delta: _Encoded | None = None
    ) -> PushResult:
        started = time.perf_counter()
        try:
            outcome, sent = await self._deliver_delta_or_full(target, encoded, delta)
        except Exception as exc:  # noqa: BLE001 - one bad replica must not stop training
            error = f"{type(exc).__name__}: {exc}"
            seconds = time.perf_counter() - started
            return PushResult(target.replica_id, False, target.weight_version, seconds, 0, error)
        seconds, nbytes = time.perf_counter() - started, sent.header.total_bytes
        ok = (target.replica_id, True, outcome.version, seconds, nbytes)
        return PushResult(*ok, delta=sent is delta, pause_s=outcome.pause_seconds)

    async def _deliver_delta_or_full(
        self, target: ReplicaStatus, encoded: _Encoded, delta: _Encoded | None
    ) -> tuple[UpdateOutcome, _Encoded]:
        """The delta (streamed) when there is one; the full push if there is none or the
        replica refuses it as not applying to what it holds."""
        if delta is not None:
            try:
                return await self._client(target.address).push_prepared(
                    await delta.streamed()
                ), delta
            except (FailedPrecondition, InvalidArgument) as exc:
                log.info(
                    "replica %s refused a weight delta (%s): pushing the full weights",
                    target.replica_id,
                    exc,
                )
        return await self._deliver(target, encoded), encoded

    async def _deliver(self, target: ReplicaStatus, encoded: _Encoded) -> UpdateOutcome:
        """By reference where the replica may see the file, else (or on NOT_FOUND) streamed."""
        client = self._client(target.address)
        if encoded.shared is not None and not self._streams(target.address):
            try:
                return await client.push_prepared(encoded.by_reference())
            except NotFound as exc:
                log.info(
                    "replica %s cannot read shared memory (%s): streaming to it",
                    target.replica_id,
                    exc,
                )
                self._streamed.add(target.address)
        return await client.push_prepared(await encoded.streamed())

    def _streams(self, address: str) -> bool:
        """It answered NOT_FOUND, or no interface of our network namespace holds its address
        (another machine, container or namespace, even one sharing /dev/shm: host_address)."""
        if address not in self._streamed and on_this_host(address) is False:
            log.info("replica at %s is not on this host: streaming weights to it", address)
            self._streamed.add(address)
        return address in self._streamed

    def _client(self, address: str) -> WeightReceiver:
        if address not in self._clients:
            self._clients[address] = self._connect(address)
        return self._clients[address]

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()


@dataclass
class _Delta:
    base: int
    """The version the delta applies to: only replicas serving it get the delta."""
    encoded: _Encoded | None
    """None when the delta was measured but is not worth sending."""
    ratio: float
    """Its bytes over the full push's (``weight/delta_ratio``)."""


@dataclass
class Prepared:
    """One version encoded for delivery: the full payload and, where planned, the delta."""

    encoded: _Encoded
    delta: _Delta | None

    @property
    def version(self) -> int:
        return self.encoded.header.version

    @property
    def delta_ratio(self) -> float | None:
        """Element delta bytes over full bytes, when a delta was measured for this version."""
        return self.delta.ratio if self.delta is not None else None


def _delta_for(target: ReplicaStatus, delta: _Delta | None) -> _Encoded | None:
    """The delta for a serving replica on its base version, else None (the full push)."""
    if delta is None or target.state is not ReplicaState.SERVING:
        return None
    return delta.encoded if target.weight_version == delta.base else None


class _Encoded:
    """One push's encoded weights: the header-only message for shared memory, and the
    streamed messages, serialized once (off the event loop) when a replica asks for them."""

    def __init__(
        self,
        header: weights.WeightHeader,
        payload: memoryview,
        prepare: Prepare,
        chunk_bytes: int,
        shared: weights_shm.SharedPayload | None = None,
    ) -> None:
        self.header, self.shared, self.payload = header, shared, payload
        self._payload, self._prepare, self._chunk_bytes = payload, prepare, chunk_bytes
        self._streamed: asyncio.Future | None = None
        self._by_reference: PreparedUpdate | None = None

    def by_reference(self) -> PreparedUpdate:
        """The header alone, naming the shared payload file."""
        if self._by_reference is None:
            assert self.shared is not None
            named = replace(self.header, shared_memory=self.shared.name)
            self._by_reference = self._prepare(named, memoryview(b""), self._chunk_bytes)
        return self._by_reference

    async def streamed(self) -> PreparedUpdate:
        """Header and data chunks (serialized at most once per push, whoever asks first)."""
        if self._streamed is None:
            self._streamed = asyncio.ensure_future(
                asyncio.to_thread(self._prepare, self.header, self._payload, self._chunk_bytes)
            )
        return await self._streamed
