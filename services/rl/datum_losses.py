"""Per-token losses of one sequence (a Tinker "datum"), summed, never averaged.

Why a module apart from ``rlfleet.rl.losses``: that one is the trainer's batch loss (masked
means over ``[B, T]``, KL, entropy); these are the four losses a client of the Tinker-compatible
API (``rlfleet.trainer.tinker``) names in ``forward_backward``, with the Tinker SDK's documented
inputs and definitions. Each takes ``[N]`` tensors of one datum (``N`` = its token count, input
position ``i`` predicting target token ``i``) and returns the ``[N]`` elementwise loss; the
datum's loss is its sum and a call's loss (``loss:sum``) the sum over its datums, so callers
choose their own normalisation through ``weights`` (cross-entropy) or ``advantages``.

- ``cross_entropy``: ``-weights * log p(target)`` (maximum likelihood; weights 0 on prompt).
- ``importance_sampling``: ``-(p / q) * A``, the REINFORCE estimator (Williams 1992) for
  tokens sampled by another policy ``q`` (the sampler), corrected by the importance ratio.
- ``ppo``: ``-min(r A, clip(r, lo, hi) A)``, PPO's clipped surrogate (Schulman et al. 2017,
  arXiv:1707.06347), token-wise; ``lo, hi`` default 0.8, 1.2.
- ``cispo``: ``-sg(clip(r, lo, hi)) * log p * A``, CISPO (MiniMax-M1, arXiv:2506.13585): the
  clipped ratio only weights the log-likelihood gradient, so no token's gradient is dropped;
  ``lo, hi`` default 0 and 4 (an upper cap only), as the SDK documents.

RL losses also take an optional per-token ``weights`` (default 1), which multiplies each
token's loss: a datum weighted 0 or 0.5 as a whole is ``weights`` filled with that value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

Inputs = Mapping[str, torch.Tensor]
"""A datum's loss inputs by the SDK's names, each ``[N]`` (``target_tokens`` int64, others
float32)."""


def cross_entropy(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[N]`` target log-probs, ``[N]`` weights -> ``[N]`` loss ``-weights * logprobs``."""
    return -logprobs * weights


def importance_sampling(
    logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """``[N]`` learner and sampler log-probs, ``[N]`` advantages -> ``[N]`` loss
    ``-exp(logprobs - sampling_logprobs) * advantages``."""
    return -torch.exp(logprobs - sampling_logprobs) * advantages


def ppo(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.8,
    clip_high: float = 1.2,
) -> torch.Tensor:
    """``[N]`` inputs as ``importance_sampling`` -> ``[N]`` loss
    ``-min(r * A, clamp(r, clip_low, clip_high) * A)`` with ``r = exp(logprobs - sampling)``."""
    ratio = torch.exp(logprobs - sampling_logprobs)
    clipped = torch.clamp(ratio, clip_low, clip_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.0,
    clip_high: float = 4.0,
) -> torch.Tensor:
    """``[N]`` inputs as ``importance_sampling`` -> ``[N]`` loss
    ``-detach(clamp(r, clip_low, clip_high)) * logprobs * A``."""
    ratio = torch.exp(logprobs - sampling_logprobs).detach()
    return -torch.clamp(ratio, clip_low, clip_high) * logprobs * advantages


@dataclass(frozen=True)
class DatumLoss:
    """One loss as the API offers it: what a datum must carry, and the loss of one datum."""

    inputs: tuple[str, ...]
    """Required ``loss_fn_inputs`` besides ``target_tokens``."""
    optional: tuple[str, ...]
    """Accepted ``loss_fn_inputs`` that have a default."""
    config: Mapping[str, float]
    """Accepted ``loss_fn_config`` keys and their defaults."""
    fn: Callable[[torch.Tensor, Inputs, Mapping[str, float]], torch.Tensor]
    """``(target log-probs [N], inputs, config) -> [N]`` elementwise loss."""


def _weights(x: Inputs, like: torch.Tensor) -> torch.Tensor:
    return x["weights"] if "weights" in x else torch.ones_like(like)


def _ce(lp: torch.Tensor, x: Inputs, c: Mapping[str, float]) -> torch.Tensor:
    return cross_entropy(lp, x["weights"])


def _is(lp: torch.Tensor, x: Inputs, c: Mapping[str, float]) -> torch.Tensor:
    return importance_sampling(lp, x["logprobs"], x["advantages"]) * _weights(x, lp)


def _ppo(lp: torch.Tensor, x: Inputs, c: Mapping[str, float]) -> torch.Tensor:
    loss = ppo(
        lp, x["logprobs"], x["advantages"], c["clip_low_threshold"], c["clip_high_threshold"]
    )
    return loss * _weights(x, lp)


def _cispo(lp: torch.Tensor, x: Inputs, c: Mapping[str, float]) -> torch.Tensor:
    loss = cispo(
        lp, x["logprobs"], x["advantages"], c["clip_low_threshold"], c["clip_high_threshold"]
    )
    return loss * _weights(x, lp)


RL_INPUTS = ("logprobs", "advantages")
LOSSES: dict[str, DatumLoss] = {
    "cross_entropy": DatumLoss(("weights",), (), {}, _ce),
    "importance_sampling": DatumLoss(RL_INPUTS, ("weights",), {}, _is),
    "ppo": DatumLoss(
        RL_INPUTS, ("weights",), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, _ppo
    ),
    "cispo": DatumLoss(
        RL_INPUTS, ("weights",), {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, _cispo
    ),
}
"""The losses ``forward_backward`` accepts, by the SDK's names."""
