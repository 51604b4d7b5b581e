"""The shared-prompt forward: one pass per distinct prompt, responses on its KV cache.

It must be indistinguishable from the single forward over every (prompt, response) row, in
log-probs and in gradients, since the actor's update and the reference's log-probs take it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_qwen2

from rlfleet.rl.sequences import (
    distinct_prompts,
    pack_sequences,
    response_logits,
    response_logprobs,
    shared_prompt_logits,
)

VOCAB = 16
# Two GRPO-like groups of three rows (prompts of different lengths, so one is left-padded),
# plus a prompt of its own; responses of 1..5 tokens, so the response columns are padded too.
PROMPTS = [[1, 4, 5]] * 3 + [[1, 6, 7, 8, 9]] * 3 + [[1, 3]]
RESPONSES = [[5], [6, 7, 2], [8, 9, 10, 11, 2], [12, 2], [3, 4], [5, 6, 7, 8], [9, 2]]


def model_for(attn: str):
    return random_qwen2(64, 2, 4, 2, VOCAB, seed=3, pad_token_id=0, attn_implementation=attn)


def grads(model, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def weighted_loss(logits: torch.Tensor, packed) -> torch.Tensor:
    """A loss that weighs every response position differently (a stand-in for advantages)."""
    logp = torch.log_softmax(logits, -1).gather(-1, packed.responses.unsqueeze(-1)).squeeze(-1)
    weights = torch.arange(1, logp.numel() + 1, dtype=logp.dtype).view_as(logp)
    return (logp * weights * packed.response_mask).sum()


def test_distinct_prompts_maps_rows_to_their_prompt():
    packed = pack_sequences(PROMPTS, RESPONSES)
    first, inverse = distinct_prompts(packed)
    assert len(first) == 3
    for row, prompt in enumerate(PROMPTS):
        assert PROMPTS[first[inverse[row]]] == prompt


def test_distinct_prompts_tell_a_pad_token_from_padding():
    # [0, 4] is a real two-token prompt whose first token is the pad id; [4] left-padded to
    # width 2 has the same ids but a different mask.
    packed = pack_sequences([[0, 4], [4], [4]], [[5], [5], [6]], pad_id=0)
    first, inverse = distinct_prompts(packed)
    assert len(first) == 2 and inverse[1] == inverse[2] != inverse[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_logits_and_gradients_match_the_single_forward(attn: str):
    model = model_for(attn).train()
    packed = pack_sequences(PROMPTS, RESPONSES)
    single = response_logits(model, packed, share_prompts=False)
    shared = shared_prompt_logits(model, packed)
    assert shared is not None and shared.shape == single.shape == (7, 5, VOCAB)
    real = packed.response_mask.bool()
    assert torch.allclose(shared[real], single[real], atol=1e-5)
    single_grads = grads(model, weighted_loss(single, packed))
    shared_grads = grads(model, weighted_loss(shared, packed))
    for a, b in zip(single_grads, shared_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_one_token_responses_need_only_the_prompt_pass():
    model = model_for("sdpa").eval()
    packed = pack_sequences([[1, 4]] * 2 + [[1, 5, 6]] * 2, [[3], [4], [5], [6]])
    with torch.no_grad():
        single = response_logits(model, packed, share_prompts=False)
        shared = shared_prompt_logits(model, packed)
    assert shared.shape == (4, 1, VOCAB)
    assert torch.allclose(shared, single, atol=1e-5)


def test_nothing_to_share_takes_the_single_forward():
    model = model_for("sdpa").eval()
    packed = pack_sequences([[1, 4], [1, 5]], [[3, 2], [4]])
    assert shared_prompt_logits(model, packed) is None
    with torch.no_grad():
        assert torch.allclose(
            response_logprobs(model, packed), response_logprobs(model, packed, share_prompts=False)
        )


def test_a_data_parallel_wrapper_takes_the_single_forward():
    calls = []
    model = model_for("sdpa").eval()

    class FakeDDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module):  # no process group: only the type matters here
            torch.nn.Module.__init__(self)
            self.module = module

        def forward(self, **kwargs):
            calls.append(kwargs)
            return self.module(**kwargs)

    packed = pack_sequences(PROMPTS, RESPONSES)
    with torch.no_grad():
        response_logits(FakeDDP(model), packed)
    assert len(calls) == 1 and calls[0]["input_ids"].shape == packed.input_ids.shape
