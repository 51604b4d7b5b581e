"""The rollout replica process assembled: engine, replica core, gRPC server, ``/metrics``.

The gRPC server comes up first (health NOT_SERVING, state ``starting``) so the replica is
visible while its engine loads; then the engine starts, the replica registers as ``serving``
and starts pulling from its stream. With ``rollout.metrics_port`` set, Prometheus
``/metrics`` is served there (``metrics.py``). SIGTERM/SIGINT, or a router's ``DrainReplica``
once the replica's queue is empty, end it the same way: work in hand finishes, the replica
deregisters, and ``serve`` returns. An engine that fails to start or dies ends it with
``SystemExit``.

``rlfleet.rollout.main`` parses the command line and calls ``run``; the engine's backend
(torch, transformers, vLLM) is imported only when ``make_engine`` builds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Iterator

from redis.asyncio import Redis

from rlfleet.common import tls
from rlfleet.common.config import RlfleetConfig, RolloutConfig
from rlfleet.common.grpc_server import GrpcServer, install_stop_signals
from rlfleet.common.keys import Keys
from rlfleet.common.redis_client import connect
from rlfleet.rollout.engines.factory import make_engine
from rlfleet.rollout.metrics import MeteredReplica, serve_metrics
from rlfleet.rollout.replica import Replica
from rlfleet.rollout.replica_id import default_replica_id
from rlfleet.rollout.server import registration
from rlfleet.rollout.weight_relay import relay_links

log = logging.getLogger(__name__)


def run(config: RlfleetConfig) -> None:
    """Serve one replica until it is stopped or drained (or its engine fails)."""
    asyncio.run(serve(config))


async def serve(config: RlfleetConfig) -> None:
    """Build the replica and its servers, run them, and take them down in order."""
    rollout = config.rollout
    redis = connect(config.require_redis_url())
    replica_id = rollout.replica_id or default_replica_id()  # the CLI resolved it already
    replica = MeteredReplica(
        config, make_engine(config), redis, Keys(config.cluster), replica_id, ""
    )
    server = GrpcServer(
        [registration(replica, relay_links(config))],
        rollout.host,
        rollout.port,
        config.max_message_mb,
        config.api_key,
    )
    stop = asyncio.Event()
    install_stop_signals(stop)
    port = await server.start()
    await server.set_serving(False)
    replica.address = f"{advertised_host(rollout)}:{port}"
    try:
        with metrics_server(replica, rollout, config.api_key):
            await _run_until(stop, replica, server)
    finally:
        await _shutdown(replica, server, redis)


def advertised_host(rollout: RolloutConfig) -> str:
    """The host others dial: explicit setting, else our hostname when bound to every interface
    (so each ``docker compose --scale`` container registers its own name), else the bind host."""
    if rollout.advertise_host:
        return rollout.advertise_host
    if rollout.host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return rollout.host


@contextlib.contextmanager
def metrics_server(
    replica: Replica, rollout: RolloutConfig, api_key: str | None = None
) -> Iterator[None]:
    """Prometheus ``/metrics`` on ``rollout.metrics_port`` while the block runs (0 = off)."""
    if not rollout.metrics_port:
        yield
        return
    server, sampler = serve_metrics(replica, rollout.host, rollout.metrics_port, api_key)
    where = f"{tls.scheme()}://{rollout.host}:{rollout.metrics_port}/metrics"
    log.info("replica metrics at %s", where)
    try:
        yield
    finally:
        sampler.cancel()
        server.shutdown()


async def _run_until(stop: asyncio.Event, replica: Replica, server: GrpcServer) -> None:
    """Serve until a stop signal; an engine that fails to start or dies ends the process."""
    starting = asyncio.create_task(replica.start())
    await _first(starting, stop.wait())
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return
    starting.result()
    await server.set_serving(True)
    await _first(stop.wait(), replica.failed.wait(), replica.drained.wait())
    if replica.failed.is_set():
        raise SystemExit(f"replica {replica.replica_id}: the {replica.engine.name} engine died")
    log.info("%s; shutting down", "drained" if replica.drained.is_set() else "stop requested")


async def _first(*awaitables: Awaitable[object]) -> None:
    """Wait for the first to finish; cancel the helper tasks made for the other coroutines."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for awaitable, task in zip(awaitables, tasks, strict=True):
        if awaitable is not task:
            task.cancel()


async def _shutdown(replica: Replica, server: GrpcServer, redis: Redis) -> None:
    await replica.shutdown()
    await server.stop(grace_s=2.0)
    await replica.engine.close()
    await redis.aclose()


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: the replica has deregistered and closed its
    engine, server and Redis, and tearing down torch and transformers' modules alone takes
    1-2.5 s on a busy machine, so a stopping replica would linger that long for nothing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
