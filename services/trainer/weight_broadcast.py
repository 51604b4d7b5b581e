"""``trainer.weight_transport: broadcast``: the trainer sends each version's bytes on a
``torch.distributed`` group it owns as rank 0, one collective over one flat buffer, while the
control (header, manifest, checksum, and each replica's answer) stays on
``Rollout.UpdateWeights`` (``rlfleet.model.weights_broadcast``: the group and its handshake;
``rlfleet.rollout.weight_broadcast``: the replica's side).

Who is a member: the targets of a push that take the full weights. A replica on the base of an
element delta (``trainer.weight_delta``) is streamed its delta, as under ``stream``: a delta is a
percent of the full push, and a group per delta's recipients would be rebuilt every push. So is
a replica sitting out (``Membership``: one that was not ready for a round, so that the round
was aborted, sits out the next ``SIT_OUT_PUSHES`` pushes), so one dead or slow replica does not
abort every round until the router forgets it.

One group per membership epoch (``needs_new_epoch``): the same members in the same order keep
the group; other members, or a group whose collective failed, get a new epoch (a fresh store on
a new port). Any member the broadcast did not deliver (it refused or was not ready, the round
was aborted, the collective failed or timed out) is pushed to over the stream in the same push
(the full weights) and counted in ``weight/broadcast_fallbacks``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlfleet.common.host_address import split_host
from rlfleet.model import weights
from rlfleet.model import weights_broadcast as wb
from rlfleet.rollout.client import PreparedUpdate
from rlfleet.rollout.types import ReplicaStatus
from rlfleet.trainer.weight_relay import served_anyway
from rlfleet.trainer.weight_transport import GrpcWeightTransport, Prepared, PushResult, _Encoded

log = logging.getLogger(__name__)

SIT_OUT_PUSHES = 3
"""Pushes a member that made a round fail is streamed to instead (then it may join again)."""

Members = tuple[tuple[str, str], ...]  # (replica id, address) in rank order


@dataclass
class BroadcastResult(PushResult):
    """A ``PushResult`` of a broadcast push, saying how the version came."""

    broadcast: str = "member"
    """``member`` (on the group), ``fallback`` (a member the group did not deliver, streamed)
    or ``stream`` (not a member of this push: a delta's recipient, or sitting out)."""

    @classmethod
    def of(cls, result: PushResult, broadcast: str) -> BroadcastResult:
        return cls(**{**dataclasses.asdict(result), "broadcast": broadcast})


class Membership:
    """Which targets of a push go on the group: those taking the full weights, except the ones
    sitting out after a failed round."""

    def __init__(self, sit_out_pushes: int = SIT_OUT_PUSHES) -> None:
        self.sit_out_pushes = sit_out_pushes
        self.sitting_out: dict[str, int] = {}
        """Replica id -> pushes it is still streamed to."""

    def members(
        self, targets: Sequence[ReplicaStatus], full: Callable[[ReplicaStatus], bool]
    ) -> list[ReplicaStatus]:
        """This push's members, in target order; a replica sitting out counts one push down."""
        chosen = []
        for target in targets:
            left = self.sitting_out.get(target.replica_id, 0)
            if left:
                self.sitting_out[target.replica_id] = left - 1
            elif full(target):
                chosen.append(target)
        self.sitting_out = {r: n for r, n in self.sitting_out.items() if n}
        return chosen

    def failed(self, replica_ids: Sequence[str]) -> None:
        """These made a round fail: stream to them for the next ``sit_out_pushes`` pushes."""
        for replica_id in replica_ids:
            self.sitting_out[replica_id] = self.sit_out_pushes


def members_of(targets: Sequence[ReplicaStatus]) -> Members:
    return tuple((t.replica_id, t.address) for t in targets)


def needs_new_epoch(current: Members | None, broken: bool, members: Members) -> bool:
    """A new group unless the current one is sound and has exactly these members, in order."""
    return current is None or broken or current != members


def to_blame(not_ready: Sequence[int], answered: Sequence[int]) -> list[int]:
    """The ranks that made a round abort: those that answered without being ready (refused,
    dead), else (the deadline passed) all that were not ready. A member still getting ready
    when another failed at once is not blamed."""
    return [r for r in not_ready if r in answered] or list(not_ready)


class HostedGroup:
    """The trainer's end of one epoch: the store (a fresh port), and the group from the
    epoch's first ``go`` on."""

    def __init__(self, members: Sequence[ReplicaStatus], epoch: int, timeout_s: float) -> None:
        self.members, self.epoch, self.timeout_s = members_of(members), epoch, timeout_s
        self.store, self.address = wb.start_store(members[0].address, timeout_s)
        self.backend = wb.default_backend()
        self.group = None
        self.broken = False
        """The collective (or opening the group) failed: the next push starts a new epoch."""

    def spec(self, round_: int, rank: int) -> wb.BroadcastGroup:
        world = len(self.members) + 1
        return wb.BroadcastGroup(
            self.address, self.epoch, round_, rank, world, self.backend, self.timeout_s
        )

    async def wait_ready(self, round_: int, calls: Sequence[asyncio.Future]) -> bool:
        """True once every member wrote ``ready``; False as soon as one answered without
        (refused, dead) or at the deadline."""
        keys = [wb.ready_key(round_, rank) for rank in range(1, len(self.members) + 1)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            if any(call.done() for call in calls) or time.monotonic() > deadline:
                return False
            await asyncio.sleep(wb.POLL_S)
        return True

    def not_ready(self, round_: int) -> list[int]:
        """The ranks that have not written ``ready`` for this round."""
        ranks = range(1, len(self.members) + 1)
        return [r for r in ranks if not self.store.check([wb.ready_key(round_, r)])]

    def stale(self, round_: int) -> bool:
        """Our group is open but a member would open it anew (it lost its end of it)."""
        keys = [wb.ready_key(round_, rank) for rank in range(1, len(self.members) + 1)]
        return self.group is not None and any(self.store.get(k) != wb.OPEN for k in keys)

    def decide(self, round_: int, go: bool) -> None:
        self.store.set(wb.go_key(round_), wb.GO if go else wb.ABORT)

    def broadcast(self, payload: memoryview) -> None:
        """The payload to every member (a worker thread); opens the group the first time."""
        import torch

        try:
            if self.group is None:
                host = split_host(self.address)
                self.group = wb.open_group(self.store, self.spec(0, 0), host)
            buffer = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else None
            if buffer is not None:
                wb.broadcast(self.group, buffer, self.backend, self.timeout_s)
        except BaseException:
            self.broken = True
            raise

    def close(self) -> None:
        wb.close_group(self.group)
        self.group = None


class _Announced:
    """A header naming the group, in the shape ``GrpcWeightTransport._deliver`` streams."""

    shared = None

    def __init__(self, header: weights.WeightHeader, prepare) -> None:
        self.header, self._prepare = header, prepare

    async def streamed(self) -> PreparedUpdate:
        return self._prepare(self.header, memoryview(b""), 1)


class BroadcastWeightTransport(GrpcWeightTransport):
    """``GrpcWeightTransport`` whose full pushes travel on the trainer's group (never through
    shared memory); deltas, and members the group did not deliver, are streamed."""

    def __init__(self, connect, prepare, chunk_bytes: int, timeout_s: float) -> None:
        super().__init__(connect, prepare, chunk_bytes, shared_memory=False)
        self.timeout_s = timeout_s
        self.membership = Membership()
        self._group: HostedGroup | None = None
        self._epochs, self._rounds = itertools.count(1), itertools.count(1)
        self._one_round = asyncio.Lock()

    async def deliver(
        self, prepared: Prepared, targets: Sequence[ReplicaStatus]
    ) -> list[PushResult]:
        """The full weights on the group to its members, the rest streamed beside them, then
        every member the group missed streamed."""
        members = self.membership.members(targets, lambda t: self._delta_to(t, prepared) is None)
        ids = {m.replica_id for m in members}
        others = [t for t in targets if t.replica_id not in ids]
        streamed = asyncio.gather(*(self._stream_to(t, prepared, "stream") for t in others))
        cast = await self._broadcast(prepared.encoded, members) if members else {}
        missed = [m for m in members if not cast[m.replica_id].ok]
        straight = await asyncio.gather(*(self._stream_to(m, prepared, "fallback") for m in missed))
        reached = {**cast, **{r.replica_id: r for r in [*await streamed, *straight]}}
        return [reached[t.replica_id] for t in targets]

    async def _stream_to(self, target: ReplicaStatus, prepared: Prepared, how: str):
        delta = self._delta_to(target, prepared) if how == "stream" else None
        result = await self._push_one(target, prepared.encoded, delta)
        if how == "fallback" and not result.ok:  # the group delivered, its answer was lost?
            result = await served_anyway(self._client(target.address), prepared.version, result)
        return BroadcastResult.of(result, how)

    async def _broadcast(
        self, encoded: _Encoded, members: list[ReplicaStatus]
    ) -> dict[str, BroadcastResult]:
        """One round on the members' group: headers over gRPC, the handshake, the collective,
        then every member's answer."""
        async with self._one_round:
            try:
                group = await self._group_for(members)
            except Exception as exc:  # noqa: BLE001 - no group (no port, no route): stream
                log.warning("no weight broadcast group (%s): streaming", exc)
                return {m.replica_id: self._no_answer(m, f"no group: {exc}") for m in members}
            round_ = next(self._rounds)
            calls = [
                asyncio.ensure_future(self._announce(m, encoded, group.spec(round_, rank)))
                for rank, m in enumerate(members, start=1)
            ]
            try:
                delivered = await self._run_round(group, round_, calls, encoded.payload)
                done, _ = await asyncio.wait(calls, timeout=None if delivered else self.timeout_s)
            finally:
                for call in calls:
                    call.cancel()
        pairs = zip(calls, members, strict=True)
        answers = [c.result() if c in done else self._no_answer(m) for c, m in pairs]
        return {r.replica_id: r for r in answers}

    async def _announce(
        self, member: ReplicaStatus, encoded: _Encoded, spec: wb.BroadcastGroup
    ) -> BroadcastResult:
        announced = _Announced(dataclasses.replace(encoded.header, broadcast=spec), self._prepare)
        return BroadcastResult.of(await self._push_one(member, announced), "member")  # type: ignore[arg-type]

    async def _run_round(
        self, group: HostedGroup, round_: int, calls: Sequence[asyncio.Future], payload: memoryview
    ) -> bool:
        """Handshake then collective; whether the bytes went out to every member."""
        ready = await group.wait_ready(round_, calls)
        stale = ready and group.stale(round_)
        group.decide(round_, ready and not stale)
        if stale:  # nobody to blame: a new epoch on the next push
            log.info("weight broadcast epoch %d: a member lost its group", group.epoch)
            group.broken = True
            return False
        if not ready:
            answered = [rank for rank, call in enumerate(calls, start=1) if call.done()]
            late = [group.members[r - 1][0] for r in to_blame(group.not_ready(round_), answered)]
            log.info("weight broadcast round %d aborted: not ready: %s", round_, ", ".join(late))
            self.membership.failed(late)  # they sit out; the others were only aborted
            return False
        try:
            await asyncio.to_thread(group.broadcast, payload)
        except Exception as exc:  # noqa: BLE001 - the members are streamed to instead
            log.warning("weight broadcast epoch %d failed: %s", group.epoch, exc)
            return False
        return True

    async def _group_for(self, members: list[ReplicaStatus]) -> HostedGroup:
        current = self._group
        if current is not None and not needs_new_epoch(
            current.members, current.broken, members_of(members)
        ):
            return current
        if current is not None:
            current.close()
        epoch = next(self._epochs)
        self._group = await asyncio.to_thread(HostedGroup, members, epoch, self.timeout_s)
        log.info("weight broadcast epoch %d: %d members", epoch, len(members))
        return self._group

    @property
    def group_members(self) -> tuple[str, ...]:
        """The replica ids of the open group, in rank order (empty when none)."""
        return tuple(r for r, _ in self._group.members) if self._group else ()

    def _no_answer(self, member: ReplicaStatus, error: str = "") -> BroadcastResult:
        error = error or f"no answer within {self.timeout_s} s of a failed broadcast round"
        return BroadcastResult(member.replica_id, False, member.weight_version, error=error)

    async def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        await super().close()
