"""``rlfleet status``: replicas (from Redis) and the trainer's state (over gRPC)."""

from __future__ import annotations

import asyncio
import sys

from rlfleet.common.entry import base_parser, resolve


async def replica_lines(config) -> list[str]:
    from rlfleet.common.keys import Keys
    from rlfleet.common.redis_client import connect
    from rlfleet.rollout.registry import ReplicaRegistry

    client = connect(config.redis_url)
    try:
        registry = ReplicaRegistry(client, Keys(config.cluster), config.rollout.heartbeat_ttl_s)
        replicas = await registry.list()
    finally:
        await client.aclose()
    lines = [f"replicas ({len(replicas)}):"]
    for r in replicas:
        alive = "alive" if r.alive else "DEAD"
        lines.append(
            f"  {r.replica_id:<16} {r.address:<22} v{r.weight_version:<5} {r.state:<9} "
            f"{alive:<5} served={r.served} backend={r.backend}"
        )
    return lines


async def trainer_line(config) -> str:
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


async def collect(config) -> list[str]:
    lines = []
    if config.redis_url:
        lines += await replica_lines(config)
    else:
        lines.append("replicas: unknown (set RLFLEET_REDIS_URL or redis_url=...)")
    lines.append(await trainer_line(config))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("status", "Show replicas, weight versions and the trainer's state.")
    config, _ = resolve(parser, "status", ["log_level=WARNING", *(argv or [])])
    print("\n".join(asyncio.run(collect(config))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
