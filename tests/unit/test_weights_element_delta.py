"""Element-level weight deltas (``weights_delta``, ``weights_delta_plan``) on tiny tensors
whose bits are worked out by hand: what travels, what a replica assembles, what it refuses.

The replica side is the real ``WeightUpdater`` over an engine that only holds what it loads
(no model needed); the trainer side is the real ``GrpcWeightTransport`` planning from its own
encoded pushes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
import torch

from rlfleet.common.config import load_config
from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.model import weights, weights_delta
from rlfleet.model.weights_delta_plan import DeltaPlanner
from rlfleet.rollout.engines.base import Engine
from rlfleet.rollout.types import ReplicaState, ReplicaStatus
from rlfleet.rollout.weight_updates import WeightUpdater, check_no_narrowing, verified
from rlfleet.trainer.pushes import cast_weights
from rlfleet.trainer.weight_sync import push_metrics
from rlfleet.trainer.weight_transport import GrpcWeightTransport


class HeldEngine(Engine):
    """Holds a copy of the last weights loaded; generates nothing."""

    name = "held"

    def __init__(self, dtype: str = "float32", delta: str = "always") -> None:
        overrides = [
            "model.path=/nonexistent",
            f"model.dtype={dtype}",
            f"trainer.weight_delta={delta}",
        ]
        super().__init__(load_config(overrides=overrides, env={}))
        self.held: dict[str, torch.Tensor] = {}

    async def start(self) -> None:
        return None

    async def generate(self, request_id, prompt_token_ids, sampling) -> list:
        raise NotImplementedError

    async def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        self.held = {name: tensor.clone() for name, tensor in state_dict.items()}

    async def flush_cache(self) -> bool:
        return True

    async def abort(self, request_id: str) -> None:
        return None

    async def close(self) -> None:
        return None


def updater(dtype: str = "float32", delta: str = "always") -> WeightUpdater:
    engine = HeldEngine(dtype, delta)
    return WeightUpdater(engine.config, engine, lambda _: None)


def deliver(replica: WeightUpdater, header: weights.WeightHeader, payload) -> None:
    """What a replica does with an update: check the header, verify the bytes, load."""
    replica.check(header)
    asyncio.run(replica.load(header, verified(header, bytearray(payload))))


def transport(mode: str = "always") -> GrpcWeightTransport:
    sender = GrpcWeightTransport(lambda address: None, lambda h, p, c: None, 2**20)
    sender.delta = mode
    return sender


def plan(sender: GrpcWeightTransport, state: dict, version: int):
    """The transport's full encoding and delta plan for one push (no replica involved)."""
    encoded = sender._encode(state, version, True, False, False)
    return encoded, sender._plan_delta(state, encoded, version, False)


def parts(delta) -> dict[str, torch.Tensor]:
    """The delta's tensors by wire name, metadata left out."""
    decoded = weights.decode(delta.encoded.header, delta.encoded.payload)
    return {name: t for name, t in decoded.items() if not name.startswith(weights_delta.META)}


def held(replica: WeightUpdater) -> dict[str, torch.Tensor]:
    return replica.engine.held  # type: ignore[attr-defined]


def bits_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        torch.equal(a[n].view(-1).view(torch.uint8), b[n].view(-1).view(torch.uint8)) for n in a
    )


V1 = {
    "a": torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
    "b": torch.tensor([[0.5, -0.5], [0.25, -0.25]]),
}


def test_fp32_round_trip_sends_one_pair_and_the_replica_gets_the_full_weights_bit_for_bit():
    v2 = {"a": V1["a"].clone(), "b": V1["b"].clone()}
    v2["a"][2] = 3.5  # one element of 8: a pair is 4 + 4 bytes against 32 whole; b unchanged
    sender = transport()
    full1, _ = plan(sender, V1, 1)
    full2, delta = plan(sender, v2, 2)
    got = parts(delta)
    assert list(got) == ["delta::index::a", "delta::value::a"]
    assert got["delta::index::a"].tolist() == [2] and got["delta::index::a"].dtype == torch.int32
    assert got["delta::value::a"].tolist() == [3.5]
    meta_bytes = delta.encoded.header.tensors[0].nbytes
    assert delta.encoded.header.total_bytes == meta_bytes + 8
    assert delta.ratio == pytest.approx((meta_bytes + 8) / full2.header.total_bytes)
    replica = updater()
    deliver(replica, full1.header, full1.payload)
    deliver(replica, delta.encoded.header, delta.encoded.payload)
    assert replica.version == 2 and bits_equal(held(replica), v2)


def test_bf16_two_changes_go_as_pairs_and_three_go_whole():
    """8 bf16 elements are 16 bytes; a pair is 4 + 2 = 6: two changes (12) as pairs, three
    (18) whole."""
    v1 = {"w": torch.arange(8, dtype=torch.bfloat16)}
    two, three = v1["w"].clone(), v1["w"].clone()
    two[[1, 6]] = torch.tensor([-1.0, 0.5], dtype=torch.bfloat16)
    three[[0, 3, 7]] = 9.0
    for new, wanted in (
        (two, ["delta::index::w", "delta::value::w"]),
        (three, ["delta::whole::w"]),
    ):
        sender = transport()
        full1, _ = plan(sender, v1, 1)
        _, delta = plan(sender, {"w": new}, 2)
        assert list(parts(delta)) == wanted
        replica = updater("bfloat16")
        deliver(replica, full1.header, full1.payload)
        deliver(replica, delta.encoded.header, delta.encoded.payload)
        assert bits_equal(held(replica), {"w": new})
    assert parts(plan_of(v1, {"w": two}))["delta::value::w"].dtype == torch.bfloat16


def plan_of(v1: dict, v2: dict):
    sender = transport()
    plan(sender, v1, 1)
    return plan(sender, v2, 2)[1]


def test_an_fp32_actor_pushed_in_bf16_sends_only_elements_whose_rounding_moved():
    """bf16's step at 1.0 is 2**-7: 1.0039 rounds to 1.0 and 1.0041 to 1.0078125 (one element
    changes); 2.0 -> 2.0001 stays 2.0 in bf16 (unchanged, though its fp32 bits moved)."""
    fp32_v1 = {"w": torch.tensor([1.0039, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])}
    fp32_v2 = {"w": fp32_v1["w"] + torch.tensor([0.0002, 0.0001, 0, 0, 0, 0, 0, 0])}
    delta = plan_of(cast_weights(fp32_v1, "bfloat16"), cast_weights(fp32_v2, "bfloat16"))
    got = parts(delta)
    assert got["delta::index::w"].tolist() == [0]
    assert got["delta::value::w"].tolist() == [1.0078125]
    assert len(parts(plan_of(fp32_v1, fp32_v2))["delta::index::w"]) == 2  # fp32: both moved


def test_a_tensor_whose_every_element_changed_goes_whole():
    v2 = {"a": V1["a"] + 1, "b": V1["b"].clone()}
    got = parts(plan_of(V1, v2))
    assert list(got) == ["delta::whole::a"] and torch.equal(got["delta::whole::a"], v2["a"])
    everything = {"a": V1["a"] + 1, "b": V1["b"] + 1}  # the full push + metadata: auto keeps it
    assert plan_of_mode("auto", V1, everything).encoded is None


def test_an_empty_delta_when_nothing_changed_still_moves_the_version():
    sender = transport()
    full1, _ = plan(sender, V1, 1)
    _, delta = plan(sender, {n: t.clone() for n, t in V1.items()}, 2)
    assert parts(delta) == {} and len(delta.encoded.header.tensors) == 1
    replica = updater()
    deliver(replica, full1.header, full1.payload)
    deliver(replica, delta.encoded.header, delta.encoded.payload)
    assert replica.version == 2 and bits_equal(held(replica), V1)


def test_a_delta_on_another_base_version_is_refused_from_its_header():
    sender = transport()
    full1, _ = plan(sender, V1, 1)
    _, delta = plan(sender, {"a": V1["a"] * 2, "b": V1["b"]}, 2)
    fresh = updater()
    with pytest.raises(FailedPrecondition, match="keeps no base"):
        fresh.check(delta.encoded.header)
    replica = updater()
    deliver(replica, full1.header, full1.payload)
    replica.version = 3  # serves v3, the delta is on v1
    delta.encoded.header.version = 4
    with pytest.raises(FailedPrecondition, match="serves v3"):
        replica.check(delta.encoded.header)


def test_a_corrupted_delta_payload_is_refused_and_nothing_changes():
    sender = transport()
    full1, _ = plan(sender, V1, 1)
    v2 = {"a": V1["a"].clone(), "b": V1["b"]}
    v2["a"][5] = -6.0
    _, delta = plan(sender, v2, 2)
    replica = updater()
    deliver(replica, full1.header, full1.payload)
    damaged = bytearray(delta.encoded.payload)
    damaged[-1] ^= 0x01  # the value's last byte
    with pytest.raises(InvalidArgument, match="checksum mismatch"):
        deliver(replica, delta.encoded.header, damaged)
    assert replica.version == 1 and bits_equal(held(replica), V1)


def test_a_replica_whose_base_differs_by_one_bit_refuses_by_the_full_checksum():
    sender = transport()
    plan(sender, V1, 1)
    v2 = {"a": V1["a"].clone(), "b": V1["b"]}
    v2["a"][0] = 100.0
    _, delta = plan(sender, v2, 2)
    other = {"a": V1["a"].clone(), "b": V1["b"].clone()}
    other["b"].view(-1).view(torch.int32)[3] ^= 1  # -0.25 with its lowest mantissa bit flipped
    other_full = weights.encode(other, 1)
    replica = updater()
    deliver(replica, *other_full)
    with pytest.raises(FailedPrecondition, match="differ from the trainer's"):
        deliver(replica, delta.encoded.header, delta.encoded.payload)
    assert replica.version == 1 and replica.intact and bits_equal(held(replica), other)


def test_malformed_pairs_are_refused_before_anything_is_written():
    base = torch.zeros(4)

    def pair(index, value):
        return weights_delta.Scatter.of("w", base, weights_delta.Part(index=index, value=value))

    index = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(InvalidArgument, match="out of range"):
        pair(index, torch.ones(1))
    with pytest.raises(InvalidArgument, match="int32"):
        pair(index.long(), torch.ones(1))
    with pytest.raises(InvalidArgument, match="values of"):
        pair(index - 1, torch.ones(1, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgument, match="lacks"):
        pair(index, None)
    assert torch.equal(base, torch.zeros(4))


def test_a_refused_delta_puts_back_the_elements_it_wrote_into_the_base():
    """``apply`` writes into the kept base in place; a wrong full checksum undoes it."""
    sender = transport()
    full1, _ = plan(sender, V1, 1)
    v2 = {"a": V1["a"].clone(), "b": V1["b"]}
    v2["a"][[1, 4]] = torch.tensor([-2.0, -5.0])
    _, delta = plan(sender, v2, 2)
    kept = weights.decode(full1.header, bytearray(full1.payload))
    decoded = weights.decode(delta.encoded.header, delta.encoded.payload)
    kept["b"].view(-1)[0] = 0.75  # not the trainer's v1 any more
    with pytest.raises(FailedPrecondition):
        weights_delta.apply(decoded, kept)
    assert kept["a"].tolist() == V1["a"].tolist()
    kept["b"].view(-1)[0] = 0.5
    assert bits_equal(weights_delta.apply(decoded, kept), v2) and bits_equal(kept, v2)


def test_lora_adapter_updates_travel_as_element_deltas_and_names_do_not_clash():
    """A LoRA name (``lora::<weight>::A``) inside a delta name: the kind is read up to the
    first ``::``, so ``delta::index::lora::m.weight::B`` is the index part of the adapter's B."""
    a_name, b_name = "lora::m.weight::A", "lora::m.weight::B"
    v1 = {a_name: torch.ones(2, 4), b_name: torch.zeros(4, 2)}
    v2 = {a_name: v1[a_name].clone(), b_name: v1[b_name].clone()}
    v2[b_name][3, 1] = 0.125  # flat index 7
    sender = transport()
    full1, _ = plan(sender, v1, 1)
    _, delta = plan(sender, v2, 2)
    got = parts(delta)
    assert list(got) == [f"delta::index::{b_name}", f"delta::value::{b_name}"]
    assert got[f"delta::index::{b_name}"].tolist() == [7]
    assert weights_delta.split_name(f"delta::index::{b_name}") == ("index", b_name)
    assert weights_delta.original_name(f"delta::value::{b_name}") == b_name
    check_no_narrowing(delta.encoded.header, "bfloat16")  # fp32 adapter values are exempt
    replica = updater()
    replica.keep_base = True
    deliver(replica, full1.header, full1.payload)
    deliver(replica, delta.encoded.header, delta.encoded.payload)
    assert bits_equal(held(replica), v2)


def test_auto_sends_a_delta_only_under_its_fraction_and_metrics_name_ratio_and_bytes():
    big = {"w": torch.arange(100.0)}
    small_change, large_change = big["w"].clone(), big["w"].clone()
    small_change[0] = -1.0  # 8 bytes (+ metadata) of 400: sent
    large_change[:40] = -1.0  # 320 bytes of 400 as pairs: over a quarter, measured not sent
    assert plan_of_mode("auto", big, {"w": small_change}).encoded is not None
    measured = plan_of_mode("auto", big, {"w": large_change})
    assert measured.encoded is None and measured.ratio > 0.25
    assert plan_of_mode("never", big, {"w": small_change}) is None


def plan_of_mode(mode: str, v1: dict, v2: dict):
    sender = transport(mode)
    plan(sender, v1, 1)
    return plan(sender, v2, 2)[1]


def test_push_metrics_name_bytes_sent_and_the_delta_ratio():
    from rlfleet.trainer.weight_transport import PushResult

    results = [PushResult("r0", True, 2, 0.1, 100, delta=True), PushResult("r1", True, 2, 0.2, 400)]
    metrics = push_metrics(results, delta_ratio=0.25)
    assert metrics["weight/bytes_sent"] == 500.0 and metrics["weight/delta_ratio"] == 0.25
    assert metrics["weight_sync/delta_replicas"] == 1.0
    assert "weight/delta_ratio" not in push_metrics(results)


def test_the_planner_copies_a_shared_payload_and_keeps_no_base_after_forget():
    planner = DeltaPlanner()
    header, payload = weights.encode(V1, 1)
    shared = bytearray(payload)
    assert planner.plan(header, shared, private=False) is None
    shared[:] = bytes(len(shared))  # the shared file written again: the kept copy holds
    header2, payload2 = weights.encode({"a": V1["a"] * 2, "b": V1["b"]}, 2)
    got = planner.plan(header2, payload2)
    assert got is not None and got.base == 1
    planner.forget()
    assert planner.plan(*weights.encode(V1, 3)) is None


def test_auto_sends_deltas_only_to_streamed_replicas_and_plans_none_for_shared_memory_alone():
    sender = GrpcWeightTransport(lambda a: None, lambda h, p, c: None, 2**20, shared_memory=True)
    if not sender._shared_memory:
        pytest.skip("no /dev/shm here")
    sender.delta = "auto"
    local = ReplicaStatus("local", "l:1", 1, ReplicaState.SERVING, 0, "hf", 0, 0.0)
    remote = replace(local, replica_id="remote", address="r:1")
    v1 = {"w": torch.arange(1000.0)}  # 4,000 bytes: one changed element is far under 1/4
    v2 = {"w": v1["w"].clone()}
    v2["w"][0] = -1.0

    async def scenario() -> None:
        for version, state, targets in ((1, v1, [local]), (2, v2, [local])):
            prepared = await sender.prepare(state, version, True, False, targets)
            assert prepared.delta is None  # every target reads the file: nothing planned
            sender.release(prepared, False)
        sender._streamed.add(remote.address)
        for version, state in ((3, v1), (4, v2)):
            prepared = await sender.prepare(state, version, True, False, [local, remote])
            sender.release(prepared, False)
        assert prepared.delta is not None and prepared.delta_ratio is not None
        assert sender._delta_to(replace(remote, weight_version=3), prepared) is not None
        assert sender._delta_to(replace(local, weight_version=3), prepared) is None
        await sender.close()

    asyncio.run(scenario())


def test_under_auto_a_replica_fed_through_shared_memory_keeps_no_base():
    replica = updater(delta="auto")
    header, payload = weights.encode(V1, 1)
    asyncio.run(
        replica.load(replace(header, shared_memory="rlfleet-x"), weights.decode(header, payload))
    )
    assert replica.base is None
    deliver(replica, *weights.encode(V1, 2))  # streamed: kept
    assert replica.base is not None
