"""Proto glue of the env service: requests and results survive the wire, tasks keep their ints."""

from __future__ import annotations

import pytest

from rlfleet.agent.episode import Episode
from rlfleet.common.errors import ErrorCode, Internal, InvalidArgument
from rlfleet.common.queue.results import Result
from rlfleet.env.convert import (
    info_from_proto,
    info_to_proto,
    outcome_to_proto,
    request_from_proto,
    request_to_proto,
    result_from_proto,
)
from rlfleet.env.service import outcome_of
from rlfleet.env.types import (
    EnvironmentInfo,
    EpisodeJob,
    EpisodeOutcome,
    EpisodeSettings,
)
from rlfleet.proto import env_pb2
from rlfleet.rollout.types import SamplingParams

TASK = {
    "prompt": [{"role": "user", "content": "12+34+56="}],
    "data_source": "calc",
    "reward_model": {"ground_truth": 102},
    "extra_info": {"numbers": [12, 34, 56], "scale": 0.5},
}


def test_a_request_round_trips_and_integral_numbers_stay_ints():
    jobs = [EpisodeJob("e0", TASK, "g0", 3), EpisodeJob("e1", {}, "", 0)]
    settings = EpisodeSettings(SamplingParams(temperature=0.5, max_tokens=12, seed=7), 4, 256)
    wire = env_pb2.RunEpisodesRequest.FromString(
        request_to_proto(jobs, settings).SerializeToString()
    )
    back_jobs, back_settings = request_from_proto(wire)
    assert back_jobs == jobs
    assert back_jobs[0].task["extra_info"]["numbers"] == [12, 34, 56]
    assert type(back_jobs[0].task["reward_model"]["ground_truth"]) is int
    assert back_settings == settings


def test_a_request_without_sampling_gets_the_defaults():
    jobs, settings = request_from_proto(env_pb2.RunEpisodesRequest(jobs=[{"episode_id": "a"}]))
    assert settings == EpisodeSettings(SamplingParams(), 0, 0)
    assert jobs == [EpisodeJob("a", {}, "", 0)]


def test_a_task_that_cannot_travel_names_its_job():
    with pytest.raises(InvalidArgument, match=r"jobs\[1\]\.task"):
        request_to_proto([EpisodeJob("a"), EpisodeJob("b", {"raw": b"bytes"})], EpisodeSettings())


def test_results_decode_their_episode_and_refuse_unreadable_bytes():
    episode = Episode(episode_id="e0", prompt_ids=[1, 2], num_turns=1)
    episode.extend_sampled([3], [-0.1], [0])
    proto = outcome_to_proto(EpisodeOutcome("e0", episode.encode(), "", 1, ["ra", "ra"]))
    result = result_from_proto(proto)
    assert (result.episode_id, result.restarts, result.replica_ids) == ("e0", 1, ["ra", "ra"])
    assert result.episode.sampled_ids() == [3] and not result.failed
    with pytest.raises(Internal, match="e1"):
        result_from_proto(env_pb2.EpisodeResult(episode_id="e1", episode=b"junk"))


def test_environment_infos_round_trip():
    info = EnvironmentInfo("calc", "builtin", True)
    assert info_from_proto(info_to_proto(info)) == info


def test_answers_become_outcomes_checked_against_their_job():
    job = EpisodeJob("e0")
    good = EpisodeOutcome("e0", Episode(episode_id="e0", prompt_ids=[1]).encode(), restarts=1)
    assert outcome_of(job, Result("r", good.encode())) == good
    lost = outcome_of(job, Result("r", b"", ErrorCode.INTERNAL, "dead-lettered: delivered 4 times"))
    assert lost.error.startswith("dead-lettered") and Episode.decode(lost.episode).failed
    foreign = EpisodeOutcome("e7", Episode(episode_id="e7", prompt_ids=[1]).encode())
    assert "answered episode 'e7'" in outcome_of(job, Result("r", foreign.encode())).error
    assert "unreadable" in outcome_of(job, Result("r", b"\x01")).error
