"""The batch one training step works on: sampled sequences, their scores, and tensors.

``RolloutBatch`` is filled in stages (``Collector``: generate -> score -> reference log-probs
and values; ``Trainer.learn``: old log-probs) and keeps ragged per-sequence lists;
``response_mask`` and ``token_level_rewards`` build the padded ``[B, R]`` tensors, the layout
every function in ``rlfleet.rl`` expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rlfleet.common.trajectory import Trajectory
from rlfleet.env.types import EpisodeResult
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
    loss_masks: list[list[int]] = field(default_factory=list)
    """Agent mode: per response token, 1 = sampled by the policy (trained), 0 = a token the
    environment or the chat template added between turns. Empty in single-turn mode (every
    response token is sampled)."""
    episode_ids: list[str] = field(default_factory=list)
    """Agent mode: the episode each row is a branch of (an episode whose agent's calls did not
    form one token-native sequence is several rows, each with the episode's advantage)."""
    token_versions: list[list[int]] = field(default_factory=list)
    """The weight version that sampled every response token (-1 where the mask is 0, agent
    mode): a completion that a weight update crossed (``rollout.update_policy: keep``) holds
    several. The trainer's staleness bound works per token (``rlfleet.trainer.staleness``)."""
    rollout_logprobs: list[list[float]] = field(default_factory=list)
    """The engine's log-probs handed to the loss (``algorithm.rollout_correction``'s bypass
    mode, or the mismatch metrics measured in the update's forward); empty = not needed."""
    rollout_is_weights: list[list[float]] = field(default_factory=list)
    """Decoupled rollout correction: each sampled token's importance weight in the loss."""
    stale_masked_tokens: int = 0
    """Sampled tokens left out of the loss for their age (``async/masked_tokens``)."""
    empty_episodes: int = 0
    """Agent mode: episodes left out because the policy sampled nothing in them (an
    environment that failed before the first turn); counted in ``agent/failed``."""
    agent_metrics: dict[str, float] = field(default_factory=dict)
    """Agent mode: ``agent/*`` metrics of the batch's episodes (turns, tool calls, ends)."""

    def __len__(self) -> int:
        return len(self.responses)

    def prompt_indices(self) -> list[int]:
        """``PromptRecord.index`` of each group's prompt, groups in the order of their rows."""
        first: dict[int, int] = {}
        for row, group in enumerate(self.group_ids):
            first.setdefault(group, row)
        return [self.records[row].index for row in first.values()]

    def add_group(self, record: PromptRecord, group_id: int, result) -> None:
        """Append the n completions of one GenerateResult as one group (each row's version is
        its oldest token's; every token's is in ``token_versions``)."""
        for completion in result.completions:
            self.records.append(record)
            self.prompts.append(list(record.token_ids))
            self.responses.append(list(completion.token_ids))
            self.group_ids.append(group_id)
            versions = completion.versions(result.weight_version)
            self.weight_versions.append(min(versions, default=result.weight_version))
            self.token_versions.append(versions)
            self.replica_ids.append(result.replica_id)
            self.finish_reasons.append(completion.finish_reason)
            self.engine_logprobs.append(list(completion.logprobs))

    def add_episode_group(
        self, record: PromptRecord, group_id: int, results: Sequence[EpisodeResult]
    ) -> None:
        """Append the episodes of one task (``rlfleet.env`` results) as one group, a row per
        branch (``Episode.branches``): its prompt the branch's prompt ids, its response every
        token after them, its loss mask the branch's response mask, its version the oldest
        sampled token's, its score the episode's reward; ``episode_ids`` ties an episode's
        branches together (each gets the episode's advantage: ``trainer.episodes``)."""
        for result in results:
            episode = result.episode
            branches = [b for b in episode.branches() if b.num_sampled]
            if not branches:  # failed before its first turn: nothing to train
                self.empty_episodes += 1
                continue
            for branch in branches:
                self._add_branch(record, group_id, result, branch)

    def _add_branch(
        self, record: PromptRecord, group_id: int, result: EpisodeResult, branch: Trajectory
    ) -> None:
        episode = result.episode
        self.records.append(record)
        self.prompts.append(list(branch.prompt_ids))
        self.responses.append(list(branch.response_ids))
        self.loss_masks.append(list(branch.response_mask))
        self.token_versions.append(list(branch.response_versions))
        self.group_ids.append(group_id)
        self.episode_ids.append(episode.episode_id)
        self.weight_versions.append(max(0, branch.oldest_version))
        self.replica_ids.append("+".join(sorted(set(result.replica_ids))))
        self.finish_reasons.append(str(episode.end_reason))
        self.engine_logprobs.append(list(branch.response_logprobs))
        self.scores.append(float(episode.reward))

    def row_episodes(self) -> list[str] | None:
        """Each row's episode id when every row has one (agent mode), else None."""
        return self.episode_ids if len(self.episode_ids) == len(self) else None

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

    def use_engine_logprobs_as_old(self) -> bool:
        """The engine's log-probs as the PPO old policy, if every token has one."""
        complete = self.engine_logprobs_complete()
        if complete:
            self.old_logprobs = self.engine_logprobs
        return complete

    def use_engine_logprobs_as_behaviour(self) -> bool:
        """Train with the engine's log-probs as the behaviour policy, if every token has one."""
        complete = self.engine_logprobs_complete()
        if complete:
            self.behaviour_logprobs = self.engine_logprobs
        return complete

    def response_lengths(self) -> list[int]:
        """Tokens after each prompt (in agent mode environment tokens included)."""
        return [len(r) for r in self.responses]

    def sampled_lengths(self) -> list[int]:
        """Tokens the policy sampled per row (all of them in single-turn mode)."""
        if len(self.loss_masks) != len(self):
            return self.response_lengths()
        return [sum(mask) for mask in self.loss_masks]

    def row_loss_masks(self) -> list[list[int]] | None:
        """The loss masks when every row has one (agent mode), else None."""
        return self.loss_masks if self.loss_masks and len(self.loss_masks) == len(self) else None


def response_mask(lengths: list[int], loss_masks: list[list[int]] | None = None):
    """``[B, R]`` float mask, 1 on response tokens; with ``loss_masks`` (agent mode) 1 only on
    the tokens the policy sampled, so losses, entropy and KL skip environment tokens."""
    import torch

    width = max(lengths)
    positions = torch.arange(width).unsqueeze(0)
    mask = (positions < torch.tensor(lengths).unsqueeze(1)).float()
    if loss_masks is not None:
        for row, row_mask in enumerate(loss_masks):
            mask[row, : len(row_mask)] *= torch.tensor(row_mask, dtype=mask.dtype)
    return mask


def token_level_rewards(
    scores: list[float], lengths: list[int], loss_masks: list[list[int]] | None = None
):
    """Outcome reward placed on each sequence's last response token: ``[B, R]``. In agent
    mode on the last token the policy sampled, which the response mask keeps."""
    import torch

    rewards = torch.zeros(len(scores), max(lengths))
    for i, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        last = length - 1 if loss_masks is None else last_sampled(loss_masks[i])
        rewards[i, last] = score
    return rewards


def last_sampled(mask: list[int]) -> int:
    """Index of the last sampled (mask 1) token; the last token when none was sampled."""
    for index in range(len(mask) - 1, -1, -1):
        if mask[index]:
            return index
    return max(0, len(mask) - 1)
