"""Sequence packing, reference log-probs and the critic, on a tiny random Qwen2 (no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import random_qwen2

from rlfleet.common.config import RlfleetConfig, load_config
from rlfleet.common.errors import InvalidArgument, NotFound
from rlfleet.refcritic.critic import Critic
from rlfleet.refcritic.inputs import BatchLimits, SequenceBatch, validate_batch, validate_rows
from rlfleet.refcritic.reference import RefPolicy
from rlfleet.rl.sequences import (
    map_micro_batches,
    micro_batches,
    pack_sequences,
    pad_rows,
    response_logprobs,
    unpack_rows,
)

VOCAB = 16
PROMPTS = [[1, 4, 5], [1, 6, 7, 8, 9, 10], [1], [1, 11, 12, 13]]
RESPONSES = [[5, 6], [7], [8, 9, 10, 11, 2], [12, 13, 2]]


def tiny_qwen2(attn: str = "sdpa", seed: int = 0):
    return random_qwen2(64, 2, 4, 2, VOCAB, seed, pad_token_id=0, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_qwen2().save_pretrained(path)
    return path


def make_config(model_dir: Path, *overrides: str) -> RlfleetConfig:
    return load_config(overrides=[f"model.path={model_dir}", *overrides], env={})


def naive_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """One unpadded sequence at a time: the definition response_logprobs must match."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0]
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)]


# ---- sequences -----------------------------------------------------------------------------


def test_pack_left_pads_prompts_and_right_pads_responses():
    packed = pack_sequences([[1, 2, 3], [4]], [[5], [6, 7, 8]], pad_id=0)
    assert packed.input_ids.tolist() == [[1, 2, 3, 5, 0, 0], [0, 0, 4, 6, 7, 8]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert packed.position_ids[1, 2:].tolist() == [0, 1, 2, 3]
    assert packed.position_ids[0, :4].tolist() == [0, 1, 2, 3]
    assert packed.response_start == 3 and packed.response_width == 3
    assert packed.response_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert packed.responses.tolist() == [[5, 0, 0], [6, 7, 8]]
    assert packed.response_lengths == [1, 3] and packed.prompt_lengths == [3, 1]


def test_pack_rejects_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt"):
        pack_sequences([[1], []], [[2], [3]])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_response_logprobs_match_one_sequence_at_a_time(attn: str):
    model = tiny_qwen2(attn)
    packed = pack_sequences(PROMPTS, RESPONSES, pad_id=0)
    with torch.no_grad():
        batched = response_logprobs(model, packed)
    assert batched.shape == (len(PROMPTS), max(map(len, RESPONSES)))
    for row, prompt, response in zip(
        unpack_rows(batched, packed.response_lengths), PROMPTS, RESPONSES, strict=True
    ):
        assert row == pytest.approx(naive_logprobs(model, prompt, response), abs=1e-5)
    assert torch.all(batched[packed.response_mask == 0] == 0)


def test_temperature_divides_logits():
    model = tiny_qwen2()
    packed = pack_sequences(PROMPTS, RESPONSES)
    with torch.no_grad():
        hot, cold = response_logprobs(model, packed, 2.0), response_logprobs(model, packed)
    assert not torch.allclose(hot, cold)
    assert torch.all(hot <= 0)


def test_unpack_and_pad_rows_round_trip():
    rows = [[0.5], [1.0, 2.0, 3.0]]
    padded = pad_rows(rows, 3)
    assert padded.tolist() == [[0.5, 0.0, 0.0], [1.0, 2.0, 3.0]]
    assert unpack_rows(padded, [1, 3]) == rows


def test_micro_batches_cover_every_index_once_grouped_by_length():
    keys = [(5, 1), (1, 1), (5, 2), (1, 2), (3, 3)]
    groups = micro_batches(keys, 2)
    assert sorted(i for g in groups for i in g) == list(range(5))
    assert all(len(g) <= 2 for g in groups)
    assert groups[0] == [1, 3]
    with pytest.raises(ValueError):
        micro_batches(keys, 0)


def test_map_micro_batches_returns_results_in_input_order():
    prompts = [[1] * n for n in (4, 1, 3, 2)]
    responses = [[2]] * 4
    seen = []

    def lengths(ps, rs):
        seen.append(len(ps))
        return [len(p) for p in ps]

    assert map_micro_batches(prompts, responses, 3, lengths) == [4, 1, 3, 2]
    assert seen == [3, 1]


# ---- batch validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "responses", "message"),
    [
        ([], [], "empty"),
        ([[1]], [[]], "response is empty"),
        ([[]], [[1]], "prompt is empty"),
        ([[1, 16]], [[2]], "token id 16"),
        ([[1]], [[-1]], "token id -1"),
        ([[1] * 30], [[2] * 3], "33 tokens"),
        ([[1], [1]], [[2]], "2 prompts but 1"),
    ],
)
def test_bad_batches_are_invalid_arguments(prompts, responses, message):
    with pytest.raises(InvalidArgument, match=message):
        validate_batch(SequenceBatch(prompts, responses), BatchLimits(VOCAB, 32))


def test_rows_must_match_the_responses():
    batch = SequenceBatch([[1], [1]], [[2, 3], [4]])
    validate_rows([[0.0, 1.0], [2.0]], batch, "returns")
    with pytest.raises(InvalidArgument, match="1 rows for 2"):
        validate_rows([[0.0, 1.0]], batch, "returns")
    with pytest.raises(InvalidArgument, match="row 1 has 2 values"):
        validate_rows([[0.0, 1.0], [2.0, 3.0]], batch, "returns")
    with pytest.raises(InvalidArgument, match="NaN"):
        validate_rows([[0.0, float("nan")], [2.0]], batch, "old_values")


# ---- reference policy --------------------------------------------------------------------------


def test_reference_is_frozen_and_matches_the_model(model_dir: Path):
    ref = RefPolicy(make_config(model_dir, "refcritic.micro_batch_size=3"))
    assert not any(p.requires_grad for p in ref.model.parameters())
    rows = ref.logprobs(PROMPTS, RESPONSES)
    local = tiny_qwen2()
    for row, prompt, response in zip(rows, PROMPTS, RESPONSES, strict=True):
        assert row == pytest.approx(naive_logprobs(local, prompt, response), abs=1e-5)


def test_reference_scores_at_the_sampling_temperature(model_dir: Path):
    """The actor's log-probs are taken at ``rollout.temperature``; the reference's must be too,
    or an unchanged policy would have a non-zero KL."""
    hot = RefPolicy(make_config(model_dir, "rollout.temperature=0.5"))
    plain = RefPolicy(make_config(model_dir))
    packed = pack_sequences(PROMPTS, RESPONSES, hot.pad_id)
    expected = unpack_rows(response_logprobs(plain.model, packed, 0.5), packed.response_lengths)
    for row, want, at_one in zip(
        hot.logprobs(PROMPTS, RESPONSES), expected, plain.logprobs(PROMPTS, RESPONSES), strict=True
    ):
        assert row == pytest.approx(want, abs=1e-5)
        assert row != pytest.approx(at_one, abs=1e-3)


def test_reference_rejects_out_of_vocab_ids(model_dir: Path):
    ref = RefPolicy(make_config(model_dir))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        ref.logprobs([[1, 2]], [[VOCAB + 3]])


# ---- critic ----------------------------------------------------------------------------------


def returns_for(responses: list[list[int]]) -> list[list[float]]:
    """Fixed per-token targets: 1.0 on even tokens, -0.5 on odd ones."""
    return [[1.0 if tok % 2 == 0 else -0.5 for tok in r] for r in responses]


def test_values_have_one_number_per_response_token_and_start_at_zero(model_dir: Path):
    critic = Critic(make_config(model_dir))
    values = critic.values(PROMPTS, RESPONSES)
    assert [len(v) for v in values] == [len(r) for r in RESPONSES]
    assert all(v == 0.0 for row in values for v in row)


def test_updates_on_a_fixed_batch_reduce_the_value_loss(model_dir: Path):
    critic = Critic(make_config(model_dir, "refcritic.critic_lr=1e-2"))
    returns = returns_for(RESPONSES)
    losses = []
    for _ in range(8):
        old = critic.values(PROMPTS, RESPONSES)
        metrics = critic.update(PROMPTS, RESPONSES, returns, old, epochs=1, micro_batch_size=2)
        losses.append(metrics["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0]
    assert critic.step == 8
    assert set(metrics) == {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/grad_norm",
        "critic/vpred_mean",
        "critic/lr",
    }
    assert metrics["critic/lr"] == pytest.approx(1e-2)


def test_micro_batch_size_does_not_change_the_update(model_dir: Path):
    """Token-share weighting makes accumulated micro-batches equal one whole-batch step."""
    results = []
    for size in (1, len(PROMPTS)):
        critic = Critic(make_config(model_dir, "refcritic.critic_lr=1e-2"))
        zeros = [[0.0] * len(r) for r in RESPONSES]
        for _ in range(2):
            critic.update(PROMPTS, RESPONSES, returns_for(RESPONSES), zeros, 1, size)
        results.append(critic.values(PROMPTS, RESPONSES))
    for a, b in zip(*results, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_update_rejects_rows_that_do_not_match(model_dir: Path):
    critic = Critic(make_config(model_dir))
    old = [[0.0] * len(r) for r in RESPONSES]
    with pytest.raises(InvalidArgument, match="returns"):
        critic.update(PROMPTS, RESPONSES, old[:-1], old)
    with pytest.raises(InvalidArgument, match="old_values: row 0"):
        critic.update(PROMPTS, RESPONSES, old, [[0.0]] + old[1:])
    assert critic.step == 0


def test_save_then_load_restores_weights_optimizer_and_step(model_dir: Path, tmp_path: Path):
    config = make_config(model_dir, "refcritic.critic_lr=1e-2")
    returns, zeros = returns_for(RESPONSES), [[0.0] * len(r) for r in RESPONSES]
    first = Critic(config)
    for _ in range(2):
        first.update(PROMPTS, RESPONSES, returns, zeros)
    saved_values = first.values(PROMPTS, RESPONSES)
    assert first.save(tmp_path / "critic") == str((tmp_path / "critic").resolve())
    first.update(PROMPTS, RESPONSES, returns, zeros)

    second = Critic(config)
    second.load(tmp_path / "critic")
    assert second.step == 2
    assert second.values(PROMPTS, RESPONSES) == saved_values
    second.update(PROMPTS, RESPONSES, returns, zeros)  # same Adam moments -> same next step
    for a, b in zip(
        second.values(PROMPTS, RESPONSES), first.values(PROMPTS, RESPONSES), strict=True
    ):
        assert a == pytest.approx(b, abs=1e-6)


def test_loading_a_missing_checkpoint_is_not_found(model_dir: Path, tmp_path: Path):
    with pytest.raises(NotFound):
        Critic(make_config(model_dir)).load(tmp_path / "nothing")
