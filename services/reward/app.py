"""The reward process assembled: front doors (gRPC, optional HTTP), workers, their Redis.

``rlfleet.reward.main`` parses the command line and calls ``run``; everything here is what one
reward process starts and stops. The front door and this process's workers share
``WorkerSlots``: a request arriving while one of them is idle is scored in-process
(``reward.local_first``; see ``rlfleet.reward.service``). ``Options.worker_only`` runs just
workers against the same Redis stream, so scoring scales out by starting more processes; the
front door does not need to know about them.

Standalone: with no ``redis_url`` (nor ``RLFLEET_REDIS_URL``) it starts an embedded Redis under
``run_dir/redis`` and stops it on exit. The addresses it bound (gRPC, HTTP, ``/metrics``,
Redis) are printed and merged into ``run_dir/endpoints.json``. With ``reward.sandbox`` the
user function runs in sandboxed processes (``sandbox_pool``), one pool per process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from rlfleet.common import tls
from rlfleet.common.config import RewardConfig, RlfleetConfig
from rlfleet.common.endpoints import describe, write_endpoints
from rlfleet.common.entry import safe_url
from rlfleet.common.grpc_server import GrpcServer, install_stop_signals
from rlfleet.common.keys import Keys
from rlfleet.common.queue.local_first import WorkerSlots
from rlfleet.common.queue.workers import JobWorkerPool, consumer_name
from rlfleet.common.redis_client import connect
from rlfleet.common.redis_server import standalone_redis
from rlfleet.reward.batch_scorer import USER_THREADS, ScoringLanes
from rlfleet.reward.sandbox_pool import close_scorer, sandboxed_user_scorer
from rlfleet.reward.scorers import Scorer, ScorerRegistry, build_registry
from rlfleet.reward.server import registration
from rlfleet.reward.service import REDIS_CONCURRENCY, RewardService, reward_queue
from rlfleet.reward.worker import READ_COUNT, RewardWorker

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

GRPC_GRACE_S = 5.0
WORKER_STOP_S = 5.0


@dataclass(frozen=True)
class Options:
    """What the command line adds to the config (``rlfleet reward --help``)."""

    worker_only: bool
    item_timeout_s: float
    """Longest a user scoring function may run on one item."""
    reclaim_idle_s: float
    """A job pending this long on another worker is taken over (that worker died)."""


def run(config: RlfleetConfig, options: Options) -> bool:
    """Serve until SIGTERM/SIGINT; False if a worker crashed."""
    with standalone_redis(config, "reward"):
        return asyncio.run(serve(config, options))


async def serve(config: RlfleetConfig, options: Options) -> bool:
    """Run until SIGTERM/SIGINT (or a worker crash); False if a worker crashed.

    The front doors stop first, so in-flight calls can still be answered by the workers.
    """
    stop = asyncio.Event()
    install_stop_signals(stop)
    keys = Keys(config.cluster)
    user = await start_sandboxed_user(config.reward)
    registry = build_registry(config.reward, user)
    slots, lanes = WorkerSlots(worker_count(config.reward)), ScoringLanes()
    worker_redis = redis_client(config.require_redis_url(), slots.count * (READ_COUNT + 3))
    pool = start_workers(worker_redis, keys, registry, options, (slots, lanes), stop.set)
    local = slots if slots.count > 0 else None
    front = (
        None
        if options.worker_only
        else await start_front_doors(config, keys, registry, (local, lanes), options)
    )
    if front is not None:
        announce(config, front)
    await stop.wait()
    log.info("stopping reward %s", "workers" if front is None else "service")
    if front is not None:
        await front.stop()
    await pool.stop()
    await worker_redis.aclose()
    await close_scorer(user)
    return not pool.crashed


async def start_sandboxed_user(rc: RewardConfig) -> Scorer | None:
    """The user function's sandboxed pool (``reward.sandbox``); None: none, or threads."""
    if rc.custom is None or not rc.sandbox:
        return None
    return await sandboxed_user_scorer(rc.custom, rc.sandbox_limits)


def worker_count(rc: RewardConfig) -> int:
    """Workers (and slots) of this process: ``reward.workers``, but never fewer than the
    lanes slow items run on (sandboxed children, or threads), so one job holding a hung item
    never holds the only worker while a child or thread is free. 0 stays 0 (no workers)."""
    if rc.workers <= 0:
        return 0
    lanes = rc.sandbox_limits.workers if rc.sandbox or rc.custom is None else USER_THREADS
    return max(rc.workers, lanes)


def announce(config: RlfleetConfig, front: FrontDoors) -> None:
    """Print the bound addresses and merge them into ``run_dir/endpoints.json``."""
    host = config.reward.host
    addresses = {"grpc": f"{host}:{front.grpc_server.port}", "redis": safe_url(config.redis_url)}
    if front.http is not None:
        http = f"{tls.scheme()}://{host}:{front.http.port}"
        addresses |= {"http": http, "metrics": f"{http}/metrics"}
    try:
        where = str(write_endpoints(config.run_dir, "reward", addresses))
    except OSError as exc:
        where = f"not written: {exc}"
    if log.isEnabledFor(logging.INFO):  # quiet (log_level WARNING): warnings only
        print(f"rlfleet {describe('reward', addresses)} ({where})", flush=True)


def redis_client(url: str, max_connections: int) -> Redis:
    """A client whose burst of calls waits for a free connection instead of failing with
    "Too many connections" (the plain pool's behaviour once its limit is reached)."""
    return connect(url, max_connections)


def start_workers(
    redis: Redis,
    keys: Keys,
    registry: ScorerRegistry,
    options: Options,
    shared: tuple[WorkerSlots, ScoringLanes],
    on_crash: Callable[[], None],
) -> JobWorkerPool:
    """``slots.count`` RewardWorker tasks in this process, each its own consumer of the stream,
    all on the process's ``lanes``."""
    slots, lanes = shared
    group = JobWorkerPool(on_crash, stop_after_s=WORKER_STOP_S)
    timing = (options.item_timeout_s, options.reclaim_idle_s)
    for index in range(slots.count):
        queue, name = reward_queue(redis, keys), consumer_name("reward", index)
        group.add(RewardWorker(queue, registry, name, *timing, slots=slots, lanes=lanes))
    log.info("%d reward worker(s) running", slots.count)
    return group


@dataclass
class HttpFront:
    """The uvicorn server of the HTTP front door and the task serving it."""

    server: uvicorn.Server
    task: asyncio.Task

    @property
    def port(self) -> int:
        """The real port (``http_port=0`` picks a free one)."""
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


@dataclass
class FrontDoors:
    """The gRPC server, the optional HTTP front, and the Redis client they share."""

    grpc_server: GrpcServer
    http: HttpFront | None
    redis: Redis
    service: RewardService

    async def stop(self) -> None:
        await self.grpc_server.stop(GRPC_GRACE_S)
        if self.http is not None:
            await self.http.stop()
        self.service.close()
        await self.redis.aclose()


async def start_front_doors(
    config: RlfleetConfig,
    keys: Keys,
    registry: ScorerRegistry,
    shared: tuple[WorkerSlots | None, ScoringLanes],
    options: Options,
) -> FrontDoors:
    redis = redis_client(config.require_redis_url(), REDIS_CONCURRENCY + 8)
    slots, lanes = shared
    service = RewardService(
        redis, keys, config.reward, registry, slots, options.item_timeout_s, lanes
    )
    await service.start()
    http = await start_http(config, service)
    rc = config.reward
    grpc_server = GrpcServer(
        [registration(service)], rc.host, rc.port, config.max_message_mb, config.api_key
    )
    await grpc_server.start()
    return FrontDoors(grpc_server, http, redis, service)


async def start_http(config: RlfleetConfig, service: RewardService) -> HttpFront | None:
    """Start HTTP before gRPC: importing FastAPI blocks the loop for ~0.5 s, which is better
    spent before the service reports itself ready than under its first requests."""
    port = config.reward.http_port
    if port is None:
        return None
    from rlfleet.common.http_server import make_http_server
    from rlfleet.reward.http import create_app

    server = make_http_server(create_app(service, config.api_key), config.reward.host, port)
    task = asyncio.create_task(server.serve(), name="reward-http")
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # re-raise why it could not start
        raise OSError(f"HTTP server on port {port} exited at start")
    log.info("reward HTTP on %s:%d", config.reward.host, port)
    return HttpFront(server, task)
