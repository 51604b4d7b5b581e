"""A delta's changed elements written into parameters (``engines.element_writes``) give the
bits a full load (``copy_``) of the assembled weights gives, in the same dtype and widening."""

from __future__ import annotations

import torch

from rlfleet.model.weights_delta import Part
from rlfleet.rollout.engines import element_writes


def bits(tensor: torch.Tensor) -> list[int]:
    return tensor.contiguous().view(-1).view(torch.uint8).tolist()


def full_load(params: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in new.items():
            params[name].copy_(tensor)


def check(param_dtype: torch.dtype, pushed_dtype: torch.dtype) -> None:
    old = {
        "w": torch.linspace(-1, 1, 12, dtype=torch.float32).reshape(3, 4).to(pushed_dtype),
        "v": torch.arange(5, dtype=torch.float32).to(pushed_dtype),
    }
    new = {"w": old["w"].clone(), "v": old["v"] * 3}
    new["w"].view(-1)[[0, 7, 11]] = torch.tensor([9.5, -0.125, 3.0], dtype=pushed_dtype)
    index = torch.tensor([0, 7, 11], dtype=torch.int32)
    changes = {"w": Part(index=index, value=new["w"].view(-1)[index.long()]), "v": Part(new["v"])}
    by_elements = {n: t.to(param_dtype).clone() for n, t in old.items()}
    by_copy = {n: t.to(param_dtype).clone() for n, t in old.items()}
    writes = element_writes.prepare(by_elements, changes, frozenset())
    assert writes is not None and element_writes.count(writes) == 3 + 5
    element_writes.write_all(writes)
    full_load(by_copy, new)
    for name in old:
        assert bits(by_elements[name]) == bits(by_copy[name]), name


def test_elements_written_equal_a_full_load_bit_for_bit() -> None:
    check(torch.float32, torch.float32)
    check(torch.bfloat16, torch.bfloat16)
    check(torch.float32, torch.bfloat16)  # widening, as a bf16 push onto an fp32 replica


def test_a_tied_parameter_is_left_to_its_twin() -> None:
    shared = torch.zeros(4)
    params = {"embed": shared, "lm_head": shared}
    index = torch.tensor([2], dtype=torch.int32)
    value = torch.tensor([5.0])
    changes = {n: Part(index=index, value=value) for n in params}
    writes = element_writes.prepare(params, changes, frozenset({"lm_head"}))
    assert writes is not None and len(writes) == 1
    element_writes.write_all(writes)
    assert shared.tolist() == [0.0, 0.0, 5.0, 0.0]


def test_a_parameter_that_is_not_contiguous_asks_for_a_full_load() -> None:
    params = {"w": torch.zeros(4, 3).t()}
    changes = {"w": Part(index=torch.tensor([0], dtype=torch.int32), value=torch.ones(1))}
    assert element_writes.prepare(params, changes, frozenset()) is None
