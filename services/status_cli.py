"""``rlfleet status``: replicas (from the router's ListReplicas) and the trainer's state.

The replica registry is the rollout role's own: status asks a router, as the trainer does. Only
when no router answers does it read the registry in Redis directly (if ``redis_url`` is set),
so a fleet whose router is down can still be inspected.
"""

from __future__ import annotations

import asyncio
import sys

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.entry import base_parser, resolve
from rlfleet.common.errors import RlfleetError
from rlfleet.rollout.types import ReplicaState, ReplicaStatus


async def router_replicas(config: RlfleetConfig) -> list[ReplicaStatus]:
    from rlfleet.rollout.client import RolloutClient

    async with RolloutClient(config.endpoints.router, api_key=config.api_key) as client:
        return await client.list_replicas(timeout_s=3.0)


async def registry_replicas(config: RlfleetConfig) -> list[ReplicaStatus]:
    """Fallback without a router: the registry as stored (no in-flight counts, no drains)."""
    from rlfleet.common.keys import Keys
    from rlfleet.common.redis_client import connect
    from rlfleet.rollout.registry import ReplicaRegistry

    client = connect(config.redis_url)
    try:
        registry = ReplicaRegistry(client, Keys(config.cluster), config.rollout.heartbeat_ttl_s)
        infos = await registry.list()
    finally:
        await client.aclose()
    return [
        ReplicaStatus(
            r.replica_id,
            r.address,
            r.weight_version,
            r.state if r.alive else ReplicaState.DEAD,
            0,
            r.backend,
            r.served,
            r.heartbeat_age_s,
        )  # fmt: skip
        for r in infos
    ]


async def replica_lines(config: RlfleetConfig) -> list[str]:
    try:
        replicas, source = await router_replicas(config), f"router {config.endpoints.router}"
    except (RlfleetError, TimeoutError) as exc:
        if not config.redis_url:
            return [f"replicas: unknown (router not reachable: {type(exc).__name__})"]
        replicas, source = await registry_replicas(config), "redis registry"
    lines = [f"replicas ({len(replicas)}, from {source}):"]
    for r in replicas:
        lines.append(
            f"  {r.replica_id:<16} {r.address:<22} v{r.weight_version:<5} {r.state:<9} "
            f"in_flight={r.in_flight} served={r.served} backend={r.backend}"
        )
    return lines


async def trainer_line(config: RlfleetConfig) -> str:
    from rlfleet.common.grpc_client import auth_metadata, make_channel
    from rlfleet.proto import common_pb2, trainer_pb2_grpc

    channel = make_channel(config.endpoints.trainer, retry=False)
    try:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        status = await stub.GetStatus(
            common_pb2.Empty(), timeout=2.0, metadata=auth_metadata(config.api_key)
        )
        return (
            f"trainer: {status.state} step {status.step}/{status.total_steps} "
            f"weights v{status.weight_version} run_dir={status.run_dir}"
        )
    except Exception as exc:  # noqa: BLE001 - status is best effort
        return f"trainer: not reachable at {config.endpoints.trainer} ({type(exc).__name__})"
    finally:
        await channel.close()


async def collect(config: RlfleetConfig) -> list[str]:
    return [*await replica_lines(config), await trainer_line(config)]


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("status", "Show replicas, weight versions and the trainer's state.")
    config, _ = resolve(parser, "status", ["log_level=WARNING", *(argv or [])])
    print("\n".join(asyncio.run(collect(config))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
