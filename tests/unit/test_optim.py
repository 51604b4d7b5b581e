"""The shared AdamW: fused where torch has the kernel, the same steps as the loop version."""

from __future__ import annotations

import torch

from rlfleet.model.optim import adamw


def test_fused_adamw_on_cpu_takes_the_same_steps_as_the_loop():
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(7)]
    fused_params = [torch.nn.Parameter(t.clone()) for t in start]
    loop_params = [torch.nn.Parameter(t.clone()) for t in start]
    fused = adamw(fused_params, lr=1e-2, weight_decay=0.1)
    loop = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1, foreach=False)
    assert fused.defaults["fused"] is True
    for step in range(5):
        grads = [torch.randn_like(t) * (step + 1) for t in start]
        for params, optimizer in ((fused_params, fused), (loop_params, loop)):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
    for a, b in zip(fused_params, loop_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused.state_dict()["state"].keys() == loop.state_dict()["state"].keys()


def test_a_dtype_without_the_kernel_gets_the_loop():
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    assert not adamw(params, lr=1e-3, weight_decay=0.0).defaults["fused"]
