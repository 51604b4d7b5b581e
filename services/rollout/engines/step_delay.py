"""``rollout.debug_step_delay_s``: the hf engine sleeps at every decoding step (a testing aid).

Why: a test that acts on requests *while they decode* (an update that holds them, a kill
inside that update) needs them still decoding when it acts, however fast or loaded the
machine; the tiny test model decodes its whole budget in well under a second. Listed after
the abort check among the engine's stopping criteria, the sleep also runs on the step that
sees an abort, so stopping requests takes at least one delay: a window a test can land in
without racing. 0 (the default, and in real runs) adds nothing.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import StoppingCriteria


class StepDelay(StoppingCriteria):
    """Sleeps ``delay_s`` at every step (in the engine's thread); never stops a row."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        time.sleep(self.delay_s)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def step_delays(delay_s: float) -> list[StoppingCriteria]:
    """The criteria to append last: ``[StepDelay]``, or none when ``delay_s`` is 0."""
    return [StepDelay(delay_s)] if delay_s > 0 else []
