"""``trainer.weight_check``: the parity probe after each weight push (``rlfleet.trainer.weight_check``).

Why config: the probe costs an actor forward and one RPC per replica per push, and its bound
depends on the dtypes the actor and the engines compute in. Measured with teacher-forced
probabilities (max over tokens of ``|p_replica - p_actor|``, the quantity of verl's
``training/rollout_probs_diff_max``): the same weights in bf16 against fp32 differ by 0.011 on
the tiny model and 0.031 on SmolLM2-135M; fp32 against fp32 by 0 (transformers both sides).
Weights off by Gaussian noise of std 1e-3 differ by 0.035 (tiny) and 0.041 (SmolLM2), scaled
by 1.01 by 0.075 (tiny). Hence the default bound: 0.01 when both sides compute in fp32, 0.1
when either computes in bf16 (3x SmolLM2's bf16 rounding).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfleet.common.config.base import Section

FP32_BOUND = 0.01
"""The default bound when the actor and the engines both compute in fp32."""
LOW_PRECISION_BOUND = 0.1
"""The default bound when either computes in bf16 or fp16."""
DEFAULT_PROMPTS = [
    "12+34=46",
    "Question: What is 7 times 8? Answer: 7 times 8 is 56.",
]


class WeightCheckConfig(Section):
    enable: bool = False
    """After each weight push, score fixed tokens on every replica that took it
    (``Rollout.ScoreTokens``) and on the actor, and compare: ``weight/parity_max_abs_diff``
    (max over replicas) and ``weight/parity_max_abs_diff/<replica_id>`` in the metrics row;
    a replica over ``max_abs_diff`` is reported (ERROR) and, with ``on_mismatch: drain``,
    taken out of service. Single-process actors only (``trainer.strategy: single``)."""
    every: int = Field(1, ge=1)
    """Probe every this many weight versions (the first push of a run always)."""
    prompts: list[str] = Field(list(DEFAULT_PROMPTS), min_length=1)
    """Texts tokenized by the trainer's tokenizer (no chat template), cut to
    ``rollout.max_model_len`` - 1 tokens (a replica keeps room for one generated token):
    the fixed sequences scored."""
    tokens: int = Field(16, ge=1, le=4096)
    """The last this many tokens of each sequence are scored, each given everything before it
    (teacher forcing); the first token is always context."""
    max_abs_diff: float | None = Field(None, gt=0, le=1)
    """The largest ``|p_replica - p_actor|`` over the scored tokens a replica may show; None:
    0.01 when the actor and the engines compute in fp32, else 0.1 (measurements in
    ``rlfleet.common.config.weight_check``)."""
    on_mismatch: Literal["drain", "warn"] = "drain"
    """``drain``: the router stops routing to the replica (``Router.DrainReplica``; it
    finishes what it holds and exits, and a restarted one registers at version 0 and gets
    the full weights); ``warn``: the ERROR line and the metric only."""
