"""Python client of the env service: episode jobs in, decoded episodes out, rlfleet errors on failure.

``EnvClient`` is async (the trainer's loop); ``SyncEnvClient`` wraps it for scripts and
notebooks that have no event loop. Failed calls raise ``InvalidArgument``, ``Unavailable``,
``DeadlineExceeded``, ... (the gRPC error is the ``__cause__``), so callers never need grpc.
Arguments are checked before anything is sent (``validate_request``): a job that is not an
EpisodeJob (nor a dict of its fields) is a TypeError, a bad field an InvalidArgument naming it.
A failed episode is not an exception: its result has ``error`` set and an episode whose
``end_reason`` is ``error`` (``EpisodeResult.failed``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from rlfleet.common.grpc_client import auth_metadata, checked, make_channel, wait_ready
from rlfleet.env import convert
from rlfleet.env.types import (
    EnvironmentInfo,
    EpisodeJob,
    EpisodeResult,
    EpisodeSettings,
    validate_request,
)
from rlfleet.proto import common_pb2, env_pb2_grpc
from rlfleet.rollout.types import SamplingParams

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 3600.0


class EnvClient:
    """Async client; use ``async with EnvClient(addr) as client`` or call ``close()``."""

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_message_mb: int = 64,
    ) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._channel = make_channel(address, max_message_mb)
        self._stub = env_pb2_grpc.EnvStub(self._channel)
        self._metadata = auth_metadata(api_key)

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        await wait_ready(self._channel, timeout_s)

    async def run_episodes(
        self,
        jobs: Sequence[EpisodeJob | dict[str, Any]],
        sampling: SamplingParams | None = None,
        max_turns: int = 0,
        max_episode_tokens: int = 0,
    ) -> list[EpisodeResult]:
        """One result per job, in order. ``sampling`` is per turn (n must be 1; None: the
        defaults); ``max_turns`` / ``max_episode_tokens`` 0 take the service's config."""
        items = as_jobs(jobs)
        settings = EpisodeSettings(sampling or SamplingParams(), max_turns, max_episode_tokens)
        validate_request(items, settings)
        reply = await self._call(self._stub.RunEpisodes, convert.request_to_proto(items, settings))
        return [convert.result_from_proto(result) for result in reply.results]

    async def list_environments(self) -> list[EnvironmentInfo]:
        reply = await self._call(self._stub.ListEnvironments, common_pb2.Empty())
        return [convert.info_from_proto(info) for info in reply.environments]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _call(self, method: Callable[..., Awaitable[T]], message: Any) -> T:
        call = method(message, metadata=self._metadata, timeout=self.timeout_s)
        return await checked(call, "env")


class SyncEnvClient:
    """Blocking wrapper with its own event loop; not for use inside a running loop."""

    def __init__(self, address: str, api_key: str | None = None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = self._loop.run_until_complete(_make(address, api_key, kwargs))

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        self._loop.run_until_complete(self._client.wait_ready(timeout_s))

    def run_episodes(
        self,
        jobs: Sequence[EpisodeJob | dict[str, Any]],
        sampling: SamplingParams | None = None,
        max_turns: int = 0,
        max_episode_tokens: int = 0,
    ) -> list[EpisodeResult]:
        call = self._client.run_episodes(jobs, sampling, max_turns, max_episode_tokens)
        return self._loop.run_until_complete(call)

    def list_environments(self) -> list[EnvironmentInfo]:
        return self._loop.run_until_complete(self._client.list_environments())

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def __enter__(self) -> SyncEnvClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def as_jobs(jobs: Any) -> list[EpisodeJob]:
    """``jobs`` as EpisodeJobs (dicts of their fields accepted); TypeError for anything else."""
    if isinstance(jobs, str | bytes | dict) or not isinstance(jobs, Sequence):
        raise TypeError(f"run_episodes() takes a list of EpisodeJob, got {type(jobs).__name__}")
    return [job if isinstance(job, EpisodeJob) else EpisodeJob.from_dict(job) for job in jobs]


async def _make(address: str, api_key: str | None, kwargs: dict[str, Any]) -> EnvClient:
    """Build the async client inside the wrapper's loop (channels bind to their loop)."""
    return EnvClient(address, api_key, **kwargs)
