"""Teacher-forced scoring of given tokens on a replica (``Rollout.ScoreTokens``).

Why: generation tells which tokens the engine picked, not whether it holds the weights the
trainer pushed. Scoring the same fixed tokens on the replica and on the actor answers that
directly (the trainer's parity probe, ``rlfleet.trainer.weight_check``, modelled on verl's
``training/rollout_probs_diff_*`` and NeMo-RL's refit check). Log-probs are
``log_softmax(logits)`` at temperature 1: vLLM's prompt log-probs skip its sampling
processors, and the weights, not the sampling settings, are what is checked.

Plain objects and their validation; ``convert`` maps them to and from proto.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlfleet.rollout.types import INT32_MAX, INT64, InvalidField

MAX_SEQUENCES = 64
"""A probe is a few sequences; more would be a generation workload through the back door."""
MAX_SCORED_TOKENS = 1 << 14
"""Context plus targets over all sequences of one request."""


@dataclass
class ScoredSequence:
    """``target_token_ids`` each scored given ``prompt_token_ids`` and the targets before it."""

    prompt_token_ids: list[int]
    target_token_ids: list[int]


@dataclass
class ScoreRequest:
    sequences: list[ScoredSequence]
    min_weight_version: int = 0
    """Refused (FailedPrecondition) by a replica serving an older version."""

    def validate(self) -> None:
        """InvalidField naming the first bad field."""
        if not 1 <= len(self.sequences) <= MAX_SEQUENCES:
            got = len(self.sequences)
            raise InvalidField("sequences", f"must hold 1 to {MAX_SEQUENCES} sequences, got {got}")
        total = 0
        for i, seq in enumerate(self.sequences):
            _check_ids(f"sequences[{i}].prompt_token_ids", seq.prompt_token_ids)
            _check_ids(f"sequences[{i}].target_token_ids", seq.target_token_ids)
            total += len(seq.prompt_token_ids) + len(seq.target_token_ids)
        if total > MAX_SCORED_TOKENS:
            raise InvalidField("sequences", f"hold {total} tokens, more than {MAX_SCORED_TOKENS}")
        version = self.min_weight_version
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version:
            raise InvalidField("min_weight_version", f"must be an integer >= 0, got {version!r}")
        if version > INT64[1]:
            raise InvalidField("min_weight_version", f"must fit in int64, got {version}")


@dataclass
class TokenScores:
    """Per sequence, the log-prob of each target token; the version and replica that scored."""

    logprobs: list[list[float]]
    weight_version: int
    replica_id: str = ""
    seconds: float = field(default=0.0, compare=False)
    """Wall time of the call as the caller measured it (not on the wire)."""


def _check_ids(name: str, ids: list[int]) -> None:
    if not ids:
        raise InvalidField(name, "must hold at least one token id")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT32_MAX:
            raise InvalidField(name, f"must be token ids in [0, {INT32_MAX}], got {token!r}")
