"""Log-probs of the sampled tokens (and the entropy) from ``[B, T, V]`` logits, a few rows at a
time, with a backward of its own.

Why: the plain way (``logits.float() / T``, ``logsumexp``, ``gather``; ``core_algos.
logprobs_from_logits``) keeps a float32 copy of the whole ``[B, T, V]`` logits for the backward
and builds two or three more of the same size in it (the gradient through the division, the
cast, the softmax). With SmolLM2's 49,152-token vocabulary a micro-batch of 8 rows x 128
tokens is 200 MB per copy, and those copies are a large share of the trainer's peak memory.
Here the forward keeps only what it was given (the logits, in their own dtype) and the
log-sum-exp ``[B, T]``; the backward makes the softmax again one chunk of rows at a time and
writes the gradient straight into one tensor shaped like the logits:
``d logp_t / d z_tv = (1[v = y_t] - softmax(z_t / T)_v) / T``.

The result equals ``log_softmax(logits / T).gather(labels)`` in float32 (the same math as
``core_algos.logprobs_from_logits``, rounding aside). The entropy comes from the same pass
without a gradient: it is a metric unless the loss has an entropy bonus, and then the caller
takes the plain path (``Actor.mini_batch_loss``). Fused cross-entropy kernels (e.g. Liger
Kernel's, https://arxiv.org/abs/2410.10989) do this on GPUs; this is the CPU-friendly chunked
form of the same idea.
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 2
"""Rows per chunk: their float32 temporaries (2 x 128 tokens x 49,152 x 4 bytes = 50 MB each
on SmolLM2) are all this adds to the logits themselves."""


def label_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprob, entropy)``: ``[B, T, V]`` logits and ``[B, T]`` labels -> float32 ``[B, T]``
    each, under ``softmax(logits / temperature)``; ``entropy`` is ``None`` unless
    ``with_entropy`` and never carries a gradient. ``logprob`` is differentiable in
    ``logits``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logprob, entropy = _FusedLabelLogprob.apply(
        logits, labels, float(temperature), bool(with_entropy), max(1, int(chunk_rows))
    )
    return logprob, (entropy if with_entropy else None)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A float32 copy of ``logits / temperature`` (a fresh tensor, safe to change in place)."""
    z = logits.to(torch.float32, copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


class _FusedLabelLogprob(torch.autograd.Function):
    """Forward: per chunk of rows, ``z = logits / T`` in float32, ``lse = logsumexp(z)``,
    ``logp = z[y] - lse`` and (optionally) ``entropy = lse - sum(softmax(z) * z)``. Saves the
    logits, labels and ``lse``. Backward: ``grad_z = g * (onehot(y) - exp(z - lse))``, per
    chunk, divided by ``T``."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, with_entropy, chunk_rows):
        rows = logits.shape[0]
        logprob = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprob)
        entropy = torch.zeros_like(logprob)
        for start in range(0, rows, chunk_rows):
            part = slice(start, start + chunk_rows)
            z = _scaled(logits[part], temperature)
            lse[part] = torch.logsumexp(z, dim=-1)
            logprob[part] = z.gather(-1, labels[part].unsqueeze(-1)).squeeze(-1) - lse[part]
            if with_entropy:
                probs = torch.exp(z - lse[part].unsqueeze(-1))
                entropy[part] = lse[part] - (probs * z).sum(-1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, _grad_entropy):
        logits, labels, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            part = slice(start, start + ctx.chunk_rows)
            g = grad_logprob[part].to(torch.float32).unsqueeze(-1)  # [rows, T, 1]
            probs = _scaled(logits[part], temperature).sub_(lse[part].unsqueeze(-1)).exp_()
            probs.mul_(-g).scatter_add_(-1, labels[part].unsqueeze(-1), g)
            if temperature != 1.0:
                probs.div_(temperature)
            grad[part] = probs
        return grad, None, None, None, None
