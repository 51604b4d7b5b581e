"""The env service's core: validate a batch of episode jobs, scatter them, gather the episodes.

Front doors (gRPC) are thin wrappers around ``EnvService``; it never imports grpc. Every
episode is its own entry on the env stream (``ScatterGather`` from the job toolkit), so the
workers of every env process share one batch episode by episode, and a worker that dies
mid-episode costs only that episode: its entry stays pending, another worker reclaims it and
plays it again from the beginning (``restarts`` in its result). The queue stores the first
answer of each entry only, and each episode of a batch is one entry, so no episode is answered
twice; answers are matched back to their jobs by position and checked against the episode id.

There is no in-process shortcut (unlike reward's local first): an episode takes seconds of
generation and environment work, so one Redis round trip per episode costs nothing that
matters, and the queue is what makes a lost worker cost a restart instead of the batch.
A batch not fully answered within ``agent.request_timeout_s`` fails with DeadlineExceeded.
A caller that gives up (cancelled, timed out) has its unanswered episodes withdrawn
(``ScatterGather(withdraw=True)``): queued ones are never played, and a worker playing one
stops it (``EnvWorker``), so no worker keeps generating for nobody.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, overload

from redis.asyncio import Redis

from rlfleet.agent.environment import BUILTIN_ENVS
from rlfleet.common.config.agent import AgentConfig
from rlfleet.common.keys import ENV_GROUP, Keys
from rlfleet.common.queue.consumer import Consumer
from rlfleet.common.queue.producer import Producer
from rlfleet.common.queue.results import Result
from rlfleet.common.queue.scatter import ScatterGather
from rlfleet.common.queue.stream import QueueStream
from rlfleet.env.types import (
    EnvironmentInfo,
    EpisodeJob,
    EpisodeOutcome,
    EpisodeSettings,
    encode_job,
    validate_request,
)

MAX_DELIVERIES = 3  # an episode that killed this many workers is dead-lettered (an error)
RESULT_TTL_S = 900
REDIS_CONCURRENCY = 32  # submits in flight per service
Side = TypeVar("Side", bound=QueueStream)


@overload
def env_queue(redis: Redis, keys: Keys) -> Consumer: ...
@overload
def env_queue(redis: Redis, keys: Keys, side: type[Side]) -> Side: ...
def env_queue(redis: Redis, keys: Keys, side: type[QueueStream] = Consumer) -> QueueStream:
    """One side (a worker's ``Consumer``, the default; the service's ``Producer``) of the one
    queue the service produces to and every env worker consumes from."""
    return side(redis, keys, keys.env_stream, ENV_GROUP, MAX_DELIVERIES, RESULT_TTL_S)


class EnvService:
    """Runs batches of episodes on the env workers; results in job order."""

    def __init__(self, redis: Redis, keys: Keys, agent: AgentConfig) -> None:
        self.agent = agent
        self.queue = env_queue(redis, keys, Producer)
        self.jobs = ScatterGather(
            self.queue, agent.request_timeout_s, "env workers", REDIS_CONCURRENCY, withdraw=True
        )

    async def start(self) -> None:
        await self.jobs.start()

    async def run_episodes(
        self, jobs: Sequence[EpisodeJob], settings: EpisodeSettings
    ) -> list[EpisodeOutcome]:
        """Every job's episode, in order; a failed episode is an outcome with ``error``."""
        jobs = list(jobs)
        settings = settings.resolved(self.agent.max_turns, self.agent.max_episode_tokens)
        validate_request(jobs, settings)
        if not jobs:
            return []
        answers = await self.jobs.run([encode_job(job, settings) for job in jobs])
        return [outcome_of(job, answer) for job, answer in zip(jobs, answers, strict=True)]

    def list_environments(self) -> list[EnvironmentInfo]:
        """The built-in names, and the configured ``agent.env`` (marked active)."""
        active = self.agent.env
        infos = [EnvironmentInfo(name, "builtin", name == active) for name in BUILTIN_ENVS]
        if active and active not in BUILTIN_ENVS:
            infos.append(EnvironmentInfo(active, "import", True))
        return infos

    async def healthy(self) -> bool:
        return await self.queue.ping()


def outcome_of(job: EpisodeJob, answer: Result) -> EpisodeOutcome:
    """The worker's outcome, or a failed one: the queue's error (e.g. dead-lettered after
    too many deliveries, which its message counts; ``restarts`` is then 0: no worker answered),
    an unreadable answer, or an answer for another episode."""
    if not answer.ok:
        return EpisodeOutcome.failed(job.episode_id, answer.message)
    try:
        outcome = EpisodeOutcome.decode(answer.payload)
    except ValueError as exc:
        return EpisodeOutcome.failed(job.episode_id, f"unreadable worker answer: {exc}")
    if outcome.episode_id != job.episode_id:
        why = f"a worker answered episode {outcome.episode_id!r} for {job.episode_id!r}"
        return EpisodeOutcome.failed(job.episode_id, why)
    return outcome
