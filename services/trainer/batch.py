"""The batch one training step works on: sampled sequences, their scores, and tensors.

``RolloutBatch`` is filled in stages by the trainer (generate -> score -> log-probs ->
advantages); ``tensors()`` turns the ragged lists into padded ``[B, R]`` tensors with a
response mask, the layout every function in ``rlfleet.rl`` expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlfleet.trainer.data import PromptRecord


@dataclass
class RolloutBatch:
    records: list[PromptRecord] = field(default_factory=list)
    """One entry per sequence (a prompt repeated n times)."""
    prompts: list[list[int]] = field(default_factory=list)
    responses: list[list[int]] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    replica_ids: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    score_errors: int = 0
    data_batches: int = 1
    """Batches of prompts drawn from the data to build this one (DAPO may draw several)."""
    sampling_metrics: dict[str, float] = field(default_factory=dict)
    """How the batch was assembled (DAPO's dynamic sampling rounds, dropped groups)."""
    behaviour_logprobs: list[list[float]] = field(default_factory=list)
    """Log-probs the sampling engine reported (async mode's off-policy correction)."""
    old_logprobs: list[list[float]] = field(default_factory=list)
    ref_logprobs: list[list[float]] = field(default_factory=list)
    values: list[list[float]] = field(default_factory=list)
    baseline_scores: list[float] = field(default_factory=list)
    """ReMax: the score of the greedy response to each sequence's prompt."""
    baseline_texts: list[str] = field(default_factory=list)
    """ReMax: the greedy response per group, in group order (not per sequence)."""
    engine_logprobs: list[list[float]] = field(default_factory=list)
    """Per-token log-probs of every completion as the engine sampled it (kept, not trained on
    unless copied to ``behaviour_logprobs`` for an off-policy update)."""

    def __len__(self) -> int:
        return len(self.responses)

    def add_group(self, record: PromptRecord, group_id: int, result) -> None:
        """Append the n completions of one GenerateResult as one group."""
        for completion in result.completions:
            self.records.append(record)
            self.prompts.append(list(record.token_ids))
            self.responses.append(list(completion.token_ids))
            self.group_ids.append(group_id)
            self.weight_versions.append(result.weight_version)
            self.replica_ids.append(result.replica_id)
            self.finish_reasons.append(completion.finish_reason)
            self.engine_logprobs.append(list(completion.logprobs))

    def select(self, rows: list[int]) -> RolloutBatch:
        """A batch of only ``rows`` (every per-sequence list filtered the same way)."""
        picked = replace(self)  # counters and metrics carry over; per-sequence lists below
        for name, value in vars(self).items():
            if isinstance(value, list) and len(value) == len(self):
                setattr(picked, name, [value[i] for i in rows])
        return picked

    def extend(self, other: RolloutBatch, group_offset: int) -> RolloutBatch:
        """A batch of this one's rows then ``other``'s (its group ids shifted by the offset)."""
        merged = replace(self, score_errors=self.score_errors + other.score_errors)
        for name, mine in vars(self).items():
            theirs = getattr(other, name)
            if isinstance(mine, list) and len(mine) == len(self) and len(theirs) == len(other):
                setattr(merged, name, mine + theirs)
        merged.group_ids = self.group_ids + [g + group_offset for g in other.group_ids]
        return merged

    def engine_logprobs_complete(self) -> bool:
        """Whether the engine reported a log-prob for every sampled token."""
        return len(self.engine_logprobs) == len(self) and all(
            len(lp) == len(r) for lp, r in zip(self.engine_logprobs, self.responses, strict=True)
        )

    def use_engine_logprobs_as_behaviour(self) -> bool:
        """Train with the engine's log-probs as the behaviour policy, if every token has one."""
        complete = self.engine_logprobs_complete()
        if complete:
            self.behaviour_logprobs = self.engine_logprobs
        return complete

    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.responses]


def response_mask(lengths: list[int]):
    """``[B, R]`` float mask, 1 on response tokens."""
    import torch

    width = max(lengths)
    positions = torch.arange(width).unsqueeze(0)
    return (positions < torch.tensor(lengths).unsqueeze(1)).float()


def token_level_rewards(scores: list[float], lengths: list[int]):
    """Outcome reward placed on each sequence's last response token: ``[B, R]``."""
    import torch

    rewards = torch.zeros(len(scores), max(lengths))
    for i, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        rewards[i, length - 1] = score
    return rewards
