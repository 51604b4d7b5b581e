"""The transformers ``generate`` backend: needs nothing but torch, for machines without vLLM.

Why micro-batching: RL rollouts arrive as many concurrent requests (one per prompt, ``n``
samples each). Running them one by one wastes the model's batch dimension, so requests that
arrive within ``rollout.hf_batch_wait_ms`` of each other and share sampling settings go through
one left-padded ``model.generate`` call (their ``n`` samples are repeated rows). One call runs
at a time, in a worker thread, so the event loop keeps serving RPCs and Redis. Requests
submitted in the same event-loop tick always share a call, whatever the window (even 0): the
batcher wakes on the first and collects the rest a tick later. That is what a packed queue
entry (a whole step's share for this replica) relies on; ``batches`` counts the calls.

Log-probs come from the raw logits: ``log_softmax(logits / T)`` at the sampled token, ``T = 1``
for greedy. That is what the trainer recomputes for the actor; it does not include top-p/top-k
truncation. They are taken as generation goes, not from ``output_logits``, which keeps every
step's full-vocabulary logits until the call ends (256 steps x 32 rows x 49,152 floats is 1.6 GB,
and the stack/scale/log_softmax copies made the replica peak near 8 GB): a forward hook on the
model turns each step's last-position logits into ``log_softmax(logits / T)`` (the hook sees the
model's own output, so no logits processor, penalty or warper has touched it, whatever order
``generate`` runs them in) and a stopping criterion, called once the step's token is in
``input_ids``, keeps that token's value and drops the rest. Memory is one step's
``rows x vocab`` instead of ``steps x rows x vocab``. Rows that ended (EOS, abort, budget) get
their padding's log-probs, cut with the padding.

Seeds: ``generate`` takes no ``torch.Generator``, so a request with a seed runs alone under
``torch.random.fork_rng`` + ``torch.manual_seed(seed)``: the same seed, prompt and settings give
the same completions, and the global RNG stream of unseeded requests is left untouched.

Abort: a stopping criterion ends the rows of aborted requests at the next decoding step (their
completions come back with finish reason ``abort``); requests still queued are answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from rlfleet.common.config import RlfleetConfig
from rlfleet.model import lora
from rlfleet.rl.sequences import accepts_logits_to_keep, distinct_rows
from rlfleet.rollout.engines.base import Engine, check_state_dict, tokens_until_stop
from rlfleet.rollout.engines.step_delay import step_delays
from rlfleet.rollout.types import Completion, SamplingParams

log = logging.getLogger(__name__)

MAX_ROWS_PER_CALL = 512
"""Upper bound on sequences in one ``generate`` call (a request's ``n`` rows never split)."""


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    started: bool = False
    aborted: bool = False
    abort_step: int | None = None

    def batch_key(self) -> tuple:
        """Requests with equal keys may share a ``generate`` call; seeded ones never do.
        ``max_tokens`` is not part of it: each row stops at its own budget, so requests
        continued after a weight update (``update_policy: keep``, budgets reduced) share a
        call with new ones instead of splitting the batch."""
        s = self.sampling
        if s.seed is not None:
            return ("seeded", id(self))
        return (s.temperature, s.top_p, s.top_k)


def plan_batches(requests: list[_Request]) -> list[list[_Request]]:
    """Group by batch key, in arrival order, each group at most MAX_ROWS_PER_CALL rows."""
    groups: dict[tuple, list[list[_Request]]] = {}
    for request in requests:
        chunks = groups.setdefault(request.batch_key(), [[]])
        rows = sum(r.sampling.n for r in chunks[-1])
        if chunks[-1] and rows + request.sampling.n > MAX_ROWS_PER_CALL:
            chunks.append([])
        chunks[-1].append(request)
    return [chunk for chunks in groups.values() for chunk in chunks]


class _AbortRows(StoppingCriteria):
    """Stops the rows of aborted requests (remembering at which step each was aborted) and
    the rows whose request's ``max_tokens`` is reached (the call runs to the largest)."""

    def __init__(self, owners: list[_Request], prompt_width: int) -> None:
        self.owners = owners
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        for request in self.owners:
            done = step >= request.sampling.max_tokens  # then it ended by length, whole
            if request.aborted and request.abort_step is None and not done:
                request.abort_step = step
        flags = [r.aborted or step >= r.sampling.max_tokens for r in self.owners]
        return torch.tensor(flags, dtype=torch.bool, device=input_ids.device)


class _StepLogprobs(StoppingCriteria):
    """Each step's log-prob of the token it chose, taken as ``generate`` goes (module
    docstring): ``record`` (a forward hook) keeps ``log_softmax(raw logits / T)`` of the step
    just run, the criterion call that follows the step's token gathers it and drops the rest.
    Never stops a row."""

    def __init__(self, temperature: float) -> None:
        self.scale = temperature if temperature > 0 else 1.0
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    @contextlib.contextmanager
    def hooked(self, model: Any) -> Iterator[None]:
        """``record`` on ``model``'s forward for the block (removed after, even on error)."""
        handle = model.register_forward_hook(self.record)
        try:
            yield
        finally:
            handle.remove()

    def record(self, module: Any, args: Any, output: Any) -> None:
        """A forward ran: its last position is the step's distribution. A later forward before
        the token is chosen (a chunked prefill) replaces it, as in ``generate``."""
        logits = output.logits[:, -1].float()  # what generate samples from, before processors
        self.pending = torch.log_softmax(logits / self.scale, dim=-1)

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if self.pending is None:
            raise RuntimeError("a decoding step without a forward pass: log-probs would shift")
        self.steps.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def table(self, rows: int, width: int) -> torch.Tensor:
        """``[rows, width]`` log-probs of the first ``width`` new tokens (steps ``generate``
        undid, if any, are past ``width``)."""
        if len(self.steps) < width:
            raise RuntimeError(f"{width} new tokens but {len(self.steps)} recorded log-probs")
        if width == 0:
            return torch.zeros(rows, 0)
        return torch.stack(self.steps[:width], dim=1)


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
        self._pending: list[_Request] = []
        self._requests: dict[str, _Request] = {}
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
        self._model = load_causal_lm(model.path, model.dtype, model.attn_implementation)
        self._eos_ids = _eos_ids(self._model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._eos_ids)
        self._shapes, self._tied = _param_shapes(self._model)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> list[Completion]:
        future = asyncio.get_running_loop().create_future()
        request = _Request(request_id, list(prompt_token_ids), sampling, future)
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

    async def _run_group(self, group: list[_Request]) -> None:
        for request in group:
            request.started = True
        self.batches += 1
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

    def _generate_sync(self, group: list[_Request]) -> list[list[Completion]]:
        owners = [r for r in group for _ in range(r.sampling.n)]
        ids, mask = _left_pad([r.prompt for r in owners], self._pad_id)
        sampling = group[0].sampling
        picked = _StepLogprobs(sampling.temperature)
        with torch.no_grad(), _seeded(sampling.seed):
            cache = shared_prompt_cache(self._model, ids, mask)  # before the hook: not a step
            with picked.hooked(self._model):
                sequences = self._model.generate(
                    input_ids=ids, attention_mask=mask,
                    max_new_tokens=max(r.sampling.max_tokens for r in group),
                    past_key_values=cache,
                    pad_token_id=self._pad_id, eos_token_id=sorted(self._eos_ids),
                    return_dict_in_generate=False,  # the ids only: nothing kept per step
                    stopping_criteria=StoppingCriteriaList([
                        _AbortRows(owners, ids.shape[1]), picked,
                        *step_delays(self.config.rollout.debug_step_delay_s)]),  # delay last
                    **_sampling_kwargs(sampling),
                )  # fmt: skip
        rows = iter(_row_results(sequences, ids.shape[1], picked))
        return [[self._completion(r, *next(rows)) for _ in range(r.sampling.n)] for r in group]

    def _completion(
        self, request: _Request, row: list[int], row_logprobs: list[float]
    ) -> Completion:
        tokens, reason = _cut_row(row, self._eos_ids, request.abort_step, request.sampling)
        tokens, hit_stop = tokens_until_stop(
            tokens, lambda t: self.tokenizer.decode(t, skip_special_tokens=True),
            request.sampling.stop,
        )  # fmt: skip
        text, _ = self.decode(tokens, request.sampling.stop)
        logprobs = row_logprobs[: len(tokens)] if request.sampling.logprobs else []
        return Completion(tokens, logprobs, text, "stop" if hit_stop else reason)

    async def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Full weights, or a LoRA adapter (``rlfleet.model.lora``) merged over the base."""
        if lora.is_adapter_update(state_dict):
            pairs = lora.adapter_pairs(state_dict)
            lora.check_pairs(pairs, self._shapes)
            async with self._model_lock:
                await asyncio.to_thread(self._adapter.apply, self._model.state_dict(), pairs)
            return
        check_state_dict(state_dict, self._shapes, self._tied)
        async with self._model_lock:
            await asyncio.to_thread(self._copy_weights, state_dict)
            self._adapter.forget()

    def weight_numel(self) -> int:
        return sum(t.numel() for t in self._model.state_dict().values()) if self._model else 0

    def _copy_weights(self, state_dict: Mapping[str, Any]) -> None:
        params = self._model.state_dict()
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if name not in self._tied:  # a tied copy would overwrite its twin
                    params[name].copy_(tensor)

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


def shared_prompt_cache(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any | None:
    """A KV cache of every row's prompt but its last token, computed once per distinct prompt
    and gathered to the rows (``n`` samples of a request repeat its prompt); ``None`` when no
    prompt repeats or prompts are one column wide (nothing to share).

    ``generate`` given this cache runs only the last prompt column for all rows, then decodes
    as usual: the same logits to float rounding, a prefill of ``U * (W - 1) + B`` tokens instead
    of ``B * W``. No random numbers are drawn here, so seeded sampling is unchanged.
    """
    if ids.shape[1] < 2:
        return None
    first, inverse = distinct_rows(torch.cat([ids, mask], dim=1))
    if len(first) == len(inverse):
        return None
    prefix_mask = mask[first, :-1]
    out = model(
        input_ids=ids[first, :-1],
        attention_mask=prefix_mask,
        position_ids=(prefix_mask.cumsum(-1) - 1).clamp_min(0),
        use_cache=True,
        **({"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}),
    )
    cache = out.past_key_values
    if cache is not None:
        cache.reorder_cache(inverse)
    return cache


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask


def _sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    if sampling.temperature == 0:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": max(sampling.top_k, 0)}  # fmt: skip


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _row_results(
    sequences: torch.Tensor, prompt_width: int, picked: _StepLogprobs
) -> list[tuple[list, list]]:
    """(new token ids, their log-probs) per row."""
    new = sequences[:, prompt_width:]
    logprobs = picked.table(*new.shape)
    return list(zip(new.tolist(), logprobs.tolist(), strict=True))


def _cut_row(
    tokens: list[int], eos_ids: set[int], abort_step: int | None, sampling: SamplingParams
) -> tuple[list[int], str]:
    """Tokens up to and including the first EOS ("stop"), else up to the abort step ("abort"),
    else up to the request's ``max_tokens`` ("length"; a row of a call that ran longer for
    other requests is padded past it)."""
    limit = min(len(tokens), sampling.max_tokens)
    limit = limit if abort_step is None else min(abort_step, limit)
    eos_at = next((i for i, t in enumerate(tokens[:limit]) if t in eos_ids), None)
    if eos_at is not None:
        return tokens[: eos_at + 1], "stop"
    if abort_step is not None:
        return tokens[:limit], "abort"
    return tokens[: sampling.max_tokens], "length"
