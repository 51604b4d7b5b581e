"""Packing (prompt, response) token-id pairs into one padded batch, and per-token log-probs.

Why one module: the trainer's actor and the refcritic's reference policy and critic must agree
exactly on which logit scores which response token; an off-by-one here silently trains on the
wrong targets. Everything is a pure function over lists and tensors, one forward per batch.

Layout: prompts are LEFT-padded and responses RIGHT-padded, so every prompt ends in the same
column ``P`` (the longest prompt) and every response starts there::

    [pad pad p0 p1 p2 | r0 r1  r2 ]
    [p0  p1  p2 p3 p4 | r0 pad pad]
                        ^ column P = response_start (here 5; R = 3)

Response token ``t`` sits in column ``P + t`` and is predicted by the model's output at column
``P - 1 + t`` (the *state before* token ``t``: the prompt plus ``r_0..r_{t-1}``). So the
response logits are one contiguous slice, no gather, and the lm-head can be run on the last
``R + 1`` columns only. Position ids count real tokens only (``cumsum(mask) - 1``), so a
left-padded prompt gets the same positions as it would unpadded. Every prompt needs at least
one token: the first response token has to be conditioned on something.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rlfleet.rl.core_algos import logprobs_from_logits


@dataclass
class Packed:
    """A padded batch. Shapes: ``B`` sequences, ``L = P + R`` columns, ``R`` response columns.

    ``input_ids``/``attention_mask``/``position_ids`` are [B, L] (long); ``response_mask`` is
    [B, R] float32, 1.0 on real response tokens. ``response_start`` is ``P``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    response_start: int
    prompt_lengths: list[int]
    response_lengths: list[int]

    @property
    def response_width(self) -> int:
        """``R``: the longest response in the batch."""
        return self.input_ids.shape[1] - self.response_start

    @property
    def responses(self) -> torch.Tensor:
        """Response token ids, right-padded, [B, R]."""
        return self.input_ids[:, self.response_start :]

    @property
    def state_columns(self) -> slice:
        """Columns whose outputs predict (or value the state before) each response token."""
        return slice(self.response_start - 1, self.input_ids.shape[1] - 1)


def _padded_row(prompt: list[int], response: list[int], width_p: int, width_r: int, pad: int):
    left, right = width_p - len(prompt), width_r - len(response)
    ids = [pad] * left + list(prompt) + list(response) + [pad] * right
    mask = [0] * left + [1] * (len(prompt) + len(response)) + [0] * right
    return ids, mask


def _check_pairs(prompts: list[list[int]], responses: list[list[int]]) -> None:
    if not prompts or len(prompts) != len(responses):
        raise ValueError(
            f"need as many prompts as responses, >= 1 (got {len(prompts)}, {len(responses)})"
        )
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


def pack_sequences(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int = 0,
    device: torch.device | str | None = None,
) -> Packed:
    """Pack pairs into the layout in the module docstring. ``pad_id`` only fills masked cells."""
    _check_pairs(prompts, responses)
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    pairs = zip(prompts, responses, strict=True)
    rows = [_padded_row(p, r, width_p, width_r, pad_id) for p, r in pairs]
    input_ids = torch.tensor([ids for ids, _ in rows], dtype=torch.long, device=device)
    attention_mask = torch.tensor([mask for _, mask in rows], dtype=torch.long, device=device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    response_mask = attention_mask[:, width_p:].to(torch.float32)
    lengths = [len(p) for p in prompts], [len(r) for r in responses]
    return Packed(input_ids, attention_mask, position_ids, response_mask, width_p, *lengths)


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward (a DDP wrapper's: the wrapped module's) takes the keyword."""
    inner = getattr(model, "module", model)
    if hasattr(inner, "get_base_model"):  # a peft model passes keywords through to its base
        inner = inner.get_base_model()
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def response_logits(
    model: torch.nn.Module, packed: Packed, share_prompts: bool = True
) -> torch.Tensor:
    """Logits that predict each response token, [B, R, V].

    ``share_prompts`` (the default): when rows repeat a prompt (GRPO's groups), each distinct
    prompt runs once and its rows' responses run on top of its KV cache, see
    ``shared_prompt_logits``; the same logits and gradients as one forward over every row, for
    fewer tokens through the model. Otherwise, or when no prompt repeats or the model cannot
    take a cache, one forward over the packed rows; models that take ``logits_to_keep``
    (most transformers causal LMs) run the lm-head on the last ``R + 1`` columns only.
    """
    if share_prompts and _can_share_prompts(model):
        shared = shared_prompt_logits(model, packed)
        if shared is not None:
            return shared
    extra = {"logits_to_keep": packed.response_width + 1} if accepts_logits_to_keep(model) else {}
    out = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        use_cache=False,
        **extra,
    )
    return out.logits[:, -(packed.response_width + 1) : -1]


def _can_share_prompts(model: torch.nn.Module) -> bool:
    """Two forwards before one backward suit a plain module; DDP's reducer expects one forward
    per backward, so a data-parallel wrapper takes the single forward."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return False
    return accepts_logits_to_keep(model)


def distinct_prompts(packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct left-padded prompts of ``packed``: ``(first, inverse)``, where ``first``
    [U] holds a row index of each distinct prompt and ``inverse`` [B] maps every row to its
    distinct prompt's position in ``first``. Rows compare on ids and mask together, so a pad id
    that is also a real token cannot merge two prompts."""
    start = packed.response_start
    return distinct_rows(
        torch.cat([packed.input_ids[:, :start], packed.attention_mask[:, :start]], dim=1)
    )


def distinct_rows(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, inverse)`` for the distinct rows of ``keys`` [B, K]: ``first`` [U] holds the
    index of each distinct row's first occurrence, ``inverse`` [B] maps every row to its
    distinct row's position in ``first``."""
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.full((len(unique),), len(keys), dtype=torch.long, device=keys.device)
    rows = torch.arange(len(keys), device=keys.device)
    return first.scatter_reduce(0, inverse, rows, reduce="amin"), inverse


def shared_prompt_logits(model: torch.nn.Module, packed: Packed) -> torch.Tensor | None:
    """``response_logits`` computed with one forward per distinct prompt, [B, R, V]; ``None``
    when no prompt repeats (nothing to share).

    Pass 1 runs the U distinct prompts (U rows of P columns) with a KV cache; its last column
    predicts response token 0. The cache is then gathered to the B rows (``index_select``:
    differentiable, so each row's gradient flows back into its prompt's keys and values) and
    pass 2 runs the response columns ``0..R-2`` on top of it, predicting tokens ``1..R-1``.
    Attention masks and positions are the packed ones, so every token sees exactly what it
    sees in the single forward: the logits agree to float rounding. Tokens through the model:
    ``U * P + B * (R - 1)`` instead of ``B * (P + R)``.
    """
    first, inverse = distinct_prompts(packed)
    if len(first) == len(inverse):
        return None
    start, width = packed.response_start, packed.response_width
    prefix = model(
        input_ids=packed.input_ids[first, :start],
        attention_mask=packed.attention_mask[first, :start],
        position_ids=packed.position_ids[first, :start],
        use_cache=True,
        logits_to_keep=1,
    )
    first_token = prefix.logits[:, -1:].index_select(0, inverse)
    if width == 1:
        return first_token
    cache = prefix.past_key_values
    if cache is None:  # a model that returns no cache: take the single forward
        return None
    cache.reorder_cache(inverse)
    rest = model(
        input_ids=packed.input_ids[:, start:-1],
        attention_mask=packed.attention_mask[:, :-1],
        position_ids=packed.position_ids[:, start:-1],
        past_key_values=cache,
        use_cache=True,
    )
    return torch.cat([first_token, rest.logits], dim=1)


def response_logprobs(
    model: torch.nn.Module, packed: Packed, temperature: float = 1.0, share_prompts: bool = True
) -> torch.Tensor:
    """log p(response token t | prompt, earlier response tokens), [B, R]; 0 on padding.

    ``temperature`` divides the logits first (as the sampler did), so the trainer can score
    responses under the distribution they were drawn from.
    """
    logits = response_logits(model, packed, share_prompts).float()  # bf16 under autocast
    if temperature != 1.0:
        logits = logits / temperature
    return logprobs_from_logits(logits, packed.responses) * packed.response_mask


def state_hidden(backbone: torch.nn.Module, packed: Packed) -> torch.Tensor:
    """Last hidden state at each response token's *state before* column, [B, R, H].

    For value models: the value of response token ``t`` is read where the model has seen the
    prompt and ``r_0..r_{t-1}`` (verl's convention), from a backbone without an lm-head.
    """
    out = backbone(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        use_cache=False,
    )
    return out.last_hidden_state[:, packed.state_columns]


def unpack_rows(tensor: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    """Per-sequence Python lists from a right-padded [B, R] tensor: row b keeps lengths[b]."""
    rows = tensor.detach().float().cpu().tolist()
    return [row[:n] for row, n in zip(rows, lengths, strict=True)]


def pad_rows(rows: list[list[float]], width: int, device=None) -> torch.Tensor:
    """Right-pad per-token lists (returns, old values) into a float32 [B, width] tensor."""
    padded = [list(row) + [0.0] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.float32, device=device)


def micro_batches(sort_keys: Sequence, size: int) -> list[list[int]]:
    """Index groups of at most ``size`` sequences, similar keys together (less padding).

    Pass ``(prompt_len, response_len)`` pairs as keys: a group's padded width is its longest
    prompt plus its longest response. Callers put results back by index, so group order is free.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    order = sorted(range(len(sort_keys)), key=sort_keys.__getitem__)
    return [order[i : i + size] for i in range(0, len(order), size)]


def map_micro_batches(
    prompts: list[list[int]],
    responses: list[list[int]],
    size: int,
    fn: Callable[[list[list[int]], list[list[int]]], list],
    keys: list | None = None,
) -> list:
    """``fn`` over micro-batches of similar lengths (or of equal ``keys``, sorted, when given);
    its per-sequence results in input order."""
    if keys is None:
        keys = [(len(p), len(r)) for p, r in zip(prompts, responses, strict=True)]
    results: list = [None] * len(prompts)
    for group in micro_batches(keys, size):
        rows = fn([prompts[i] for i in group], [responses[i] for i in group])
        for index, row in zip(group, rows, strict=True):
            results[index] = row
    return results
