"""What a refcritic request must look like before any model sees it.

Why check up front: an out-of-vocabulary id makes the embedding lookup raise deep inside torch
(or, on a GPU, corrupt the device state), and a sequence longer than the model's positions gives
silently wrong numbers. Checking here turns both into ``InvalidArgument`` naming the sequence,
so the caller learns what was wrong and the service keeps serving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfleet.common.errors import InvalidArgument

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class SequenceBatch:
    """Prompt and response token ids of each sequence (plain lists, as they arrive)."""

    prompts: list[list[int]]
    responses: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.responses]


@dataclass
class BatchLimits:
    """What the loaded model accepts: ids in [0, vocab_size), at most max_length tokens."""

    vocab_size: int
    max_length: int | None = None

    @classmethod
    def of(cls, model: PreTrainedModel) -> BatchLimits:
        """Limits of a transformers model: its embedding rows and its position count."""
        vocab = model.get_input_embeddings().num_embeddings
        return cls(vocab, getattr(model.config, "max_position_embeddings", None))


def _check_ids(ids: list[int], vocab_size: int, where: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if i < 0 or i >= vocab_size)
        raise InvalidArgument(f"{where}: token id {bad} outside the vocabulary [0, {vocab_size})")


def _check_sequence(index: int, prompt: list[int], response: list[int], limits: BatchLimits):
    if not prompt:
        raise InvalidArgument(f"sequence {index}: the prompt is empty (need >= 1 token)")
    if not response:
        raise InvalidArgument(f"sequence {index}: the response is empty (need >= 1 token)")
    _check_ids(prompt, limits.vocab_size, f"sequence {index} prompt")
    _check_ids(response, limits.vocab_size, f"sequence {index} response")
    total = len(prompt) + len(response)
    if limits.max_length is not None and total > limits.max_length:
        raise InvalidArgument(
            f"sequence {index}: {total} tokens exceed the model's limit of {limits.max_length}"
        )


def validate_batch(batch: SequenceBatch, limits: BatchLimits) -> None:
    """Raise InvalidArgument unless the batch is non-empty and every sequence fits the model."""
    if len(batch.prompts) != len(batch.responses):
        raise InvalidArgument(f"{len(batch.prompts)} prompts but {len(batch.responses)} responses")
    if not batch.prompts:
        raise InvalidArgument("the batch is empty")
    for index, (prompt, response) in enumerate(zip(batch.prompts, batch.responses, strict=True)):
        _check_sequence(index, prompt, response, limits)


def validate_rows(rows: list[list[float]], batch: SequenceBatch, name: str) -> None:
    """Raise InvalidArgument unless ``rows`` holds one finite value per response token."""
    if len(rows) != len(batch):
        raise InvalidArgument(f"{name}: {len(rows)} rows for {len(batch)} sequences")
    for index, (row, length) in enumerate(zip(rows, batch.response_lengths, strict=True)):
        if len(row) != length:
            raise InvalidArgument(
                f"{name}: row {index} has {len(row)} values for {length} response tokens"
            )
        if not all(math.isfinite(v) for v in row):
            raise InvalidArgument(f"{name}: row {index} holds a NaN or infinity")
