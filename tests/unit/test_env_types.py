"""The env role's plain objects: batch validation (each bad field named), the queue codecs."""

from __future__ import annotations

import pytest

from rlfleet.agent.episode import EndReason, Episode
from rlfleet.common.errors import InvalidArgument
from rlfleet.common.packed import pack
from rlfleet.env.types import (
    MAX_JOBS,
    MAX_TASK_BYTES,
    OUTCOME_MAGIC,
    EpisodeJob,
    EpisodeOutcome,
    EpisodeSettings,
    decode_job,
    encode_job,
    validate_request,
)
from rlfleet.rollout.types import SamplingParams

TASK = {
    "prompt": [{"role": "user", "content": "12+34+56="}],
    "data_source": "calc",
    "reward_model": {"ground_truth": "102"},
    "extra_info": {"numbers": [12, 34, 56]},
}
SETTINGS = EpisodeSettings(SamplingParams(max_tokens=8), max_turns=4, max_episode_tokens=128)


def jobs(n: int = 2) -> list[EpisodeJob]:
    return [EpisodeJob(f"e{i}", TASK, group_id="g0", min_weight_version=1) for i in range(n)]


def test_a_good_batch_passes_and_zero_limits_take_the_service_defaults():
    validate_request(jobs(), SETTINGS)
    validate_request([], EpisodeSettings())  # 0 = the service's agent config
    resolved = EpisodeSettings(max_turns=0, max_episode_tokens=64).resolved(8, 512)
    assert (resolved.max_turns, resolved.max_episode_tokens) == (8, 64)


@pytest.mark.parametrize(
    ("job", "field"),
    [
        (EpisodeJob(""), "jobs[1].episode_id"),
        (EpisodeJob("a\nb"), "jobs[1].episode_id"),
        (EpisodeJob("x" * 300), "jobs[1].episode_id"),
        (EpisodeJob(7), "jobs[1].episode_id"),  # type: ignore[arg-type]
        (EpisodeJob("ok", group_id="g" * 300), "jobs[1].group_id"),
        (EpisodeJob("ok", min_weight_version=-1), "jobs[1].min_weight_version"),
        (EpisodeJob("ok", min_weight_version=True), "jobs[1].min_weight_version"),  # type: ignore[arg-type]
        (EpisodeJob("ok", task=[1, 2]), "jobs[1].task"),  # type: ignore[arg-type]
        (EpisodeJob("ok", task={"bad": {1, 2}}), "jobs[1].task"),
        (EpisodeJob("ok", task={"nan": float("nan")}), "jobs[1].task"),
        (EpisodeJob("ok", task={"big": "1" * MAX_TASK_BYTES}), "jobs[1].task"),
    ],
)
def test_a_bad_job_is_refused_naming_its_field(job, field):
    with pytest.raises(InvalidArgument) as refused:
        validate_request([EpisodeJob("first"), job], SETTINGS)
    assert str(refused.value).startswith(field)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (EpisodeSettings(SamplingParams(n=2)), "sampling.n"),
        (EpisodeSettings(SamplingParams(temperature=float("nan"))), "sampling.temperature"),
        (EpisodeSettings(SamplingParams(max_tokens=0)), "sampling.max_tokens"),
        (EpisodeSettings(max_turns=-1), "max_turns"),
        (EpisodeSettings(max_turns=5000), "max_turns"),
        (EpisodeSettings(max_episode_tokens=-3), "max_episode_tokens"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(settings, field):
    with pytest.raises(InvalidArgument) as refused:
        validate_request(jobs(1), settings)
    assert str(refused.value).startswith(field)


def test_duplicate_episode_ids_and_oversized_batches_are_refused():
    with pytest.raises(InvalidArgument, match=r"jobs\[1\].episode_id 'e0' is a duplicate"):
        validate_request([EpisodeJob("e0"), EpisodeJob("e0")], SETTINGS)
    with pytest.raises(InvalidArgument, match="more than"):
        validate_request([EpisodeJob("e")] * (MAX_JOBS + 1), SETTINGS)


def test_job_from_dict_checks_its_fields():
    assert EpisodeJob.from_dict({"episode_id": "a", "task": TASK}) == EpisodeJob("a", TASK)
    with pytest.raises(InvalidArgument, match="unknown EpisodeJob fields"):
        EpisodeJob.from_dict({"episode_id": "a", "prompt": "x"})
    with pytest.raises(InvalidArgument, match="needs an episode_id"):
        EpisodeJob.from_dict({"task": TASK})
    with pytest.raises(TypeError):
        EpisodeJob.from_dict("a")


def test_a_queued_job_round_trips_and_garbage_is_refused():
    queued = decode_job(encode_job(jobs(1)[0], SETTINGS))
    assert (queued.job, queued.settings) == (jobs(1)[0], SETTINGS)
    for garbage in (
        b"",
        b"{}",
        b"[1]",
        b'{"job": {"episode_id": ""}, "sampling": {}, "max_turns": 1, "max_episode_tokens": 1}',
    ):
        with pytest.raises(InvalidArgument):
            decode_job(garbage)


def test_an_outcome_round_trips_with_its_episode_bytes():
    episode = Episode(episode_id="e0", prompt_ids=[1, 2, 3], num_turns=1)
    episode.extend_sampled([4, 5], [-0.5, -0.25], [3, 3])
    outcome = EpisodeOutcome("e0", episode.encode(), "", 1, ["ra"])
    again = EpisodeOutcome.decode(outcome.encode())
    assert again == outcome
    assert Episode.decode(again.episode).sampled_ids() == [4, 5]
    assert outcome.encode().startswith(OUTCOME_MAGIC)
    not_outcomes = (b"\x00\x00", episode.encode(), pack(OUTCOME_MAGIC, [1, 2], []))
    for garbage in not_outcomes:
        with pytest.raises(InvalidArgument):
            EpisodeOutcome.decode(garbage)


def test_a_failed_outcome_still_carries_an_error_episode():
    outcome = EpisodeOutcome.failed("e9", "the environment raised", restarts=2)
    episode = Episode.decode(outcome.episode)
    assert (outcome.error, outcome.restarts) == ("the environment raised", 2)
    assert (episode.episode_id, episode.end_reason, episode.error) == (
        "e9",
        EndReason.ERROR,
        "the environment raised",
    )
    assert episode.prompt_ids == [] and episode.response_ids == []
