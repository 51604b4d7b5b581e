"""Delta weight updates (``weights_delta``): what a replica ends up holding after a delta is
what a full push would have given it, bit for bit, and a delta that does not fit (another
base version, another base content, damaged bytes) is refused with the replica unchanged.

Real parts: the tiny policy in a real HF engine behind the replica's ``WeightUpdater``, the
trainer's ``GrpcWeightTransport`` planning the delta from real encoded pushes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlfleet.common.config import load_config
from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.model import weights, weights_delta
from rlfleet.model.model_io import load_causal_lm
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.types import ReplicaState, ReplicaStatus
from rlfleet.rollout.weight_updates import WeightUpdater, verified
from rlfleet.trainer.weight_transport import GrpcWeightTransport, _delta_for

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-arith"
pytestmark = pytest.mark.skipif(
    not (TINY / "model.safetensors").exists(), reason="tiny model not built"
)
FROZEN = ("model.embed_tokens.weight",)


def config(delta: str = "always"):
    return load_config(
        overrides=[
            f"model.path={TINY}",
            "model.dtype=float32",
            "rollout.backend=hf",
            f"trainer.weight_delta={delta}",
        ]
    )


def base_state() -> dict[str, torch.Tensor]:
    model = load_causal_lm(str(TINY), "float32")
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def stepped(state: dict[str, torch.Tensor], seed: int, only: str = "") -> dict:
    """As after an optimizer step: every tensor moves except ``FROZEN`` (or only ``only``)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        moves = name == only if only else name not in FROZEN
        noise = torch.randn(tensor.shape, generator=generator) * 1e-3
        out[name] = tensor + noise if moves else tensor.clone()
    return out


def plan(transport: GrpcWeightTransport, state: dict, version: int):
    """The transport's full encoding and delta plan for one push (no replica involved)."""
    encoded = transport._encode(state, version, True, False, False)
    return encoded, transport._plan_delta(state, encoded, version, False)


def new_transport(mode: str = "always") -> GrpcWeightTransport:
    transport = GrpcWeightTransport(lambda address: None, lambda h, p, c: None, 2**20)
    transport.delta = mode
    return transport


async def started_updater(delta: str = "always") -> tuple[HFEngine, WeightUpdater]:
    engine = HFEngine(config(delta))
    await engine.start()
    return engine, WeightUpdater(engine.config, engine, lambda _: None)


async def deliver(updater: WeightUpdater, header: weights.WeightHeader, payload) -> None:
    """What a replica does with an update: check the header, verify the bytes, load."""
    updater.check(header)
    await updater.load(header, verified(header, bytearray(payload)))


def engine_bits(engine: HFEngine) -> dict[str, bytes]:
    return {
        n: t.detach().contiguous().view(torch.uint8).numpy().tobytes()
        for n, t in engine.model.state_dict().items()
    }


async def test_a_delta_on_the_right_base_gives_the_full_push_bit_for_bit() -> None:
    v1 = base_state()
    v2 = stepped(v1, seed=1)
    transport = new_transport()
    full1, none = plan(transport, v1, 1)
    full2, delta = plan(transport, v2, 2)
    assert none is None and delta is not None and delta.base == 1
    changed = [e.name for e in delta.encoded.header.tensors[1:]]
    assert changed == [weights_delta.tensor_name(n) for n in v2 if n not in FROZEN]
    assert delta.encoded.header.total_bytes < full2.header.total_bytes
    by_delta, by_full = await started_updater(), await started_updater()
    try:
        await deliver(by_delta[1], full1.header, full1.payload)
        await deliver(by_delta[1], delta.encoded.header, delta.encoded.payload)
        await deliver(by_full[1], full2.header, full2.payload)
        assert by_delta[1].version == by_full[1].version == 2
        assert engine_bits(by_delta[0]) == engine_bits(by_full[0])
        for name, tensor in v2.items():  # and that is the trainer's state
            assert torch.equal(by_delta[0].model.state_dict()[name], tensor), name
    finally:
        await by_delta[0].close()
        await by_full[0].close()


async def test_a_delta_on_another_version_is_refused_from_its_header() -> None:
    v1 = base_state()
    transport = new_transport()
    full1, _ = plan(transport, v1, 1)
    _, delta2 = plan(transport, stepped(v1, 1), 2)
    engine, updater = await started_updater()
    try:
        with pytest.raises(FailedPrecondition, match="keeps no base"):
            updater.check(delta2.encoded.header)  # nothing loaded yet
        await deliver(updater, full1.header, full1.payload)
        skipped = replace(
            delta2.encoded.header,
            version=4,
            tensors=[
                replace(delta2.encoded.header.tensors[0], name=f"{weights_delta.META}3"),
                *delta2.encoded.header.tensors[1:],
            ],
        )
        before = engine_bits(engine)
        with pytest.raises(FailedPrecondition, match="serves v1"):
            updater.check(skipped)
        assert updater.version == 1 and engine_bits(engine) == before
    finally:
        await engine.close()


async def test_a_delta_on_a_base_of_other_content_is_refused_and_nothing_changes() -> None:
    """Same version number, different weights (another run's v1): the full checksum catches
    it before the engine sees anything."""
    v1 = base_state()
    transport = new_transport()
    plan(transport, v1, 1)
    _, delta2 = plan(transport, stepped(v1, 1), 2)
    other = stepped(v1, seed=7, only="model.embed_tokens.weight")  # differs in a frozen one
    other_full, _ = plan(new_transport(), other, 1)
    engine, updater = await started_updater()
    try:
        await deliver(updater, other_full.header, other_full.payload)
        before = engine_bits(engine)
        with pytest.raises(FailedPrecondition, match="differ from the trainer's"):
            await deliver(updater, delta2.encoded.header, delta2.encoded.payload)
        assert updater.version == 1 and updater.intact and engine_bits(engine) == before
    finally:
        await engine.close()


async def test_a_corrupted_delta_is_refused_by_its_checksum() -> None:
    v1 = base_state()
    transport = new_transport()
    full1, _ = plan(transport, v1, 1)
    _, delta2 = plan(transport, stepped(v1, 1), 2)
    engine, updater = await started_updater()
    try:
        await deliver(updater, full1.header, full1.payload)
        before = engine_bits(engine)
        damaged = bytearray(delta2.encoded.payload)
        damaged[-3] ^= 0x40
        with pytest.raises(InvalidArgument, match="checksum mismatch"):
            await deliver(updater, delta2.encoded.header, damaged)
        assert updater.version == 1 and engine_bits(engine) == before
    finally:
        await engine.close()


async def test_a_replica_with_delta_never_refuses_deltas() -> None:
    v1 = base_state()
    transport = new_transport()
    full1, _ = plan(transport, v1, 1)
    _, delta2 = plan(transport, stepped(v1, 1), 2)
    engine, updater = await started_updater("never")
    try:
        await deliver(updater, full1.header, full1.payload)
        with pytest.raises(FailedPrecondition, match="keeps no base"):
            updater.check(delta2.encoded.header)
    finally:
        await engine.close()


def test_the_transport_sends_a_delta_as_its_mode_says() -> None:
    """``always``: whenever there is a base; ``auto``: when at most ``AUTO_DELTA_FRACTION`` of
    the full push (one moved norm: yes; every tensor but the embedding moved: no)."""
    v1 = base_state()
    everything = {name: t + 1e-3 for name, t in v1.items()}  # every tensor moved
    one = stepped(v1, 1, only="model.norm.weight")
    for mode, state, wanted in [
        ("always", everything, True),
        ("always", one, True),
        ("auto", stepped(v1, 1), False),
        ("auto", one, True),
        ("never", one, False),
    ]:
        transport = new_transport(mode)
        plan(transport, v1, 1)
        _, delta = plan(transport, state, 2)
        assert (delta is not None and delta.encoded is not None) is wanted, (mode, wanted)


def test_a_delta_goes_only_to_serving_replicas_on_its_base() -> None:
    v1 = base_state()
    transport = new_transport()
    plan(transport, v1, 1)
    _, delta = plan(transport, stepped(v1, 1, only="model.norm.weight"), 2)
    on_base = ReplicaStatus("a", "x:1", 1, ReplicaState.SERVING, 0, "hf", 0, 0.0)
    assert _delta_for(on_base, delta) is delta.encoded
    assert _delta_for(replace(on_base, weight_version=0), delta) is None
    assert _delta_for(replace(on_base, state=ReplicaState.UPDATE_FAILED), delta) is None


def test_lora_updates_are_sent_as_deltas_too() -> None:
    adapter = {"lora::m.weight::A": torch.ones(2, 4), "lora::m.weight::B": torch.zeros(4, 2)}
    moved = {**adapter, "lora::m.weight::B": torch.full((4, 2), 0.5)}
    transport = new_transport()
    plan(transport, adapter, 1)
    delta = plan(transport, moved, 2)[1]
    assert delta is not None and delta.base == 1
    names = [e.name for e in delta.encoded.header.tensors[1:]]
    assert names == [weights_delta.tensor_name("lora::m.weight::B")]


def test_the_trainers_fleet_sends_deltas_as_its_config_says():
    """``connect_fleet`` builds the weight sync with ``trainer.weight_delta`` (no channel is
    opened until a call)."""
    import asyncio

    from rlfleet.trainer.fleet import connect_fleet

    async def delta_mode(mode: str) -> str:
        fleet = await connect_fleet(config(mode))
        try:
            return fleet.weight_sync._transport.delta
        finally:
            await fleet.close()

    assert [asyncio.run(delta_mode(m)) for m in ("never", "auto", "always")] == [
        "never",
        "auto",
        "always",
    ]
