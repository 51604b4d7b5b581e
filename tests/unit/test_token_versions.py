"""Per-token weight versions: carried by every wire format a completion travels in, and used
per token by the trainer (staleness bound, masks, off-policy weights).

Why: a request that a weight update crossed (``rollout.update_policy: keep``) holds tokens of
two versions; a format that dropped them, or a trainer that read only the row's version,
would train on tokens older than ``max_staleness`` or weight them against the wrong policy.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.rl.losses import importance_weights
from rlfleet.rollout import convert
from rlfleet.rollout.gateway.openai_api import completion_choices
from rlfleet.rollout.types import PACKED_MAGIC, Completion, GenerateResult
from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.rollout_batch import RolloutBatch, response_mask
from rlfleet.trainer.staleness import drop_stale, staleness_metrics


def crossed() -> GenerateResult:
    """Two samples: one finished before an update (v3), one crossed it (v3 then v4)."""
    return GenerateResult(
        "r1",
        [
            Completion([5, 6], [-0.5, -0.25], "12", "stop", [3, 3]),
            Completion([7, 8, 9], [-1.0, -2.0, -0.125], "345", "length", [3, 4, 4]),
        ],
        3,
        "rep-a",
        [1, 2],
    )


def test_packed_json_and_proto_forms_keep_every_tokens_version() -> None:
    result = crossed()
    assert GenerateResult.decode(result.encode()) == result
    assert GenerateResult.from_json(result.to_json()) == result
    assert convert.result_from_proto(convert.result_to_proto(result)) == result


def test_a_packed_answer_from_before_per_token_versions_still_decodes() -> None:
    """The old layout: four numbers per completion in the header, no version array."""
    import json
    import struct
    from array import array

    head = json.dumps(["r", 2, "rep", 1, [["ab", "stop", 2, 2]]]).encode()
    blob = b"".join(
        [
            PACKED_MAGIC,
            struct.pack("<I", len(head)),
            head,
            array("i", [1, 5, 6]).tobytes(),
            array("f", [-0.5, -1.5]).tobytes(),
        ]
    )
    [c] = GenerateResult.decode(blob).completions
    assert (c.token_ids, c.logprobs, c.weight_versions) == ([5, 6], [-0.5, -1.5], [])
    assert c.versions(2) == [2, 2]  # a completion without them: the result's version


def test_openai_choices_with_token_ids_name_each_tokens_version() -> None:
    choices = completion_choices([crossed()], None, False, token_ids=True)
    assert [c["token_weight_versions"] for c in choices] == [[3, 3], [3, 4, 4]]
    assert [c["weight_version"] for c in choices] == [3, 3]
    assert "token_weight_versions" not in completion_choices([crossed()], None, False)[0]


def batch_of(*results: GenerateResult) -> RolloutBatch:
    batch = RolloutBatch()
    record = PromptRecord(prompt="1+2=", token_ids=[1, 2], ground_truth="3", data_source="x")
    for group, result in enumerate(results):
        batch.add_group(record, group, result)
    return batch


def test_single_turn_rows_carry_their_tokens_versions_and_their_oldest() -> None:
    batch = batch_of(crossed())
    assert batch.token_versions == [[3, 3], [3, 4, 4]]
    assert batch.weight_versions == [3, 3]
    old = GenerateResult("r0", [Completion([5], [-1.0], "1", "stop")], 2, "rep", [1])
    assert batch_of(old).token_versions == [[2]]  # a peer without per-token versions


def test_token_staleness_metrics_count_every_token() -> None:
    metrics = staleness_metrics(batch_of(crossed()), 5, 0)
    assert metrics["async/staleness/token_mean"] == pytest.approx((2 + 2 + 2 + 1 + 1) / 5)
    assert metrics["async/staleness/token_max"] == 2.0
    assert metrics["async/staleness/max"] == 2.0


def test_drop_sample_drops_a_row_holding_one_token_too_old() -> None:
    # trainer at v5, max_staleness 1: tokens of v3 are too old, v4 are fine
    kept, dropped = drop_stale(batch_of(crossed()), 4, "drop_sample")
    assert (len(kept), dropped) == (0, 2)
    kept, dropped = drop_stale(batch_of(crossed()), 3, "drop_sample")
    assert (len(kept), dropped, kept.row_loss_masks()) == (2, 0, None)  # nothing masked


def test_mask_leaves_only_the_too_old_tokens_out_and_counts_them() -> None:
    kept, dropped = drop_stale(batch_of(crossed()), 4, "mask")
    # row 0 had only v3 tokens: nothing left, dropped; row 1 keeps its two v4 tokens
    assert (len(kept), dropped, kept.loss_masks) == (1, 1, [[0, 1, 1]])
    assert kept.stale_masked_tokens == 3
    assert staleness_metrics(kept, 5, dropped)["async/masked_tokens"] == 3.0
    assert response_mask(kept.response_lengths(), kept.row_loss_masks()).tolist() == [[0, 1, 1]]


def test_masking_pre_update_segments_trains_only_after_the_last_update() -> None:
    kept, dropped = drop_stale(batch_of(crossed()), 0, "drop_sample", mask_pre_update=True)
    assert (dropped, kept.loss_masks, kept.stale_masked_tokens) == (0, [[1, 1], [0, 1, 1]], 1)


def test_zero_staleness_with_fresh_tokens_is_the_synchronous_batch() -> None:
    """k = 0 and every token from the trainer's version: nothing dropped or masked, the loss
    sees exactly the rows and mask a synchronous step would."""
    fresh = GenerateResult(
        "r",
        [
            Completion([5, 6], [-1.0, -1.0], "", "stop", [4, 4]),
            Completion([7], [-1.0], "", "stop", [4]),
        ],
        4,
        "a",
        [1],
    )
    for how in ("drop_sample", "mask"):
        kept, dropped = drop_stale(batch_of(fresh), 4 - 0, how, mask_pre_update=True)
        sync = batch_of(fresh)
        assert (dropped, kept.responses, kept.stale_masked_tokens) == (0, sync.responses, 0)
        assert torch.equal(
            response_mask(kept.response_lengths(), kept.row_loss_masks()),
            response_mask(sync.response_lengths(), sync.row_loss_masks()),
        )


def test_importance_weights_use_each_tokens_own_behaviour_logprob() -> None:
    """Row sampled by v3 for two tokens and v4 for the third: the engine's log-prob of each
    token is that of the weights that sampled it, so the weights are, by hand,
    exp(old - behaviour) per token, capped at 2."""
    batch = batch_of(crossed())
    behaviour = torch.tensor([batch.engine_logprobs[1]])  # [-1.0, -2.0, -0.125]
    old = torch.tensor([[-1.5, -1.0, -0.125]])  # the proximal policy (trainer's weights)
    weights = importance_weights(old, behaviour, cap=2.0)
    assert weights.tolist()[0] == pytest.approx([math.exp(-0.5), 2.0, 1.0])
