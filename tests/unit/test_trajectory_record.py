"""The one token-native record (``rlfleet.common.trajectory``) and the one packed frame
(``rlfleet.common.packed``) that it, the episode and ``GenerateResult`` travel in."""

from __future__ import annotations

import pytest

from rlfleet.common import packed
from rlfleet.common.trajectory import NO_VERSION, Trajectory, TrajectoryError, token_versions
from rlfleet.rollout.types import PACKED_MAGIC, Completion, GenerateResult


def record() -> Trajectory:
    first = Trajectory.of_call([1, 2], [7, 8], [-0.5, -0.25], [3, 3])
    first.add_call([1, 2, 7, 8, 9], [5], [-1.0], [4])  # the 9 was added between the calls
    return first


def test_a_call_on_top_masks_what_was_added_between() -> None:
    merged = record()
    assert merged.response_ids == [7, 8, 9, 5] and merged.response_mask == [1, 1, 0, 1]
    assert merged.response_versions == [3, 3, NO_VERSION, 4]
    assert merged.response_logprobs == [-0.5, -0.25, 0.0, -1.0]
    assert (merged.oldest_version, merged.num_sampled, merged.total_tokens) == (3, 3, 6)
    assert merged.extended_by([1, 2, 7, 8, 9, 5, 6]) and not merged.extended_by([1, 2, 7])
    with pytest.raises(TrajectoryError, match="does not extend"):
        merged.add_call([1, 3], [4], [-1.0], [4])


def test_the_dict_form_round_trips_and_is_checked() -> None:
    merged = record()
    assert Trajectory.from_dict(merged.to_dict()) == merged
    for damage, says in [
        ({"response_mask": [1, 1, 1, 1]}, "sampled token"),
        ({"prompt_ids": [-1]}, "not a token id"),
        ({"extra": 1}, "exactly"),
    ]:
        with pytest.raises(TrajectoryError, match=says):
            Trajectory.from_dict({**merged.to_dict(), **damage})


def test_the_packed_arrays_round_trip_in_the_shared_frame() -> None:
    merged = record()
    data = packed.pack(b"\x00TT1", {"n": merged.lengths()}, merged.arrays())
    head, body = packed.unpack(b"\x00TT1", data)
    arrays = packed.read_arrays(body, Trajectory.layout(head["n"]))
    assert Trajectory.from_arrays(arrays) == merged
    with pytest.raises(packed.PackedError, match="magic"):
        packed.unpack(b"\x00XX1", data)
    with pytest.raises(packed.PackedError, match="body"):
        packed.read_arrays(bytes(body)[:-1], Trajectory.layout(head["n"]))


def test_each_tokens_version_or_the_rows() -> None:
    assert token_versions([4, 5], 2, 9) == [4, 5]
    assert token_versions([], 3, 9) == [9, 9, 9]
    assert Completion([1, 2], [-1.0, -1.0], "", "stop").versions(6) == [6, 6]


def test_a_generate_result_uses_the_same_frame() -> None:
    result = GenerateResult(
        "r", [Completion([5, 6], [-0.5, -1.0], "ab", "stop", [2, 3])], 2, "rep", [1, 2, 3]
    )
    data = result.encode()
    assert packed.is_packed(PACKED_MAGIC, data) and GenerateResult.decode(data) == result
    with pytest.raises(packed.PackedError):
        GenerateResult.decode(data[:-1])
