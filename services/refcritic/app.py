"""The refcritic process assembled: its models, the optional queue path, the gRPC server.

Two paths, chosen by ``redis_url``:

- unset: the gRPC server computes every call directly (one process, no Redis).
- set (``rlfleet up`` always sets it): ComputeRefLogProbs / ComputeValues go through the Redis
  work queue. This process runs the gRPC server plus ``refcritic.workers`` ref workers and, when
  the critic is enabled, as many values workers (only this process holds the trained critic).
  ``worker_only`` runs just ref workers and loads just the reference policy, so reference
  throughput scales by starting more processes. With ``refcritic.local_first`` the gRPC process
  computes a read itself when its own worker of that kind is idle (no Redis hop), sharing that
  worker's slots (``rlfleet.common.queue.local_first.WorkerSlots``).

``rlfleet.refcritic.main`` parses the command line and calls ``run``; torch and transformers
are imported only when the models load, in ``load_models``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

from redis.asyncio import Redis

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.grpc_server import install_stop_signals
from rlfleet.common.keys import Keys
from rlfleet.common.queue.local_first import WorkerSlots
from rlfleet.common.queue.workers import JobWorkerPool, consumer_name
from rlfleet.common.redis_client import connect
from rlfleet.refcritic.models import Models
from rlfleet.refcritic.queue_service import Kind, QueuedCompute, refcritic_queue
from rlfleet.refcritic.server import start_server
from rlfleet.refcritic.worker import Compute, RefCriticWorker, in_thread_locked

log = logging.getLogger(__name__)


def run(config: RlfleetConfig, worker_only: bool = False) -> bool:
    """Serve until SIGTERM/SIGINT; False if a worker crashed."""
    return asyncio.run(serve(config, worker_only))


def load_models(config: RlfleetConfig, worker_only: bool) -> Models:
    """The slow part; a worker-only process never needs the critic (see queue_service)."""
    from rlfleet.refcritic.critic import Critic
    from rlfleet.refcritic.reference import RefPolicy

    with_critic = config.refcritic.critic_enabled and not worker_only
    return Models(RefPolicy(config), Critic(config) if with_critic else None)


async def serve(config: RlfleetConfig, worker_only: bool = False) -> bool:
    """Run until SIGTERM/SIGINT (or a worker crash); False if a worker crashed."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    models = await asyncio.to_thread(load_models, config, worker_only)
    lock = threading.Lock()  # one model computation at a time, shared by server and workers
    queue = await start_queue(config, models, lock, stop, worker_only) if config.redis_url else None
    server = None
    if not worker_only:
        server = await start_server(config, models, lock, queue.compute if queue else None)
    await stop.wait()
    log.info("refcritic stopping")
    if server is not None:
        await server.stop()
    return await queue.stop() if queue else True


@dataclass
class QueuePath:
    """The producer side (for the server), the worker tasks, and their Redis client."""

    compute: QueuedCompute
    workers: JobWorkerPool
    redis: Redis

    async def stop(self) -> bool:
        """Stop workers, then close Redis; False if a worker had crashed."""
        await self.workers.stop()
        await self.redis.aclose()
        return not self.workers.crashed


async def start_queue(
    config: RlfleetConfig,
    models: Models,
    lock: threading.Lock,
    stop: asyncio.Event,
    worker_only: bool = False,
) -> QueuePath:
    settings, keys = config.refcritic, Keys(config.cluster)
    redis = connect(config.require_redis_url(), 4 * settings.workers + 64)
    compute = QueuedCompute(redis, keys, settings.micro_batch_size, settings.request_timeout_s)
    await compute.start()
    computes: dict[Kind, Compute] = {"ref": models.reference.logprobs}
    if models.critic is not None:  # values only where the trained critic lives
        computes["values"] = models.critic.values
    group = JobWorkerPool(stop.set)
    timing = (settings.reclaim_idle_s, settings.worker_delay_s)
    for kind, fn in computes.items():
        slots = WorkerSlots(settings.workers)
        if settings.local_first and not worker_only:
            compute.serve_locally(kind, slots, in_thread_locked(fn, lock))
        for index in range(settings.workers):
            queue, name = refcritic_queue(redis, keys, kind), consumer_name(kind, index)
            group.add(RefCriticWorker(queue, fn, lock, name, *timing, slots=slots))
    log.info("refcritic queue path: %d worker(s) for %s", settings.workers, ", ".join(computes))
    return QueuePath(compute, group, redis)
