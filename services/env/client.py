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

from collections.abc import Sequence
from typing import Any

from rlfleet.common.grpc_client import ServiceClient, SyncServiceClient
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

DEFAULT_TIMEOUT_S = 3600.0


class EnvClient(ServiceClient):
    """Async client; use ``async with EnvClient(addr) as client`` or call ``close()``."""

    SERVICE = "env"

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_message_mb: int = 64,
    ) -> None:
        super().__init__(address, api_key, timeout_s, max_message_mb)
        self._stub = env_pb2_grpc.EnvStub(self._channel)

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


class SyncEnvClient(SyncServiceClient[EnvClient]):
    """``EnvClient``, blocking; not for use inside a running loop."""

    def __init__(self, address: str, api_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(lambda: EnvClient(address, api_key, **kwargs))

    def run_episodes(
        self,
        jobs: Sequence[EpisodeJob | dict[str, Any]],
        sampling: SamplingParams | None = None,
        max_turns: int = 0,
        max_episode_tokens: int = 0,
    ) -> list[EpisodeResult]:
        return self._run(self._client.run_episodes(jobs, sampling, max_turns, max_episode_tokens))

    def list_environments(self) -> list[EnvironmentInfo]:
        return self._run(self._client.list_environments())


def as_jobs(jobs: Any) -> list[EpisodeJob]:
    """``jobs`` as EpisodeJobs (dicts of their fields accepted); TypeError for anything else."""
    if isinstance(jobs, str | bytes | dict) or not isinstance(jobs, Sequence):
        raise TypeError(f"run_episodes() takes a list of EpisodeJob, got {type(jobs).__name__}")
    return [job if isinstance(job, EpisodeJob) else EpisodeJob.from_dict(job) for job in jobs]
