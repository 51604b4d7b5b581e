"""``forward`` and ``forward_backward`` over a call's datums: target log-probs, the named loss
(``rlfleet.rl.datum_losses``), and its gradient accumulated into the active adapter.

Datums are right-padded into micro-batches of about ``micro_batch_tokens`` padded tokens; the
loss is a sum over datums, so the micro-batches' gradients add up to the call's. Runs on the
compute thread (torch, blocking), one call at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from rlfleet.rl.core_algos import logprobs_from_logits
from rlfleet.rl.datum_losses import DatumLoss
from rlfleet.trainer.tinker.types import Datum, ForwardResult


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Datum indices in order, grouped so that ``len(group) * longest <= max_tokens`` (a datum
    longer than that is a group of its own)."""
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= max_tokens:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


def padded(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``[B, L]`` right-padded ids (pad 0) and attention mask for ``rows``."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def datum_logprobs(model, datums: Sequence[Datum], device: torch.device) -> list[torch.Tensor]:
    """Per datum ``[N]`` log-probs of its ``target_tokens`` (with grad when enabled)."""
    ids, mask = padded([d.tokens for d in datums], device)
    targets, _ = padded([d.inputs["target_tokens"].tolist() for d in datums], device)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logprobs = logprobs_from_logits(logits, targets)
    return [logprobs[i, : len(d.tokens)] for i, d in enumerate(datums)]


def _tensors(datum: Datum, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v, device=device) for k, v in datum.inputs.items()}


def run_datums(
    model,
    datums: Sequence[Datum],
    loss: DatumLoss,
    config: Mapping[str, float],
    backward: bool,
    micro_batch_tokens: int,
) -> ForwardResult:
    """Forward every datum (and backward the summed loss when ``backward``); gradients add to
    whatever the trainable parameters already hold (``optim_step`` consumes and clears them)."""
    device = next(model.parameters()).device
    logprobs: list[np.ndarray] = [np.empty(0, np.float32)] * len(datums)
    losses: list[np.ndarray] = list(logprobs)
    total = 0.0
    for group in micro_batches([len(d.tokens) for d in datums], micro_batch_tokens):
        part = [datums[i] for i in group]
        with torch.set_grad_enabled(backward):
            lps = datum_logprobs(model, part, device)
            per = [
                loss.fn(lp, _tensors(d, device), config) for lp, d in zip(lps, part, strict=True)
            ]
            summed = torch.stack([p.sum() for p in per]).sum()
            if backward:
                summed.backward()
        total += float(summed.detach())
        for i, lp, p in zip(group, lps, per, strict=True):
            logprobs[i] = lp.detach().float().cpu().numpy()
            losses[i] = p.detach().float().cpu().numpy()
    return ForwardResult(logprobs, losses, {"loss:sum": total})
