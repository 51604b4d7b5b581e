"""Reward-side math that runs before the advantage: KL in the reward, DAPO's overlong shaping,
and DAPO's dynamic-sampling filter.

Pure functions (plus two tiny stateful KL controllers) over ``[B, T]`` tensors, like the rest of
``rlfleet.rl``: ``B`` sequences, ``T`` response tokens, ``response_mask`` 1 on real tokens.

Sources:
- KL penalty in the per-token reward with a fixed or adaptive coefficient: Ziegler et al. 2019,
  "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593 (section 2.2); the same
  shape as InstructGPT (Ouyang et al. 2022, arXiv:2203.02155) and verl's ``apply_kl_penalty``.
- Overlong reward shaping and dynamic sampling: Yu et al. 2025, DAPO, arXiv:2503.14476
  (sections 3.2 and 3.4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlfleet.rl.advantages import GroupIndex, dense_group_ids
from rlfleet.rl.core_algos import KLKind, kl_penalty, masked_mean


def apply_kl_penalty(
    token_level_rewards: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: KLKind = "kl",
) -> tuple[torch.Tensor, float]:
    """Rewards minus ``kl_coef`` * per-token KL(policy || reference), and the batch's mean KL.

    Unlike the KL loss, this KL goes through the advantage estimator (and its normalisation),
    so the policy is paid for staying close to the reference rather than pulled back by a
    separate gradient. ``kl_mean`` is the mean over sequences of each sequence's token-mean KL
    (what the adaptive controller tracks, as in verl). Shapes: ``[B, T]`` in and out.
    """
    kl = kl_penalty(logprob, ref_logprob, kind) * response_mask
    rewards = token_level_rewards - kl_coef * kl
    kl_mean = masked_mean(kl, response_mask, dim=-1).mean().item() if len(kl) else 0.0
    return rewards, kl_mean


class KLController(Protocol):
    """The coefficient of the in-reward KL, updated once per batch."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


@dataclass
class FixedKLController:
    """A constant coefficient (Ziegler et al. 2019, the non-adaptive baseline)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to learn: the coefficient stays put."""


@dataclass
class AdaptiveKLController:
    """Proportional controller that steers the observed KL toward ``target_kl``.

    Ziegler et al. 2019, eq. 2: e = clip(KL / target - 1, -0.2, 0.2);
    beta <- beta * (1 + e * n_steps / horizon). A KL above target raises beta, one below lowers
    it; the clip keeps one noisy batch from swinging it far. ``n_steps`` is the batch size.
    """

    value: float
    target_kl: float
    horizon: int
    history: list[float] = field(default_factory=list)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        self.history.append(self.value)


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    """``fixed`` or ``adaptive`` (verl's ``algorithm.kl_ctrl.type``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl.type {kind!r}; valid: fixed, adaptive")


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, one value <= 0 per response, ``[B]``.

    Truncated answers are often good reasoning cut short; a flat penalty for hitting the limit
    is noisy. DAPO instead ramps the penalty linearly over the last ``buffer_len`` tokens before
    ``max_len``: 0 up to ``max_len - buffer_len``, then -(excess / buffer_len) * factor, reaching
    -factor at ``max_len``. Added to the score before the advantage.
    """
    expected = max_len - buffer_len
    excess = lengths.to(torch.float32) - expected
    return (-excess / buffer_len * penalty_factor).clamp(max=0.0)


def groups_with_signal(scores: torch.Tensor, group_ids: GroupIndex) -> torch.Tensor:
    """DAPO dynamic sampling's filter: keep the samples of groups whose scores differ, ``[B]``.

    A group where every sample scored the same has zero group-relative advantage, so it adds no
    gradient, only dilutes the batch; DAPO drops such groups and samples more prompts until the
    batch is full (that loop is the trainer's). A group of one is kept, as in verl, since it has
    no spread to judge. Returns a bool mask over samples.
    """
    ids = dense_group_ids(group_ids, scores.device)
    n = int(ids.max()) + 1 if ids.numel() else 0
    scores = scores.to(torch.float64)
    high = torch.full((n,), -torch.inf, dtype=scores.dtype).scatter_reduce(0, ids, scores, "amax")
    low = torch.full((n,), torch.inf, dtype=scores.dtype).scatter_reduce(0, ids, scores, "amin")
    size = torch.bincount(ids, minlength=n)
    return ((high > low) | (size == 1))[ids]
