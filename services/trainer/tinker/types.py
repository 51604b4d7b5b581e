"""Plain records of the Tinker API, between its HTTP conversions and its core.

No torch, no HTTP: ``convert`` builds these from the SDK's JSON and protobuf bodies, the core
(``service``) reads and answers them. Token ids are lists of ints; per-token loss inputs are
1-D numpy arrays (``[N]`` for a datum of ``N`` input tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Datum:
    """One training sequence: input tokens and its loss inputs by the SDK's names."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]
    """``target_tokens`` (int64 ``[N]``), ``weights``, ``logprobs``, ``advantages`` (float32
    ``[N]``), as the loss asks."""


@dataclass(frozen=True)
class LoraSpec:
    """``create_lora_training_client``'s choices."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class AdamStep:
    """One ``optim_step``'s AdamW hyperparameters (``types.AdamParams``)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class ForwardResult:
    """``forward``/``forward_backward``'s answer: per datum its target log-probs and its
    elementwise loss (``[N]`` float32 each), and the call's metrics (``loss:sum``)."""

    logprobs: list[np.ndarray]
    losses: list[np.ndarray]
    metrics: dict[str, float]


@dataclass(frozen=True)
class SampleSpec:
    """One ``sample`` call: a prompt, how many completions, and how to draw them."""

    prompt: list[int]
    num_samples: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


@dataclass(frozen=True)
class ModelInfo:
    """What ``get_info`` says of a training client."""

    model_id: str
    model_name: str
    """The base model: the fleet's model directory (absolute)."""
    tokenizer_id: str
    """Where ``AutoTokenizer.from_pretrained`` finds the fleet's own tokenizer offline."""
    lora_rank: int
    arch: str


@dataclass(frozen=True)
class Saved:
    """Where ``save_state``/``save_weights_for_sampler``/``load_state`` put or read weights, or
    the sampling session a sampler save created."""

    path: str | None = None
    sampling_session_id: str | None = None
    model_id: str | None = None


@dataclass(frozen=True)
class ServedModel:
    """The fleet's one base model, as the API names and limits it."""

    name: str
    """Its directory, absolute: what ``get_server_capabilities`` lists."""
    aliases: frozenset[str]
    """Other names a client may pass as ``base_model`` (the config's path, the folder name)."""
    tokenizer_id: str
    max_context: int
    """``rollout.max_model_len``: the longest datum, and prompt plus completion."""
    max_rank: int
    vocab: int
    arch: str
    eos_ids: frozenset[int]
    base_state: dict
    """A zero adapter in wire form: pushing it makes replicas serve the plain base."""
