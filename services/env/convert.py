"""Proto <-> plain objects for the Env service, used by its server and by its client.

Why a module of its own: the client needs the same conversions as the server and must not
import the server (nor, through it, the service and its Redis queue).

A task travels as a ``Struct``, which holds only doubles, so integral numbers come back as
ints (the calc task's ``extra_info.numbers`` stay ``[12, 34, 56]``, a ground truth ``102``
stays 102). Sampling follows the rollout proto's rule (``rlfleet.rollout.convert``): absent
means the defaults; present means every field as sent. The episode itself crosses as the
bytes ``Episode.encode()`` wrote: the front door never decodes it, the client does.
"""

from __future__ import annotations

from rlfleet.agent.episode import Episode, EpisodeError
from rlfleet.common.errors import Internal, InvalidArgument
from rlfleet.common.proto_struct import struct_to_dict
from rlfleet.env.types import (
    EnvironmentInfo,
    EpisodeJob,
    EpisodeOutcome,
    EpisodeResult,
    EpisodeSettings,
)
from rlfleet.proto import env_pb2
from rlfleet.rollout.convert import sampling_from_proto, sampling_to_proto
from rlfleet.rollout.types import SamplingParams


def request_from_proto(msg: env_pb2.RunEpisodesRequest) -> tuple[list[EpisodeJob], EpisodeSettings]:
    sampling = sampling_from_proto(msg.sampling) if msg.HasField("sampling") else SamplingParams()
    settings = EpisodeSettings(sampling, msg.max_turns, msg.max_episode_tokens)
    return [job_from_proto(job) for job in msg.jobs], settings


def request_to_proto(
    jobs: list[EpisodeJob], settings: EpisodeSettings
) -> env_pb2.RunEpisodesRequest:
    return env_pb2.RunEpisodesRequest(
        jobs=[job_to_proto(job, f"jobs[{i}]") for i, job in enumerate(jobs)],
        sampling=sampling_to_proto(settings.sampling),
        max_turns=settings.max_turns,
        max_episode_tokens=settings.max_episode_tokens,
    )


def job_from_proto(msg: env_pb2.EpisodeJob) -> EpisodeJob:
    return EpisodeJob(
        msg.episode_id, struct_to_dict(msg.task), msg.group_id, msg.min_weight_version
    )


def job_to_proto(job: EpisodeJob, where: str = "job") -> env_pb2.EpisodeJob:
    msg = env_pb2.EpisodeJob(
        episode_id=job.episode_id, group_id=job.group_id, min_weight_version=job.min_weight_version
    )
    try:
        msg.task.update(job.task)
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidArgument(f"{where}.task cannot travel as a Struct: {exc}") from exc
    return msg


def outcome_to_proto(outcome: EpisodeOutcome) -> env_pb2.EpisodeResult:
    return env_pb2.EpisodeResult(
        episode_id=outcome.episode_id,
        episode=outcome.episode,
        error=outcome.error,
        restarts=outcome.restarts,
        replica_ids=outcome.replica_ids,
    )


def result_from_proto(msg: env_pb2.EpisodeResult) -> EpisodeResult:
    """The client's result, its episode decoded; Internal when the bytes are not an episode."""
    try:
        episode = Episode.decode(msg.episode)
    except EpisodeError as exc:
        raise Internal(f"episode {msg.episode_id!r} came back unreadable: {exc}") from exc
    return EpisodeResult(msg.episode_id, episode, msg.error, msg.restarts, list(msg.replica_ids))


def info_to_proto(info: EnvironmentInfo) -> env_pb2.EnvironmentInfo:
    return env_pb2.EnvironmentInfo(name=info.name, kind=info.kind, active=info.active)


def info_from_proto(msg: env_pb2.EnvironmentInfo) -> EnvironmentInfo:
    return EnvironmentInfo(msg.name, msg.kind, msg.active)
