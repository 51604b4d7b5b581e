"""Asking the fleet how it is: the router's replica list (the registry in Redis when no router
answers), each role's gRPC health, the trainer's state, queue depths, and replicas'
prefix-cache hit rates from their Prometheus ``/metrics``.

Why every probe has its own deadline and catches its own failure: the dashboard must keep
drawing while roles die and come back. A probe that fails makes its part of the state say
"down" (with what was seen), never the page fail. Channels stay open between probes; gRPC
reconnects them by itself when a role restarts (the same address: ``rlfleet up`` keeps ports).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.common import tls
from rlfleet.common.config import RlfleetConfig
from rlfleet.common.grpc_client import auth_metadata, make_channel
from rlfleet.common.keys import Keys
from rlfleet.rollout.types import ReplicaState, ReplicaStatus

DOWN_STATES = {ReplicaState.DEAD, ReplicaState.UPDATE_FAILED, ReplicaState.UNKNOWN}
"""Replica states the page shows as down (a starting, paused or updating one is not)."""

PREFIX_QUERIED = "rlfleet_rollout_prefix_cache_queried_tokens"
PREFIX_HIT = "rlfleet_rollout_prefix_cache_hit_tokens"


@dataclass
class RoleHealth:
    name: str
    address: str
    up: bool
    seen: str
    """What the health check answered (``SERVING``, or the error), shown on the page."""


@dataclass
class ReplicaRow:
    replica_id: str
    address: str
    state: str
    weight_version: int
    in_flight: int
    served: int
    backend: str
    heartbeat_age_s: float
    up: bool
    prefix_cache_hit_rate: float | None = None
    queue: dict[str, int] = field(default_factory=dict)


class FleetProbe:
    """One object per dashboard process; ``await probe.fleet()`` is one look at the fleet."""

    def __init__(self, config: RlfleetConfig, metrics_urls: dict[str, str] | None = None) -> None:
        self.config = config
        self.timeout_s = config.dashboard.probe_timeout_s
        self.keys = Keys(config.cluster)
        self.metrics_urls = metrics_urls or {}
        """Replica id -> its ``/metrics`` URL (from ``endpoints.json``), for prefix-cache hits."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retired: list[grpc.aio.Channel] = []
        self._redis = None

    # ---- the whole look ----------------------------------------------------------------

    async def fleet(self) -> dict[str, Any]:
        await self._close_retired()
        replicas, source = await self.replicas()
        roles, trainer, queues = await asyncio.gather(
            self.roles(), self.trainer(), self.queues([r.replica_id for r in replicas])
        )
        await self._replica_details(replicas, queues)
        return {
            "replicas": [asdict(r) for r in replicas],
            "replica_source": source,
            "roles": [asdict(r) for r in roles],
            "trainer": trainer,
            "queues": {k: v for k, v in queues.items() if not k.startswith("rollout:")},
        }

    # ---- replicas ----------------------------------------------------------------------

    async def replicas(self) -> tuple[list[ReplicaRow], str]:
        """The router's view (with in-flight counts); the registry's when no router answers."""
        try:
            statuses = await self._router_replicas()
            source = f"router {self.config.endpoints.router}"
        except Exception as exc:  # noqa: BLE001 - any failure: try the registry
            self._retire(self.config.endpoints.router)
            try:
                statuses = await self._registry_replicas()
            except Exception as exc2:  # noqa: BLE001 - nothing answered: say so
                return [], f"unknown (router: {_what(exc)}; redis: {_what(exc2)})"
            source = f"redis registry (router: {_what(exc)})"
        return [_row(s) for s in statuses], source

    async def _router_replicas(self) -> list[ReplicaStatus]:
        from rlfleet.proto import common_pb2, rollout_pb2_grpc
        from rlfleet.rollout import convert

        stub = rollout_pb2_grpc.RouterStub(self._channel(self.config.endpoints.router))
        reply = await stub.ListReplicas(
            common_pb2.Empty(), timeout=self.timeout_s, metadata=auth_metadata(self.config.api_key)
        )
        return [convert.status_from_proto(r) for r in reply.replicas]

    async def _registry_replicas(self) -> list[ReplicaStatus]:
        from rlfleet.rollout.registry import ReplicaRegistry

        redis = self._redis_client()
        registry = ReplicaRegistry(redis, self.keys, self.config.rollout.heartbeat_ttl_s)
        snap = await asyncio.wait_for(registry.snapshot(), self.timeout_s)
        return [
            ReplicaStatus(
                r.replica_id,
                r.address,
                r.weight_version,
                r.state if r.alive else ReplicaState.DEAD,
                snap.inflight.get(r.replica_id, 0),
                r.backend,
                r.served,
                r.heartbeat_age_s,
            )
            for r in snap.replicas
            if r.heartbeat_at
        ]

    async def _replica_details(self, rows: list[ReplicaRow], queues: dict) -> None:
        """Per replica: its own health check (a killed process is down at once, before its
        heartbeat expires), its queue, its prefix-cache hit rate."""

        async def detail(row: ReplicaRow) -> None:
            row.queue = queues.get(f"rollout:{row.replica_id}", {})
            if row.up and row.address:
                health = await self.health(row.replica_id, row.address)
                if not health.up:
                    row.up, row.state = False, f"{row.state} (no answer: {health.seen})"
            if row.replica_id in self.metrics_urls:
                row.prefix_cache_hit_rate = await self.prefix_hit_rate(
                    self.metrics_urls[row.replica_id]
                )

        await asyncio.gather(*(detail(r) for r in rows))

    async def prefix_hit_rate(self, url: str) -> float | None:
        """Hit tokens / queried tokens from a replica's ``/metrics``; None when the engine
        keeps no prefix cache (hf), nothing was queried yet, or the scrape failed."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        try:
            verify = tls.client_ssl_context() or True  # the replicas' TLS, as for gRPC
            async with httpx.AsyncClient(timeout=self.timeout_s, verify=verify) as client:
                key = self.config.api_key  # replicas' /metrics need it when one is set
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                text = (await client.get(url, headers=headers)).text
        except httpx.HTTPError:
            return None
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.removesuffix("_total") in (PREFIX_QUERIED, PREFIX_HIT):
                    name = sample.name.removesuffix("_total")
                    totals[name] = totals.get(name, 0.0) + sample.value
        queried = totals.get(PREFIX_QUERIED, 0.0)
        return totals.get(PREFIX_HIT, 0.0) / queried if queried else None

    # ---- roles -------------------------------------------------------------------------

    def role_addresses(self) -> dict[str, str]:
        """The roles this config runs, by name: router, reward, refcritic, env, trainer."""
        cfg = self.config
        roles = {"router": cfg.endpoints.router, "reward": cfg.endpoints.reward}
        if cfg.needs_refcritic:
            roles["refcritic"] = cfg.endpoints.refcritic
        if cfg.agent.env:
            roles["env"] = cfg.agent.address
        roles["trainer"] = cfg.endpoints.trainer
        return roles

    async def roles(self) -> list[RoleHealth]:
        return list(
            await asyncio.gather(
                *(self.health(name, address) for name, address in self.role_addresses().items())
            )
        )

    async def health(self, name: str, address: str) -> RoleHealth:
        stub = health_pb2_grpc.HealthStub(self._channel(address))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a probe never fails the page
            self._retire(address)
            return RoleHealth(name, address, False, _what(exc))
        seen = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return RoleHealth(
            name, address, reply.status == health_pb2.HealthCheckResponse.SERVING, seen
        )

    async def trainer(self) -> dict[str, Any]:
        from rlfleet.proto import common_pb2, trainer_pb2_grpc

        stub = trainer_pb2_grpc.TrainerStub(self._channel(self.config.endpoints.trainer))
        try:
            status = await stub.GetStatus(
                common_pb2.Empty(),
                timeout=self.timeout_s,
                metadata=auth_metadata(self.config.api_key),
            )
        except Exception as exc:  # noqa: BLE001 - a trainer that is gone or not yet up
            self._retire(self.config.endpoints.trainer)
            return {"up": False, "seen": _what(exc)}
        return {
            "up": True,
            "state": status.state,
            "step": status.step,
            "total_steps": status.total_steps,
            "weight_version": status.weight_version,
        }

    # ---- queues ------------------------------------------------------------------------

    def streams(self, replica_ids: list[str]) -> dict[str, str]:
        """Queue name on the page -> its Redis stream."""
        k = self.keys
        streams = {"reward": k.reward_stream}
        if self.config.needs_refcritic:
            streams |= {"refcritic": k.refcritic_stream, "values": k.refcritic_values_stream}
        if self.config.agent.env:
            streams["env"] = k.env_stream
        return streams | {f"rollout:{r}": k.rollout_stream(r) for r in replica_ids}

    async def queues(self, replica_ids: list[str]) -> dict[str, dict[str, int]]:
        """Per stream: ``waiting`` (not yet read by any worker) and ``pending`` (read, not yet
        answered). ``{"error": 1}`` entries mean Redis did not answer."""
        streams = self.streams(replica_ids)
        try:
            depths = await asyncio.wait_for(self._depths(list(streams.values())), self.timeout_s)
        except Exception:  # noqa: BLE001 - Redis away: the queues are unknown, not empty
            return {name: {"error": 1} for name in streams}
        return dict(zip(streams, depths, strict=True))

    async def _depths(self, streams: list[str]) -> list[dict[str, int]]:
        redis = self._redis_client()
        async with redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xinfo_groups(stream)
            replies = await pipe.execute(raise_on_error=False)
        return [_depth(reply) for reply in replies]

    # ---- plumbing ----------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = make_channel(address, self.config.max_message_mb, retry=False)
        return self._channels[address]

    def _retire(self, address: str) -> None:
        """A call to ``address`` failed: the next probe opens a new channel. Why: a channel
        whose server was not up keeps doubling its reconnect backoff (1 s, 1.6 s ... up to
        2 min) and fails every call at once meanwhile, so a trainer that came up after a
        minute of model loading was drawn down for tens of seconds more while it trained.
        A new channel connects at the first call. The old one is closed at the next look,
        once calls of this look that share it are done."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            self._retired.append(channel)

    async def _close_retired(self) -> None:
        retired, self._retired = self._retired, []
        for channel in retired:
            await channel.close()

    def _redis_client(self):
        if self._redis is None:
            if not self.config.redis_url:
                raise RuntimeError("no redis_url")
            from rlfleet.common.redis_client import connect

            self._redis = connect(self.config.redis_url, max_connections=4, budget_s=self.timeout_s)
        return self._redis

    async def close(self) -> None:
        await self._close_retired()
        for channel in self._channels.values():
            await channel.close()
        if self._redis is not None:
            await self._redis.aclose()


def _row(status: ReplicaStatus) -> ReplicaRow:
    state = ReplicaState.parse(str(status.state))
    return ReplicaRow(
        replica_id=status.replica_id,
        address=status.address,
        state=str(state),
        weight_version=status.weight_version,
        in_flight=status.in_flight,
        served=status.served,
        backend=status.backend,
        heartbeat_age_s=round(status.heartbeat_age_s, 1),
        up=state not in DOWN_STATES,
    )


def _depth(groups) -> dict[str, int]:
    """A stream's ``XINFO GROUPS`` reply as waiting + pending (a stream not made yet: 0, 0)."""
    if isinstance(groups, Exception):
        return (
            {"waiting": 0, "pending": 0} if "no such key" in str(groups).lower() else {"error": 1}
        )
    waiting = pending = 0
    for group in groups or []:
        pending += int(group.get("pending") or 0)
        waiting += int(group.get("lag") or 0)
    return {"waiting": waiting, "pending": pending}


def _what(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    return type(exc).__name__
