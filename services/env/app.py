"""The env process assembled: the gRPC front door, the episode workers, their Redis.

``rlfleet.env.main`` parses the command line and calls ``run``; everything here is what one
env process starts and stops. The front door queues episodes on the env stream; workers (in
this process, ``agent.workers``, and in any ``--worker-only`` process on the same Redis) play
them. ``Options.worker_only`` runs just workers, so episodes scale out by starting more
processes; the front door does not need to know about them.

Each worker is ``agent.concurrency`` lanes (``worker.py``) sharing one ``EpisodeRunner`` and
its router channel; the tokenizer of ``model.path`` is loaded once per process.

Standalone: with no ``redis_url`` (nor ``RLFLEET_REDIS_URL``) it starts an embedded Redis under
``run_dir/redis`` and stops it on exit. The addresses it bound (gRPC, Redis) are printed and
merged into ``run_dir/endpoints.json`` under ``env``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.endpoints import describe, write_endpoints
from rlfleet.common.entry import safe_url
from rlfleet.common.grpc_server import GrpcServer, install_stop_signals
from rlfleet.common.keys import Keys
from rlfleet.common.queue.workers import JobWorkerPool, consumer_name
from rlfleet.common.redis_client import connect
from rlfleet.common.redis_server import standalone_redis
from rlfleet.env.runner import EpisodeRunner, env_maker, load_renderer
from rlfleet.env.server import registration
from rlfleet.env.service import REDIS_CONCURRENCY, EnvService, env_queue
from rlfleet.env.worker import EnvWorker
from rlfleet.rollout.client import RolloutClient

log = logging.getLogger(__name__)

GRPC_GRACE_S = 5.0
WORKER_STOP_S = 5.0
REDIS_PER_LANE = 3  # a blocking read, a keep-alive touch, an answer


@dataclass(frozen=True)
class Options:
    """What the command line adds to the config (``rlfleet env --help``)."""

    worker_only: bool


def run(config: RlfleetConfig, options: Options) -> bool:
    """Serve until SIGTERM/SIGINT; False if a worker crashed."""
    with standalone_redis(config, "env"):
        return asyncio.run(serve(config, options))


async def serve(config: RlfleetConfig, options: Options) -> bool:
    """Run until SIGTERM/SIGINT (or a worker crash); False if a worker crashed.

    The front door stops first, so episodes in flight can still be answered by the workers."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    keys = Keys(config.cluster)
    workers = start_workers(config, keys, stop.set) if config.agent.workers > 0 else None
    front = None if options.worker_only else await start_front(config, keys)
    if front is not None:
        announce(config, front)
    await stop.wait()
    log.info("stopping env %s", "workers" if front is None else "service")
    if front is not None:
        await front.stop()
    if workers is not None:
        await workers.stop()
    return workers is None or not workers.group.crashed


@dataclass
class Workers:
    """This process's env workers, their Redis client and their router channels."""

    group: JobWorkerPool
    redis: Redis
    clients: list[RolloutClient] = field(default_factory=list)
    lanes: list[EnvWorker] = field(default_factory=list)

    async def stop(self) -> None:
        await self.group.stop()
        answered = sum(lane.answered for lane in self.lanes)
        log.info("env workers stopped after %d episodes (%d lanes)", answered, len(self.lanes))
        for client in self.clients:
            await client.close()
        await self.redis.aclose()


def start_workers(config: RlfleetConfig, keys: Keys, on_crash: Callable[[], None]) -> Workers:
    """``agent.workers`` workers of ``agent.concurrency`` lanes each; a misnamed environment or
    a tokenizer without a chat template fails here, before any episode is taken."""
    agent = config.agent
    renderer, make_env = load_renderer(config.model.path), env_maker(agent)
    lanes = agent.workers * agent.concurrency
    workers = Workers(
        JobWorkerPool(on_crash, stop_after_s=WORKER_STOP_S),
        connect(config.require_redis_url(), lanes * REDIS_PER_LANE + 4),
    )
    read_turn = asyncio.Lock()  # one blocked read per process: processes share batches
    for index in range(agent.workers):
        client = RolloutClient(config.endpoints.router, config.api_key, config.max_message_mb)
        runner = EpisodeRunner(make_env, renderer, client, agent, config.api_key)
        workers.clients.append(client)
        for lane in range(agent.concurrency):
            name = consumer_name("env", index, lane)
            workers.lanes.append(
                EnvWorker(
                    env_queue(workers.redis, keys), runner, name, agent.reclaim_idle_s, read_turn
                )
            )
            workers.group.add(workers.lanes[-1])
    log.info(
        "%d env worker(s) x %d lanes started on %s, running %r",
        agent.workers,
        agent.concurrency,
        keys.env_stream,
        agent.env,
    )
    return workers


@dataclass
class Front:
    """The gRPC server and the Redis client of the front door."""

    grpc_server: GrpcServer
    redis: Redis

    async def stop(self) -> None:
        await self.grpc_server.stop(GRPC_GRACE_S)
        await self.redis.aclose()


async def start_front(config: RlfleetConfig, keys: Keys) -> Front:
    redis = connect(config.require_redis_url(), REDIS_CONCURRENCY + 8)
    service = EnvService(redis, keys, config.agent)
    await service.start()
    agent = config.agent
    grpc_server = GrpcServer(
        [registration(service)], agent.host, agent.port, config.max_message_mb, config.api_key
    )
    await grpc_server.start()
    return Front(grpc_server, redis)


def announce(config: RlfleetConfig, front: Front) -> None:
    """Print the bound addresses and merge them into ``run_dir/endpoints.json``."""
    addresses = {
        "grpc": f"{config.agent.host}:{front.grpc_server.port}",
        "redis": safe_url(config.redis_url),
    }
    try:
        where = str(write_endpoints(config.run_dir, "env", addresses))
    except OSError as exc:
        where = f"not written: {exc}"
    if log.isEnabledFor(logging.INFO):  # quiet (log_level WARNING): warnings only
        print(f"rlfleet {describe('env', addresses)} ({where})", flush=True)
