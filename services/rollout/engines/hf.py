"""The transformers ``generate`` backend: needs nothing but torch, for machines without vLLM.

Why micro-batching: RL rollouts arrive as many concurrent requests (one per prompt, ``n``
samples each). Running them one by one wastes the model's batch dimension, so requests that
arrive within ``rollout.hf_batch_wait_ms`` of each other and share sampling settings go through
one left-padded ``model.generate`` call (their ``n`` samples are repeated rows). One call runs
at a time, in a worker thread, so the event loop keeps serving RPCs and Redis. Requests
submitted in the same event-loop tick always share a call, whatever the window (even 0): the
batcher wakes on the first and collects the rest a tick later. That is what a packed queue
entry (a whole step's share for this replica) relies on; ``batches`` counts the calls.

Abort: a stopping criterion ends the rows of aborted requests at the next decoding step (their
completions come back with finish reason ``abort``); requests still queued are answered at once.

What one call is made of (the queued request, the grouping into calls, the per-step
log-probs, the stopping criteria, where each row is cut) is ``hf_batch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import StoppingCriteriaList

from rlfleet.common.config import RlfleetConfig
from rlfleet.model import lora
from rlfleet.rollout.engines import element_writes
from rlfleet.rollout.engines.base import (
    Engine,
    StagedWeights,
    check_state_dict,
    tokens_until_stop,
)
from rlfleet.rollout.engines.hf_batch import (
    AbortRows,
    QueuedRequest,
    StepLogprobs,
    cut_row,
    left_pad,
    plan_batches,
    row_results,
    sampling_kwargs,
    seeded,
    shared_prompt_cache,
)
from rlfleet.rollout.engines.step_delay import step_delays
from rlfleet.rollout.types import Completion, SamplingParams

log = logging.getLogger(__name__)


class HFEngine(Engine):
    """transformers ``generate`` with micro-batching; see the module docstring."""

    name = "hf"

    def __init__(self, config: RlfleetConfig) -> None:
        super().__init__(config)
        self.batch_wait_s = config.rollout.hf_batch_wait_ms / 1000
        """How long the batcher collects requests after the first (``rollout.hf_batch_wait_ms``)."""
        self._model: Any = None
        self._pad_id = 0
        self._eos_ids: set[int] = set()
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._tied: frozenset[str] = frozenset()
        self._adapter = lora.MergedAdapter()
        self._pending: list[QueuedRequest] = []
        self._requests: dict[str, QueuedRequest] = {}
        self._wake = asyncio.Event()
        self._model_lock = asyncio.Lock()
        self._loop_task: asyncio.Task | None = None

    @property
    def model(self) -> Any:
        """The transformers model being served (None before ``start``). Read it, never write
        it: weights change through ``load_weights`` only."""
        return self._model

    @property
    def adapter_merged(self) -> bool:
        """True while a LoRA adapter is merged over the base weights."""
        return bool(self._adapter.base)

    def has_started(self, request_id: str) -> bool:
        """True once the request runs in a ``generate`` call (False while queued or unknown)."""
        request = self._requests.get(request_id)
        return request is not None and request.started

    async def start(self) -> None:
        torch.set_num_threads(self.config.rollout.torch_threads)
        await asyncio.to_thread(self._load)
        self._loop_task = asyncio.create_task(self._batch_loop(), name="hf-batcher")

    def _load(self) -> None:
        from rlfleet.model.model_io import load_causal_lm, load_tokenizer

        self.tokenizer = load_tokenizer(self.config.model.path)
        model = self.config.model
        self._model = load_causal_lm(model.path, self.dtype, model.attn_implementation)
        self._eos_ids = _eos_ids(self._model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._eos_ids)
        self._shapes, self._tied = _param_shapes(self._model)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> list[Completion]:
        future = asyncio.get_running_loop().create_future()
        request = QueuedRequest(request_id, list(prompt_token_ids), sampling, future)
        self._requests[request_id] = request
        self._pending.append(request)
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            request.aborted = True  # a running batch stops this request's rows
            raise
        finally:
            self._requests.pop(request_id, None)
            with contextlib.suppress(ValueError):
                self._pending.remove(request)

    async def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        request.aborted = True
        if not request.started and not request.future.done():
            aborted = Completion([], [], "", "abort")
            request.future.set_result([aborted] * request.sampling.n)

    async def interrupt(self) -> int:
        """Abort every request: running rows stop at the next step with their tokens so far,
        queued ones are answered at once with none."""
        live = list(self._requests)
        for request_id in live:
            await self.abort(request_id)
        return len(live)

    async def _batch_loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.batch_wait_s)
            self._wake.clear()
            batch, self._pending = self._pending, []
            for group in plan_batches(batch):
                live = [r for r in group if not r.future.done()]
                if live:
                    await self._run_group(live)

    async def _run_group(self, group: list[QueuedRequest]) -> None:
        for request in group:
            request.started = True
        self.batches += 1
        results: list[list[Completion]] | list[Exception]
        try:
            async with self._model_lock:
                results = await asyncio.to_thread(self._generate_sync, group)
        except Exception as exc:  # noqa: BLE001 - each waiter gets the error
            log.exception("generate failed for %d requests", len(group))
            results = [exc] * len(group)
        for request, result in zip(group, results, strict=True):
            if request.future.done():
                continue
            if isinstance(result, Exception):
                request.future.set_exception(result)
            else:
                request.future.set_result(result)

    def _generate_sync(self, group: list[QueuedRequest]) -> list[list[Completion]]:
        owners = [r for r in group for _ in range(r.sampling.n)]
        ids, mask = left_pad([r.prompt for r in owners], self._pad_id)
        sampling = group[0].sampling
        picked = StepLogprobs(sampling.temperature)
        with torch.no_grad(), seeded(sampling.seed):
            cache = shared_prompt_cache(self._model, ids, mask)  # before the hook: not a step
            with picked.hooked(self._model):
                sequences = self._model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max(r.sampling.max_tokens for r in group),
                    past_key_values=cache,
                    pad_token_id=self._pad_id,
                    eos_token_id=sorted(self._eos_ids),
                    return_dict_in_generate=False,  # the ids only: nothing kept per step
                    stopping_criteria=StoppingCriteriaList(
                        [
                            AbortRows(owners, ids.shape[1]),
                            picked,
                            *step_delays(self.config.rollout.debug_step_delay_s),
                        ]
                    ),  # delay last
                    **sampling_kwargs(sampling),
                )
        rows = iter(row_results(sequences, ids.shape[1], picked))
        return [[self._completion(r, *next(rows)) for _ in range(r.sampling.n)] for r in group]

    def _completion(
        self, request: QueuedRequest, row: list[int], row_logprobs: list[float]
    ) -> Completion:
        tokens, reason = cut_row(row, self._eos_ids, request.abort_step, request.sampling)
        tokens, hit_stop = tokens_until_stop(
            tokens,
            lambda t: self.tokenizer.decode(t, skip_special_tokens=True),
            request.sampling.stop,
        )
        text, _ = self.decode(tokens, request.sampling.stop)
        logprobs = row_logprobs[: len(tokens)] if request.sampling.logprobs else []
        return Completion(tokens, logprobs, text, "stop" if hit_stop else reason)

    async def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Full weights, or a LoRA adapter (``rlfleet.model.lora``) merged over the base."""
        await (await self.stage_weights(state_dict)).apply()

    async def stage_weights(
        self, state_dict: Mapping[str, Any], changes: Mapping[str, Any] | None = None
    ) -> StagedWeights:
        """Checks now; the swap copies the weights into the parameters, or with ``changes``
        (a delta) writes only the changed elements (``element_writes``, prepared now)."""
        if lora.is_adapter_update(state_dict):
            pairs = lora.adapter_pairs(state_dict)
            lora.check_pairs(pairs, self._shapes)
            return StagedWeights(lambda: self._locked(self._merge_adapter, pairs))
        check_state_dict(state_dict, self._shapes, self._tied)
        writes = None
        if changes is not None and not self.adapter_merged:
            params = self._model.state_dict()
            writes = await asyncio.to_thread(element_writes.prepare, params, changes, self._tied)
        if writes is None:
            return StagedWeights(lambda: self._locked(self._copy_weights, state_dict))
        count = element_writes.count(writes)
        return StagedWeights(lambda: self._locked(self._write_elements, writes), changed=count)

    async def _locked(self, swap: Callable[[Any], None], argument: Any) -> None:
        async with self._model_lock:
            await asyncio.to_thread(swap, argument)

    def _merge_adapter(self, pairs: Mapping[str, Any]) -> None:
        self._adapter.apply(self._model.state_dict(), pairs)

    def _write_elements(self, writes: list[element_writes.ElementWrite]) -> None:
        element_writes.write_all(writes)
        self._adapter.forget()

    async def score_tokens(self, prompt: list[int], targets: list[int]) -> list[float]:
        """One forward over prompt + targets, never beside a swap or a generate call."""
        async with self._model_lock:
            return await asyncio.to_thread(teacher_forced, self._model, prompt, targets)

    def weight_numel(self) -> int:
        return sum(t.numel() for t in self._model.state_dict().values()) if self._model else 0

    def _copy_weights(self, state_dict: Mapping[str, Any]) -> None:
        params = self._model.state_dict()
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if name not in self._tied:  # a tied copy would overwrite its twin
                    params[name].copy_(tensor)
        self._adapter.forget()

    async def flush_cache(self) -> bool:
        """Nothing to flush: ``generate`` keeps no KV cache between calls."""
        return True

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for request in self._pending:
            if not request.future.done():
                request.future.set_exception(RuntimeError("engine closed"))
        self._pending = []


@torch.no_grad()
def teacher_forced(model: Any, prompt: list[int], targets: list[int]) -> list[float]:
    """``log_softmax(logits)`` in float32 of each target given everything before it."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + targets], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.tensor(targets, device=device).unsqueeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, picked).squeeze(-1).tolist()


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    ids.discard(None)
    if not ids:
        raise ValueError("the model has no EOS token id")
    return ids


def _param_shapes(model: Any) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """Shapes of every parameter; names sharing storage with an earlier one (tied) are optional."""
    shapes, tied, seen = {}, set(), set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            tied.add(name)
            continue
        seen.add(tensor.data_ptr())
        shapes[name] = tuple(tensor.shape)
    return shapes, frozenset(tied)
