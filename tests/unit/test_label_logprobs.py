"""``label_logprobs``: the fused log-prob of the sampled tokens and its own backward, against a
hand-computed case and the plain float32 path on random batches."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.rl import core_algos
from rlfleet.rl.label_logprobs import label_logprobs


def test_two_equal_logits_hand_computed():
    logits = torch.zeros(1, 1, 2, requires_grad=True)
    logprob, entropy = label_logprobs(logits, torch.tensor([[1]]), with_entropy=True)
    assert logprob.item() == pytest.approx(-math.log(2))
    assert entropy.item() == pytest.approx(math.log(2))
    logprob.sum().backward()
    # d log p_1 / d z = onehot(1) - softmax(z) = [-0.5, 0.5]
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.5, 0.5]]]))


def test_temperature_divides_the_logits_and_the_gradient():
    logits = torch.tensor([[[0.0, math.log(3.0) * 2]]], requires_grad=True)
    logprob, _ = label_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert logprob.item() == pytest.approx(math.log(1 / 4))  # softmax([0, ln 3]) = [1/4, 3/4]
    logprob.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[0.75 / 2, -0.75 / 2]]]))


def plain(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    scaled = logits.float() / temperature
    return core_algos.logprobs_from_logits(scaled, labels), core_algos.entropy_from_logits(scaled)


@pytest.mark.parametrize("chunk_rows", [1, 2, 5])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_equals_the_plain_path_with_its_gradient(chunk_rows: int, temperature: float):
    generator = torch.Generator().manual_seed(chunk_rows)
    for _ in range(5):
        shape = (3, 7, 50)
        logits = (torch.randn(shape, generator=generator) * 3).requires_grad_()
        labels = torch.randint(0, 50, shape[:2], generator=generator)
        upstream = torch.randn(shape[:2], generator=generator)
        fused, entropy = label_logprobs(logits, labels, temperature, True, chunk_rows)
        (grad,) = torch.autograd.grad((fused * upstream).sum(), logits)
        expected, expected_entropy = plain(logits, labels, temperature)
        (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), logits)
        torch.testing.assert_close(fused, expected)
        torch.testing.assert_close(entropy, expected_entropy.detach())
        torch.testing.assert_close(grad, expected_grad)
        assert not entropy.requires_grad


def test_bf16_logits_get_a_bf16_gradient_close_to_float32():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(2, 4, 64, generator=generator)
    labels = torch.randint(0, 64, (2, 4), generator=generator)
    low = base.to(torch.bfloat16).requires_grad_()
    logprob, _ = label_logprobs(low, labels)
    logprob.sum().backward()
    assert logprob.dtype == torch.float32 and low.grad.dtype == torch.bfloat16
    full = base.to(torch.bfloat16).float().requires_grad_()
    expected = core_algos.logprobs_from_logits(full, labels)
    expected.sum().backward()
    torch.testing.assert_close(logprob, expected)
    torch.testing.assert_close(low.grad.float(), full.grad, atol=1e-2, rtol=1e-2)


def test_a_temperature_of_zero_is_refused():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        label_logprobs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), 0.0)
