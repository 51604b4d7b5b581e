"""``trainer.weight_transport: relay``: the trainer streams each version to a few replicas,
which forward it to the others (``rlfleet.model.weights_relay``: the tree; the replica's side is
``rlfleet.rollout.weight_relay``).

Why: a streamed push sends the whole model over the trainer's link once per replica, so the
push to N replicas on other machines takes N transfers of the trainer's NIC. In a relay tree of
fanout k the trainer sends it k times, and every replica forwards what it receives as it
arrives, so the push takes about one transfer per level that the links do not overlap.

What reaches whom: the replicas of one push that get the same payload (the full weights, or
the element delta to those on its base: ``weight_delta``) form one tree, in the order the
router listed them. The roots' answers carry every replica below them (``RelayResult``). Any
replica the tree did not deliver (its parent died mid-forward, it refused a delta, it was
unreachable from its parent) is then pushed to straight from the trainer, as the gRPC
transport pushes (a refused delta followed by the full weights), and counted in
``weight/relay_fallbacks`` when it sat below a parent. A replica that did take the version
from its parent just before that parent failed refuses the straight push as not newer; its
status then shows the version and it counts as delivered. Versions only go up on every
replica, and each applies only a payload it verified whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from rlfleet.model.weights_relay import RelayTarget, relay_tree
from rlfleet.rollout.client import PreparedUpdate
from rlfleet.rollout.types import ReplicaState, ReplicaStatus
from rlfleet.trainer.weight_transport import (
    GrpcWeightTransport,
    Prepared,
    PushResult,
    WeightReceiver,
    _Encoded,
)

log = logging.getLogger(__name__)


@dataclass
class RelayedResult(PushResult):
    """A ``PushResult`` of a relay push, saying how the version came."""

    relay: str = "root"
    """``root`` (streamed by the trainer, which named its subtree), ``parent`` (forwarded by
    another replica) or ``fallback`` (pushed straight after the tree missed it)."""

    @classmethod
    def of(cls, result: PushResult, relay: str) -> RelayedResult:
        return cls(**{**dataclasses.asdict(result), "relay": relay})


class RelayReceiver(WeightReceiver, Protocol):
    """One replica's end (``RolloutClient``): it also says which version it serves."""

    async def status(self) -> ReplicaStatus: ...


class RelayWeightTransport(GrpcWeightTransport):
    """``GrpcWeightTransport`` whose pushes stream to ``fanout`` replicas per payload and let
    them forward to the rest (never through shared memory: the bytes travel between replicas).
    """

    def __init__(self, connect, prepare, chunk_bytes: int, fanout: int) -> None:
        super().__init__(connect, prepare, chunk_bytes, shared_memory=False)
        self.fanout = fanout

    async def deliver(
        self, prepared: Prepared, targets: Sequence[ReplicaStatus]
    ) -> list[PushResult]:
        """Each payload down its tree, then straight to every replica it did not reach."""
        groups: dict[int, tuple[_Encoded, list[ReplicaStatus]]] = {}
        for target in targets:
            encoded = self._delta_to(target, prepared) or prepared.encoded
            groups.setdefault(id(encoded), (encoded, []))[1].append(target)
        trees = [
            self._relay(encoded, group, encoded is not prepared.encoded)
            for encoded, group in groups.values()
        ]
        reached: dict[str, RelayedResult] = {}
        for answers in await asyncio.gather(*trees):
            reached.update(answers)
        missed = [t for t in targets if not (t.replica_id in reached and reached[t.replica_id].ok)]
        straight = await asyncio.gather(*(self._straight(t, prepared, reached) for t in missed))
        reached.update((r.replica_id, r) for r in straight)
        return [reached[t.replica_id] for t in targets]

    async def _relay(
        self, encoded: _Encoded, group: list[ReplicaStatus], delta: bool
    ) -> dict[str, RelayedResult]:
        update = await encoded.streamed()
        roots = relay_tree([(t.replica_id, t.address) for t in group], self.fanout)
        pushes = (self._root(root, encoded, update, delta) for root in roots)
        answers = await asyncio.gather(*pushes)
        return {r.replica_id: r for answer in answers for r in answer}

    async def _root(
        self, root: RelayTarget, encoded: _Encoded, update: PreparedUpdate, delta: bool
    ) -> list[RelayedResult]:
        """One root's push with its subtree in the header: its result and its subtree's."""
        started, nbytes = time.perf_counter(), encoded.header.total_bytes
        headed = update.headed(dataclasses.replace(encoded.header, relay=root.children))
        try:
            outcome = await self._client(root.address).push_prepared(headed)
        except Exception as exc:  # noqa: BLE001 - the root and its subtree are pushed straight
            error = f"{type(exc).__name__}: {exc}"
            log.info(
                "relay root %s failed (%s): pushing its subtree straight", root.replica_id, exc
            )
            return [RelayedResult(root.replica_id, False, error=error)]
        seconds = time.perf_counter() - started
        mine = (root.replica_id, True, outcome.version, seconds, nbytes, "", delta)
        results = [RelayedResult(*mine, outcome.pause_seconds)]
        for r in outcome.relayed:
            below = (r.replica_id, r.ok, r.version, seconds, nbytes if r.ok else 0, r.error)
            results.append(RelayedResult(*below, delta, r.pause_seconds, relay="parent"))
        return results

    async def _straight(
        self, target: ReplicaStatus, prepared: Prepared, reached: dict[str, RelayedResult]
    ) -> RelayedResult:
        """The trainer's own push to a replica the tree missed (or that already took it)."""
        below = target.replica_id not in reached or reached[target.replica_id].relay == "parent"
        if below:
            why = reached[target.replica_id].error if target.replica_id in reached else "no answer"
            log.info("relay missed %s (%s): pushing it straight", target.replica_id, why)
        result = await self._push_one(target, prepared.encoded, self._delta_to(target, prepared))
        if not result.ok:
            result = await self._took_it_anyway(target, prepared.version, result)
        return RelayedResult.of(result, "fallback" if below else "root")

    async def _took_it_anyway(
        self, target: ReplicaStatus, version: int, result: PushResult
    ) -> PushResult:
        """Its relay parent delivered ``version`` before failing: see ``served_anyway``."""
        return await served_anyway(self._client(target.address), version, result)


async def served_anyway(client, version: int, result: PushResult) -> PushResult:
    """``result`` as a success when the replica behind ``client`` (a ``RelayReceiver``) serves
    ``version`` now: it took the version another way (a relay parent that failed after
    forwarding, a broadcast whose answer was lost) and so refused a straight push of it as not
    newer. Unreachable, or on another version: ``result`` as it was."""
    try:
        status = await cast(RelayReceiver, client).status()
    except Exception:  # noqa: BLE001 - unreachable: the push's own error stands
        return result
    if status.weight_version != version or status.state is not ReplicaState.SERVING:
        return result
    return dataclasses.replace(result, ok=True, version=version, error="")
