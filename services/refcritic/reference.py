"""The frozen reference policy: log-probs of responses under the starting weights.

Why a separate, frozen copy: the KL term (k1..k3, low_var_kl) keeps the actor near the policy it
started from, so the reference must never move. It is loaded once from ``model.path``, put in
eval mode with gradients off, and only ever run under ``torch.no_grad``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from rlfleet.common.config import RlfleetConfig
from rlfleet.model.model_io import load_causal_lm
from rlfleet.refcritic.inputs import BatchLimits, SequenceBatch, validate_batch
from rlfleet.rl.sequences import (
    map_micro_batches,
    pack_sequences,
    response_logprobs,
    unpack_rows,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def pick_device() -> torch.device:
    """The first GPU when there is one, else the CPU (no config knob: one device per process)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pad_id_of(model: PreTrainedModel) -> int:
    """A token id to fill masked cells with; any valid id works, the model's own pad if it has one."""
    pad = getattr(model.config, "pad_token_id", None)
    return pad if isinstance(pad, int) and pad >= 0 else 0


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode and no gradients: the reference is a constant of the run."""
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


class RefPolicy:
    """Reference log-probs, computed in micro-batches of ``refcritic.micro_batch_size``."""

    def __init__(self, config: RlfleetConfig) -> None:
        torch.set_num_threads(config.refcritic.torch_threads)
        self.device = pick_device()
        model = load_causal_lm(
            config.model.path, config.model.dtype, config.model.attn_implementation
        )
        self.model = freeze(model.to(self.device))
        self.limits = BatchLimits.of(self.model)
        self.pad_id = pad_id_of(self.model)
        self.micro_batch_size = config.refcritic.micro_batch_size
        # The actor scores tokens at the sampling temperature (the distribution they were drawn
        # from); the reference must too, or the KL of an unchanged policy is not 0 (verl alike).
        self.temperature = config.rollout.temperature or 1.0
        log.info("reference policy ready on %s (%s)", self.device, config.model.path)

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """log p_ref(response token t | prefix) for every response token, one list per sequence."""
        validate_batch(SequenceBatch(prompts, responses), self.limits)
        return map_micro_batches(prompts, responses, self.micro_batch_size, self._micro_batch)

    @torch.no_grad()
    def _micro_batch(self, prompts: list[list[int]], responses: list[list[int]]):
        packed = pack_sequences(prompts, responses, self.pad_id, self.device)
        logprobs = response_logprobs(self.model, packed, self.temperature)
        return unpack_rows(logprobs, packed.response_lengths)
