"""LoRA on the actor (``model.lora_rank > 0``), through peft.

What changes against full fine-tuning, and why:

- Only the adapter trains (peft freezes the base); the optimizer holds the adapter only.
- A weight push carries only the adapter (``rlfleet.model.lora``'s wire names, ``B`` scaled by
  ``lora_alpha / r``): a few percent of the model's bytes. Replicas keep the base they loaded
  from ``model.path``, so the trainer's base must be that same model.
  With ``model.lora_push: merged`` it carries every weight with the adapter folded in instead
  (``merged_state``): a full push, for engines that serve adapters slowly (vLLM on CPU).
- The reference policy is the base: reference log-probs are the actor's own forward with the
  adapter switched off (``disable_adapter``), so no second copy of the base is kept anywhere
  and the refcritic is not needed for them.
- A checkpoint is the merged model as a plain Hugging Face directory (what evaluation, vLLM and
  a user load), plus ``adapter/`` (peft ``save_pretrained``); resuming loads the base from
  ``model.path`` and the adapter from ``adapter/``.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from rlfleet.common.config import ModelConfig, RlfleetConfig
from rlfleet.model import lora
from rlfleet.rl.sequences import pack_sequences, response_logprobs, unpack_rows
from rlfleet.trainer.actor import Actor, map_row_groups

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
"""Sub-directory of a checkpoint holding the peft adapter (``adapter_config.json`` and
``adapter_model.safetensors``)."""
PEFT_PREFIX = "base_model.model."
"""What peft puts before the wrapped model's own module names."""


def _peft():
    try:
        import peft
    except ImportError as exc:
        raise ImportError("model.lora_rank > 0 needs peft: pip install 'rlfleet[lora]'") from exc
    return peft


def lora_config(cfg: ModelConfig):
    """peft's ``LoraConfig`` for a causal LM from ``model.*``."""
    LoraConfig = _peft().LoraConfig  # noqa: N806 - peft's class

    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=cfg.target_modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model, cfg: ModelConfig, adapter: Path | None = None):
    """``model`` with a fresh LoRA adapter (B = 0: the start equals the base), or with the one
    saved in ``adapter`` (a checkpoint's ``adapter/``)."""
    peft = _peft()
    if adapter is not None:
        return peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    return peft.get_peft_model(model, lora_config(cfg))


def lora_layers(model, adapter: str = "default"):
    """``(base weight name, peft LoRA layer)`` for every layer adapter ``adapter`` wraps."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            yield name.removeprefix(PEFT_PREFIX) + ".weight", module


def adapter_state(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """Adapter ``adapter`` in ``rlfleet.model.lora``'s wire form: per wrapped weight ``A`` and
    the scaled ``B`` (detached; ``B`` is a new tensor, ``A`` a view of the parameter)."""
    state = {}
    for base, layer in lora_layers(model, adapter):
        if getattr(layer, "fan_in_fan_out", False):
            raise NotImplementedError(f"LoRA push of fan_in_fan_out layer {base} is not built")
        a = layer.lora_A[adapter].weight.detach()
        b = layer.lora_B[adapter].weight.detach() * layer.scaling[adapter]
        state[lora.adapter_name(base, "A")] = a
        state[lora.adapter_name(base, "B")] = b
    return state


def merged_state(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """Every weight of the wrapped model under its plain name (as ``model.path`` has it), with
    adapter ``adapter`` folded into the layers it wraps: ``W + scale * B @ A`` (new tensors);
    the other weights are the parameters themselves (detached), tied ones once."""
    deltas = {
        base: (layer.lora_B[adapter].weight * layer.scaling[adapter]) @ layer.lora_A[adapter].weight
        for base, layer in lora_layers(model, adapter)
    }
    state = {}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        plain = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        weight = param.detach()
        state[plain] = weight + deltas[plain].to(weight.dtype) if plain in deltas else weight
    return state


class LoraActor(Actor):
    """The actor over a peft model: adapter-only (or merged) pushes, reference = adapter off."""

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            if self.config.model.lora_push == "merged":
                return merged_state(self.model)
            return adapter_state(self.model)

    @torch.no_grad()
    def ref_logprobs(
        self, prompts: list[list[int]], responses: list[list[int]]
    ) -> list[list[float]]:
        """Per-token log-probs under the base (adapter off), at the sampling temperature like
        the actor's and the refcritic's (so the KL of an unchanged policy is 0); at most
        ``trainer.ppo_micro_batch_size`` rows per forward, as ``logprobs``."""
        self.model.eval()
        size = self.cfg.ppo_micro_batch_size
        return map_row_groups(prompts, responses, size, self._base_logprobs_of)

    def _base_logprobs_of(self, prompts: list[list[int]], responses: list[list[int]]) -> list:
        packed = pack_sequences(prompts, responses, self.pad_id, self.device)
        temperature = self.config.rollout.temperature or 1.0
        with self.model.disable_adapter():
            out = response_logprobs(self.model, packed, temperature)
        return unpack_rows(out, packed.response_lengths)

    def save_hf(self, path: Path, tokenizer) -> Path:
        """The merged model as a plain HF directory at ``path``, the adapter in ``adapter/``."""
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path / ADAPTER_DIR, safe_serialization=True)
        merged = copy.deepcopy(self.model).merge_and_unload()
        merged.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        return path


def build_lora_actor(config: RlfleetConfig, pad_id: int, resumed: Path | None) -> LoraActor:
    """Base from ``model.path`` (what replicas hold), adapter fresh or from ``resumed``."""
    from rlfleet.model.model_io import load_causal_lm

    base = load_causal_lm(config.model.path, config.model.dtype, config.model.attn_implementation)
    adapter = resumed / ADAPTER_DIR if resumed is not None else None
    if adapter is not None and not adapter.is_dir():
        raise FileNotFoundError(f"{resumed} holds no LoRA adapter ({ADAPTER_DIR}/)")
    model = wrap(base, config.model, adapter)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA r=%d on %s: %d of %d parameters train",
        config.model.lora_rank,
        config.model.target_modules,
        trainable,
        total,
    )
    return LoraActor(config, model, pad_id)
