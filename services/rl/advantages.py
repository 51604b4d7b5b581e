"""Advantage estimators and the one typed entry the trainer calls.

Every estimator is a pure function over ``[B, T]`` tensors (``B`` sequences, ``T`` response
tokens; ``response_mask`` is 1 on real tokens). ``compute_advantage`` takes what any estimator
may read (``AdvantageInputs``) and the knobs (``AdvantageParams``), so the controller needs no
per-estimator branches: a new estimator is one function and one line in ``ESTIMATORS``.

Sources:
- GRPO group-normalised outcome advantage: Shao et al. 2024, DeepSeekMath, arXiv:2402.03300.
- Dr. GRPO (no std normalisation): Liu et al. 2025, arXiv:2503.20783.
- RLOO leave-one-out baseline: Ahmadian et al. 2024, arXiv:2402.14740.
- REINFORCE++ (discounted return, batch-whitened): Hu 2025, arXiv:2501.03262; its
  ``_baseline`` variant (group mean subtracted first, then batch-whitened) is the same paper's
  REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262v3).
- ReMax (the greedy response's reward as the baseline): Li et al. 2023, arXiv:2310.10505.
- GAE: Schulman et al. 2015, arXiv:1506.02438.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch

from rlfleet.rl.core_algos import masked_sum, masked_whiten

GroupIndex: TypeAlias = Sequence | torch.Tensor
EstimatorName = Literal[
    "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"
]


def dense_group_ids(group_index: GroupIndex, device: torch.device) -> torch.Tensor:
    """Map any group labels (uid strings, ints, a tensor) to dense ids 0..G-1, shape [B]."""
    if isinstance(group_index, torch.Tensor):
        return torch.unique(group_index, return_inverse=True)[1].to(device)
    dense: dict = {}
    ids = [dense.setdefault(label, len(dense)) for label in group_index]
    return torch.tensor(ids, dtype=torch.long, device=device)


def branch_weights(episode_index: GroupIndex, device: torch.device) -> torch.Tensor:
    """Each row's weight in its group's statistics, [B]: 1 / the rows of its episode.

    An agent's episode may be several rows (branches: its calls did not form one sequence),
    each with the episode's score. Weighted so, a group's count, mean and std are its
    episodes' own, and every branch gets its episode's advantage.
    """
    ids = dense_group_ids(episode_index, device)
    return 1.0 / torch.bincount(ids).to(torch.get_default_dtype())[ids]


def _group_stats(scores: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None = None):
    """Per-sample (group mean, unbiased group std, group size), each [B]; with ``weights``
    (``branch_weights``) a group's size counts episodes, not rows.

    A group of one has no spread to compare against: it gets mean 0 and std 1, so its
    advantage is its raw score (as in verl).
    """
    n_groups = int(ids.max()) + 1 if ids.numel() else 0
    w = torch.ones_like(scores) if weights is None else weights.to(scores)
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, w)
    mean = torch.zeros_like(count).index_add_(0, ids, w * scores) / count.clamp_min(1)
    sq_dev = torch.zeros_like(count).index_add_(0, ids, w * (scores - mean[ids]) ** 2)
    std = (sq_dev / (count - 1).clamp_min(1)).sqrt()
    single = count[ids] < 1.5  # one sample (or one episode's branches, weighing 1 together)
    return mean[ids].masked_fill(single, 0.0), std[ids].masked_fill(single, 1.0), count[ids]


def grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each sample's score relative to the other samples of its prompt, no critic needed.

    Args: rewards and mask [B, T]; ``group_index`` [B], one label per prompt group;
    ``weights`` [B] (``branch_weights``): rows that are branches of one episode count once.
    ``norm_by_std=False`` keeps only the mean baseline (Dr. GRPO style).
    Returns (advantages [B, T], returns [B, T]); both are the same broadcast score.
    """
    scores = masked_sum(token_level_rewards, response_mask, dim=-1)  # outcome score, [B]
    mean, std, _ = _group_stats(scores, dense_group_ids(group_index, scores.device), weights)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    eps: float = 1e-6,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: baseline is the mean score of the *other* samples in the group (unbiased).

    score_i - mean(others) equals n/(n-1) * (score_i - group mean). A group of one keeps its raw
    score. ``eps`` is accepted for a uniform signature with GRPO and unused; ``weights`` as
    in GRPO (n counts episodes).
    Returns (advantages [B, T], returns [B, T]).
    """
    scores = masked_sum(token_level_rewards, response_mask, dim=-1)  # outcome score, [B]
    mean, _, count = _group_stats(scores, dense_group_ids(group_index, scores.device), weights)
    scale = torch.where(count > 1.5, count / (count - 1).clamp_min(1), torch.ones_like(count))
    adv = (scale * (scores - mean)).unsqueeze(-1) * response_mask
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float):
    """Reward-to-go per token, [B, T]; the running sum restarts at masked tokens."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


def reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return per token, whitened over the whole batch (global baseline).

    Returns (advantages [B, T], returns [B, T]).
    """
    returns = _discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


def reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: score minus its group's mean, then whitened over the whole batch.

    The group mean removes the prompt's difficulty (as in GRPO) without dividing by a group std
    that is tiny for nearly-solved prompts; the batch-wide whitening then sets one global scale.
    A group of one keeps its raw score before whitening (as in verl).
    Returns (advantages [B, T], returns [B, T]), the same tensor twice as in verl.
    """
    scores = masked_sum(token_level_rewards, response_mask, dim=-1)  # outcome score, [B]
    mean, _, _ = _group_stats(scores, dense_group_ids(group_index, scores.device), weights)
    centred = (scores - mean).unsqueeze(-1) * response_mask
    adv = masked_whiten(centred, response_mask)
    return adv, adv


def remax_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, baseline_scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the reward of the greedy response to the same prompt.

    The greedy answer is a per-prompt baseline that costs one extra generation instead of a
    critic or a group of samples. ``baseline_scores`` [B] is that reward, repeated for every
    sample of the prompt. Returns (advantages [B, T], returns = undiscounted reward-to-go [B, T]).
    """
    returns = _discounted_returns(token_level_rewards, response_mask, 1.0)
    baseline = baseline_scores.to(returns.dtype).unsqueeze(-1) * response_mask
    return (returns - baseline) * response_mask, returns


def gae_advantage(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) with a critic. All inputs [B, T].

    Masked tokens are skipped, not treated as terminal: the next value and the running GAE pass
    through them unchanged, so padding (or tool output inside a response) never leaks a value.
    Returns (advantages whitened over the mask [B, T], returns = raw advantages + values [B, T]).
    """
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    raw = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = response_mask[:, t].bool()
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        raw[:, t] = gae_t
        next_value = torch.where(m, values[:, t], next_value)
        last_gae = torch.where(m, gae_t, last_gae)
    returns = (raw + values) * response_mask
    return masked_whiten(raw, response_mask), returns


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read. Tensors are ``[B, T]``; ``group_index`` is ``[B]``."""

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_index: GroupIndex | None = None
    """One label per prompt group (group estimators: grpo, rloo)."""
    episode_index: GroupIndex | None = None
    """One label per episode, ``[B]``, when an episode may be several rows (an agent's
    branches): group estimators then count episodes (``branch_weights``)."""
    values: torch.Tensor | None = None
    """Critic values per response token (gae)."""
    baseline_scores: torch.Tensor | None = None
    """Reward of the greedy response to each sample's prompt, ``[B]`` (remax)."""


@dataclass(frozen=True)
class AdvantageParams:
    """The estimator and its knobs (from ``algorithm.*`` in the config)."""

    estimator: EstimatorName = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True


def _require(value, what: str, estimator: str):
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {what}")
    return value


def _weights(x: AdvantageInputs) -> torch.Tensor | None:
    if x.episode_index is None:
        return None
    return branch_weights(x.episode_index, x.response_mask.device)


def _grpo(p: AdvantageParams, x: AdvantageInputs):
    groups = _require(x.group_index, "group_index", p.estimator)
    return grpo_outcome_advantage(
        x.token_level_rewards,
        x.response_mask,
        groups,
        norm_by_std=p.norm_by_std,
        weights=_weights(x),
    )


def _rloo(p: AdvantageParams, x: AdvantageInputs):
    groups = _require(x.group_index, "group_index", p.estimator)
    return rloo_outcome_advantage(
        x.token_level_rewards, x.response_mask, groups, weights=_weights(x)
    )


def _reinforce_pp(p: AdvantageParams, x: AdvantageInputs):
    return reinforce_plus_plus_advantage(x.token_level_rewards, x.response_mask, p.gamma)


def _reinforce_pp_baseline(p: AdvantageParams, x: AdvantageInputs):
    groups = _require(x.group_index, "group_index", p.estimator)
    return reinforce_plus_plus_baseline_advantage(
        x.token_level_rewards, x.response_mask, groups, _weights(x)
    )


def _remax(p: AdvantageParams, x: AdvantageInputs):
    what = "baseline_scores (the reward of a greedy response per prompt)"
    baseline = _require(x.baseline_scores, what, p.estimator)
    return remax_advantage(x.token_level_rewards, x.response_mask, baseline)


def _gae(p: AdvantageParams, x: AdvantageInputs):
    values = _require(x.values, "critic values", p.estimator)
    return gae_advantage(x.token_level_rewards, values, x.response_mask, p.gamma, p.lam)


ESTIMATORS: dict[str, Callable[[AdvantageParams, AdvantageInputs], tuple]] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce_plus_plus": _reinforce_pp,
    "reinforce_plus_plus_baseline": _reinforce_pp_baseline,
    "remax": _remax,
    "gae": _gae,
}


def compute_advantage(
    params: AdvantageParams, inputs: AdvantageInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]) from the estimator ``params.estimator``."""
    if params.estimator not in ESTIMATORS:
        valid = ", ".join(sorted(ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {params.estimator!r}; valid: {valid}")
    return ESTIMATORS[params.estimator](params, inputs)
