"""The episode record: its arrays line up, and its Redis form round-trips and refuses garbage."""

from __future__ import annotations

import struct

import pytest

from rlfleet.agent.episode import MAGIC, EndReason, Episode, EpisodeError


def sample_episode() -> Episode:
    episode = Episode(episode_id="ep-1", prompt_ids=[1, 2, 3])
    episode.extend_sampled([10, 11], [-0.5, -1.25], [4, 4])
    episode.extend_environment([2, 12, 13])
    episode.extend_sampled([14], [-2.0], [5])
    episode.reward, episode.reward_parts = 1.0, {"answer": 1.0, "format": 0.5}
    episode.num_turns, episode.tool_calls, episode.tool_errors = 2, 1, 0
    episode.end_reason, episode.generate_s, episode.env_s = EndReason.DONE, 0.25, 0.125
    episode.messages = [
        {"role": "user", "content": "12+34="},
        {"role": "assistant", "content": "46"},
    ]
    return episode


def test_arrays_line_up_and_properties() -> None:
    episode = sample_episode()
    assert episode.response_mask == [1, 1, 0, 0, 0, 1]
    assert episode.response_logprobs == [-0.5, -1.25, 0.0, 0.0, 0.0, -2.0]
    assert episode.response_versions == [4, 4, -1, -1, -1, 5]
    assert episode.sampled_ids() == [10, 11, 14]
    assert (episode.oldest_version, episode.num_sampled, episode.total_tokens) == (4, 3, 9)
    assert not episode.truncated and not episode.failed
    assert Episode(episode_id="empty", prompt_ids=[1]).oldest_version == -1


def test_encode_decode_round_trip() -> None:
    episode = sample_episode()
    data = episode.encode()
    assert data.startswith(MAGIC)
    assert Episode.decode(data) == episode
    truncated = Episode(episode_id="t", prompt_ids=[5], end_reason=EndReason.TOKEN_BUDGET, error="")
    assert Episode.decode(truncated.encode()) == truncated and truncated.truncated


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: b"{" + d[1:],
        lambda d: d[:-1],
        lambda d: d + b"\x00",
        lambda d: d[:6],
        lambda d: MAGIC + struct.pack("<I", 3) + b"[1]",
        lambda d: MAGIC + struct.pack("<I", 2) + b"{}",
    ],
)
def test_decode_refuses_damaged_bytes(damage: object) -> None:
    with pytest.raises(EpisodeError):
        Episode.decode(damage(sample_episode().encode()))


def test_decode_refuses_arrays_that_do_not_fit() -> None:
    episode = sample_episode()
    data = episode.encode()
    body_start = len(data) - (4 * 3 + 6 * (4 + 1 + 4 + 8))
    mask_at = body_start + 4 * 3 + 4 * 6
    broken = data[: mask_at + 2] + b"\x01" + data[mask_at + 3 :]  # an env token marked sampled
    with pytest.raises(EpisodeError, match="response_versions"):
        Episode.decode(broken)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("response_mask", [1, 1, 0, 0, 2, 1], "response_mask"),
        ("response_logprobs", [-0.5, -1.25, 0.0, -0.1, 0.0, -2.0], "not sampled"),
        ("response_versions", [4, 4, -1, -1, -1], "as long as"),
        ("prompt_ids", [1, -2], "not a token id"),
        ("reward", float("nan"), "finite"),
        ("reward_parts", {"answer": "1"}, "reward_parts"),
        ("num_turns", -1, "negative"),
        ("episode_id", "", "empty"),
        ("end_reason", "done", "EndReason"),
    ],
)
def test_validate_names_the_field(field: str, value: object, message: str) -> None:
    episode = sample_episode()
    setattr(episode, field, value)
    with pytest.raises(EpisodeError, match=message):
        episode.encode()
