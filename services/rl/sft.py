"""Supervised fine-tuning: the negative log-likelihood of the demonstrated tokens.

The SFT stage of the InstructGPT recipe (Ouyang et al. 2022, arXiv:2203.02155): maximise the
log-probability of the assistant's tokens of demonstration conversations, and only those (the
user's turns and the template's markup around them are context, not targets). The trainer's
``trainer.mode: sft`` uses it as a warm-up on an answer format before RL, with the same data
loader, checkpoints and weight pushes as the RL modes.

Shapes: ``B`` sequences, ``T`` response tokens (everything after the first prompt);
``loss_mask`` is 1 on the tokens to learn.
"""

from __future__ import annotations

import torch

from rlfleet.rl.core_algos import LossAggMode, agg_loss


def sft_loss(
    logprob: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: LossAggMode = "token-mean"
) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy of the masked tokens, aggregated like the RL losses.

    Args:
        logprob: ``[B, T]`` log-probability of each target token under the model.
        loss_mask: ``[B, T]``, 1 on tokens that are trained (assistant turns), 0 elsewhere.
        loss_agg_mode: how per-token losses become one number (``rlfleet.rl.core_algos``).

    Returns:
        The scalar loss and ``{"train/loss": loss}`` (verl's SFT trainer's name; with
        ``token-mean`` it is the mean negative log-likelihood per trained token, and
        ``exp`` of it their perplexity).
    """
    loss = agg_loss(-logprob, loss_mask, loss_agg_mode)
    return loss, {"train/loss": float(loss.detach())}
