"""What the API refuses, and how it says so: each check raises ``InvalidArgument`` (HTTP 400)
naming the field, the value and the limit, before any work starts. Unsupported features are
refused by name here too, never silently ignored (docs/tinker.md lists them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from rlfleet.common.errors import InvalidArgument
from rlfleet.rl.datum_losses import LOSSES, DatumLoss
from rlfleet.trainer.tinker.types import AdamStep, Datum, LoraSpec, SampleSpec

INT_INPUTS = frozenset({"target_tokens"})


def loss_named(name: str) -> DatumLoss:
    if name not in LOSSES:
        raise InvalidArgument(
            f"loss_fn {name!r} is not supported by this server; it supports {', '.join(LOSSES)}"
        )
    return LOSSES[name]


def loss_config(name: str, loss: DatumLoss, given: Mapping[str, float]) -> dict[str, float]:
    """``given`` over the loss's defaults; an unknown key is refused (never ignored)."""
    unknown = sorted(set(given) - set(loss.config))
    if unknown:
        accepted = ", ".join(loss.config) or "none"
        raise InvalidArgument(
            f"loss_fn_config {unknown} is not accepted by {name!r} (accepted: {accepted})"
        )
    return {**loss.config, **{key: float(value) for key, value in given.items()}}


def datums(data: Sequence[Datum], name: str, loss: DatumLoss, max_tokens: int, vocab: int) -> None:
    """Every datum carries what ``loss`` needs, each ``[N]`` for its ``N`` input tokens, and
    fits the context (``max_tokens``) and the vocabulary."""
    if not data:
        raise InvalidArgument("forward_backward needs at least one datum")
    for i, datum in enumerate(data):
        _datum(i, datum, name, loss, max_tokens, vocab)


def _datum(i: int, d: Datum, name: str, loss: DatumLoss, max_tokens: int, vocab: int) -> None:
    n = len(d.tokens)
    if not 0 < n <= max_tokens:
        raise InvalidArgument(
            f"datum {i} has {n} tokens; this server takes 1 to {max_tokens} "
            "(the fleet's context, rollout.max_model_len)"
        )
    required = ("target_tokens", *loss.inputs)
    missing = [key for key in required if key not in d.inputs]
    unknown = sorted(set(d.inputs) - set(required) - set(loss.optional))
    if missing or unknown:
        raise InvalidArgument(
            f"datum {i}: loss_fn {name!r} takes loss_fn_inputs "
            f"{list(required)} (optional {list(loss.optional)}); "
            f"missing {missing}, not accepted {unknown}"
        )
    for key, value in d.inputs.items():
        if value.shape != (n,):
            raise InvalidArgument(
                f"datum {i}: loss_fn_inputs[{key!r}] has shape "
                f"{list(value.shape)}, expected [{n}] (one per input token)"
                + (
                    " (2-D targets, top-K distillation, are not supported)"
                    if value.ndim == 2
                    else ""
                )
            )
        if key not in INT_INPUTS and not np.isfinite(value).all():
            raise InvalidArgument(f"datum {i}: loss_fn_inputs[{key!r}] holds NaN or infinity")
    _token_ids(f"datum {i}: model_input", d.tokens, vocab)
    _token_ids(f"datum {i}: target_tokens", d.inputs["target_tokens"].tolist(), vocab)


def _token_ids(what: str, ids: Sequence[int], vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidArgument(
            f"{what} holds token ids {bad[:5]} outside the vocabulary [0, {vocab})"
        )


def lora_spec(spec: LoraSpec, max_rank: int) -> None:
    if not 1 <= spec.rank <= max_rank:
        raise InvalidArgument(
            f"LoRA rank {spec.rank} is not served: this fleet serves ranks 1 "
            f"to {max_rank} (model.lora_rank)"
        )
    if spec.train_unembed:
        raise InvalidArgument(
            "train_unembed=True (LoRA on the unembedding) is not supported by "
            "this server: pass train_unembed=False"
        )
    if not (spec.train_attn or spec.train_mlp):
        raise InvalidArgument("train_attn and train_mlp are both False: nothing to train")


def adam(step: AdamStep) -> None:
    values = (
        step.learning_rate,
        step.beta1,
        step.beta2,
        step.eps,
        step.weight_decay,
        step.grad_clip_norm,
    )
    if not all(np.isfinite(values)) or step.learning_rate < 0 or step.eps <= 0:
        raise InvalidArgument(f"adam_params {step} must be finite, learning_rate >= 0, eps > 0")
    if not (0 <= step.beta1 < 1 and 0 <= step.beta2 < 1):
        raise InvalidArgument(
            f"adam_params betas must be in [0, 1), got {step.beta1}, {step.beta2}"
        )


def sample(spec: SampleSpec, max_model_len: int, vocab: int) -> int:
    """The ``max_tokens`` to generate (``max_model_len`` minus the prompt when unset)."""
    if not 1 <= spec.num_samples <= 1024:
        raise InvalidArgument(f"num_samples must be 1 to 1024, got {spec.num_samples}")
    _token_ids("prompt", spec.prompt, vocab)
    room = max_model_len - len(spec.prompt)
    wanted = spec.max_tokens if spec.max_tokens is not None else room
    if not spec.prompt or wanted < 1 or wanted > room:
        raise InvalidArgument(
            f"a prompt of {len(spec.prompt)} tokens with max_tokens "
            f"{spec.max_tokens} does not fit the fleet's context of "
            f"{max_model_len} tokens (rollout.max_model_len)"
        )
    return wanted


def stop_strings(stop: object, eos_ids: set[int]) -> list[str]:
    """The SDK's ``stop`` as stop strings: None (end of sequence only), a string, strings, or
    end-of-sequence token ids; other token ids and ``[]`` (no stop at all) are refused."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, list) or not stop:
        raise InvalidArgument("stop=[] (no end-of-sequence stop) is not supported; leave it unset")
    if all(isinstance(s, str) for s in stop):
        return list(stop)
    if all(isinstance(s, int) for s in stop) and set(stop) <= eos_ids:
        return []
    raise InvalidArgument(
        f"stop token ids {stop} are not supported (only the end-of-sequence "
        f"ids {sorted(eos_ids)}, or stop strings)"
    )
