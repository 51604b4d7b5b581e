"""The pieces of the hf engine's ``generate`` calls: a queued request, how requests group
into calls, one call's inputs (left padding, a shared prompt cache, sampling settings, a seed),
its per-step log-probs and stopping criteria, and where each row is cut.

Why apart from ``hf``: the engine is the queue around the model (collect, run, answer, load
weights); this is what happens inside one call, testable on a tiny model without an engine.

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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import StoppingCriteria

from rlfleet.rl.sequences import accepts_logits_to_keep, distinct_rows
from rlfleet.rollout.types import SamplingParams

MAX_ROWS_PER_CALL = 512
"""Upper bound on sequences in one ``generate`` call (a request's ``n`` rows never split)."""


@dataclass(eq=False)
class QueuedRequest:
    """A ``generate`` call's caller, from submission until its future is answered."""

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


def plan_batches(requests: list[QueuedRequest]) -> list[list[QueuedRequest]]:
    """Group by batch key, in arrival order, each group at most MAX_ROWS_PER_CALL rows."""
    groups: dict[tuple, list[list[QueuedRequest]]] = {}
    for request in requests:
        chunks = groups.setdefault(request.batch_key(), [[]])
        rows = sum(r.sampling.n for r in chunks[-1])
        if chunks[-1] and rows + request.sampling.n > MAX_ROWS_PER_CALL:
            chunks.append([])
        chunks[-1].append(request)
    return [chunk for chunks in groups.values() for chunk in chunks]


class AbortRows(StoppingCriteria):
    """Stops the rows of aborted requests (remembering at which step each was aborted) and
    the rows whose request's ``max_tokens`` is reached (the call runs to the largest)."""

    def __init__(self, owners: list[QueuedRequest], prompt_width: int) -> None:
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


class StepLogprobs(StoppingCriteria):
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


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask


def sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    if sampling.temperature == 0:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {
        "do_sample": True,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": max(sampling.top_k, 0),
    }


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def row_results(
    sequences: torch.Tensor, prompt_width: int, picked: StepLogprobs
) -> list[tuple[list, list]]:
    """(new token ids, their log-probs) per row."""
    new = sequences[:, prompt_width:]
    logprobs = picked.table(*new.shape)
    return list(zip(new.tolist(), logprobs.tolist(), strict=True))


def cut_row(
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
