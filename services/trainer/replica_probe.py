"""The parity probe's reach into the fleet over gRPC (``weight_check.ReplicaProbe``).

The router lists the replicas (with their addresses) and drains one; each replica scores
the probe itself (``Rollout.ScoreTokens``): scoring is a question to one replica, never a
routed request. One client per replica address, kept for the run.
"""

from __future__ import annotations

import time

from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import ReplicaStatus, ScoreRequest, TokenScores


class GrpcReplicaProbe:
    def __init__(self, router_address: str, api_key: str | None, max_message_mb: int) -> None:
        self._key, self._mb = api_key, max_message_mb
        self._router = RolloutClient(router_address, api_key=api_key, max_message_mb=max_message_mb)
        self._replicas: dict[str, RolloutClient] = {}

    async def list_replicas(self) -> list[ReplicaStatus]:
        return await self._router.list_replicas()

    async def score_tokens(self, replica: ReplicaStatus, request: ScoreRequest) -> TokenScores:
        client = self._replicas.get(replica.address)
        if client is None:
            client = RolloutClient(replica.address, api_key=self._key, max_message_mb=self._mb)
            self._replicas[replica.address] = client
        started = time.perf_counter()
        scores = await client.score_tokens(request)
        scores.seconds = time.perf_counter() - started
        return scores

    async def drain_replica(self, replica_id: str) -> None:
        await self._router.drain_replica(replica_id)

    async def close(self) -> None:
        for client in (self._router, *self._replicas.values()):
            await client.close()
        self._replicas = {}
