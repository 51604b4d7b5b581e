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


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward (a DDP wrapper's: the wrapped module's) takes the keyword."""
    inner = getattr(model, "module", model)
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def response_logits(model: torch.nn.Module, packed: Packed) -> torch.Tensor:
    """Logits that predict each response token, [B, R, V], from one forward pass.

    Models that take ``logits_to_keep`` (most transformers causal LMs) run the lm-head on the
    last ``R + 1`` columns only, which matters when the vocabulary is large.
    """
    extra = {"logits_to_keep": packed.response_width + 1} if _accepts_logits_to_keep(model) else {}
    out = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        use_cache=False,
        **extra,
    )
    return out.logits[:, -(packed.response_width + 1) : -1]


def response_logprobs(
    model: torch.nn.Module, packed: Packed, temperature: float = 1.0
) -> torch.Tensor:
    """log p(response token t | prompt, earlier response tokens), [B, R]; 0 on padding.

    ``temperature`` divides the logits first (as the sampler did), so the trainer can score
    responses under the distribution they were drawn from.
    """
    logits = response_logits(model, packed)
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
) -> list:
    """``fn`` over micro-batches of similar lengths; its per-sequence results in input order."""
    keys = [(len(p), len(r)) for p, r in zip(prompts, responses, strict=True)]
    results: list = [None] * len(prompts)
    for group in micro_batches(keys, size):
        rows = fn([prompts[i] for i in group], [responses[i] for i in group])
        for index, row in zip(group, rows, strict=True):
            results[index] = row
    return results
