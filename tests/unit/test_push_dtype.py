"""Weight pushes keep the actor's dtype: a bf16 actor pushes bf16, and the replica then holds
the actor's weights bit for bit, over the streamed path and over shared memory; an update the
replica would round on load is refused before anything changes, unless ``rollout.dtype`` asks
for the engines' own dtype: then the trainer sends its weights cast to it.

The tiny policy cast to bf16 always; SmolLM2 (``make smollm2``) once, when it is built here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from rlfleet.common.config import load_config
from rlfleet.common.errors import InvalidArgument
from rlfleet.model import weights, weights_shm
from rlfleet.model.local_models import SMOLLM2, is_built, model_dir
from rlfleet.model.model_io import load_causal_lm
from rlfleet.model.precision import serving_dtype
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.weight_updates import WeightUpdater, check_no_narrowing, verified
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.pushes import cast_weights

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-arith"
pytestmark = pytest.mark.skipif(
    not (TINY / "model.safetensors").exists(), reason="tiny model not built"
)


def config(model: Path | str, dtype: str, *extra: str):
    return load_config(
        overrides=[f"model.path={model}", f"model.dtype={dtype}", "rollout.backend=hf", *extra]
    )


def trained_actor(model: Path | str, dtype: str, seed: int = 0) -> Actor:
    """An actor in ``dtype`` whose weights moved away from the checkpoint (as after a step)."""
    cfg = config(model, dtype)
    actor = Actor(cfg, load_causal_lm(str(model), dtype), pad_id=0)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in actor.model.parameters():
            param.add_(torch.randn_like(param) * 1e-2)
    return actor


def streamed(header: weights.WeightHeader, payload: memoryview) -> memoryview:
    """What a replica holds after the chunks of a gRPC stream: one ``PayloadBuffer``."""
    buffer = weights.PayloadBuffer(header.total_bytes)
    for chunk in weights.iter_chunks(payload, weights.DEFAULT_CHUNK_BYTES):
        buffer.write(chunk)
    return buffer.payload()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtypes, shapes and every byte (NaN-safe, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(raw(a), raw(b))


def assert_replica_equals_actor(engine: HFEngine, state: Mapping[str, torch.Tensor]) -> None:
    params = engine.model.state_dict()
    different = [name for name, tensor in state.items() if not same_bits(params[name], tensor)]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


async def push_through_replica_path(
    model: Path | str, dtype: str, transport: str, version: int = 1
) -> tuple[HFEngine, dict[str, torch.Tensor], weights.WeightHeader]:
    """The actor's ``state_dict_for_rollout`` encoded as the trainer does, received as the
    replica does (stream chunks or the shared-memory file), verified and loaded by the
    replica's ``WeightUpdater`` into a real HF engine."""
    actor = trained_actor(model, dtype)
    state = actor.state_dict_for_rollout()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    shared = weights_shm.SharedPayload(nbytes) if transport == "shm" else None
    try:
        allocate = (lambda _: shared.tensor()) if shared is not None else None
        header, payload = weights.encode(state, version, allocate=allocate)
        received = (
            weights_shm.open_shared(shared.name, header.total_bytes)
            if shared is not None
            else streamed(header, payload)
        )
        engine = HFEngine(config(model, dtype))
        await engine.start()
        updater = WeightUpdater(engine.config, engine, lambda _: None)
        updater.check(header)
        await updater.load(header, verified(header, received))
    finally:
        if shared is not None:
            shared.close()
    return engine, state, header


@pytest.mark.parametrize("transport", ["stream", "shm"])
async def test_bf16_actor_pushes_bf16_and_the_replica_holds_its_bits(transport: str) -> None:
    engine, state, header = await push_through_replica_path(TINY, "bfloat16", transport)
    try:
        assert {entry.dtype for entry in header.tensors} == {"bfloat16"}
        assert header.total_bytes == sum(t.numel() * 2 for t in state.values())  # half of fp32
        assert_replica_equals_actor(engine, state)
    finally:
        await engine.close()


async def test_float32_actor_pushes_float32_exactly() -> None:
    engine, state, header = await push_through_replica_path(TINY, "float32", "stream")
    try:
        assert {entry.dtype for entry in header.tensors} == {"float32"}
        assert_replica_equals_actor(engine, state)
    finally:
        await engine.close()


def header_of(dtype: torch.dtype, name: str = "w") -> weights.WeightHeader:
    return weights.encode({name: torch.zeros(4, dtype=dtype)}, 1)[0]


@pytest.mark.parametrize(
    ("pushed", "serving"),
    [
        (torch.float32, "bfloat16"),
        (torch.float32, "float16"),
        (torch.float16, "bfloat16"),
        (torch.bfloat16, "float16"),
    ],
)
def test_an_update_the_replica_would_round_is_refused(pushed: torch.dtype, serving: str) -> None:
    with pytest.raises(InvalidArgument, match=f"model.dtype={serving}"):
        check_no_narrowing(header_of(pushed), serving)


@pytest.mark.parametrize(
    ("pushed", "serving"),
    [
        (torch.bfloat16, "bfloat16"),
        (torch.bfloat16, "float32"),
        (torch.float16, "float32"),
        (torch.float32, "float32"),
    ],
)
def test_exact_updates_pass(pushed: torch.dtype, serving: str) -> None:
    check_no_narrowing(header_of(pushed), serving)


def test_lora_adapter_tensors_are_not_held_to_the_base_dtype() -> None:
    check_no_narrowing(header_of(torch.float32, "lora::m.weight::A"), "bfloat16")


async def test_refused_narrowing_leaves_the_replica_unchanged() -> None:
    """A float32 actor pushing to a bf16 replica is refused at the header (``check``)."""
    engine = HFEngine(config(TINY, "bfloat16"))
    await engine.start()
    try:
        before = {name: t.clone() for name, t in engine.model.state_dict().items()}
        state = trained_actor(TINY, "float32").state_dict_for_rollout()
        header, _ = weights.encode(state, 1)
        updater = WeightUpdater(engine.config, engine, lambda _: None)
        with pytest.raises(InvalidArgument, match="would round on load"):
            updater.check(header)
        assert updater.version == 0
        assert_replica_equals_actor(engine, before)
    finally:
        await engine.close()


async def test_a_set_rollout_dtype_serves_the_actors_weights_cast_to_it() -> None:
    """A float32 actor with ``rollout.dtype=bfloat16``: the engine loads in bf16, takes the
    bf16 cast of the actor's weights (half the bytes), and holds exactly that cast."""
    cfg = config(TINY, "float32", "rollout.dtype=bfloat16")
    engine = HFEngine(cfg)
    await engine.start()
    try:
        assert engine.dtype == "bfloat16"
        assert next(engine.model.parameters()).dtype == torch.bfloat16
        fp32 = trained_actor(TINY, "float32").state_dict_for_rollout()
        state = cast_weights(fp32, "bfloat16")
        header, payload = weights.encode(state, 1)
        assert header.total_bytes == sum(t.numel() * 2 for t in fp32.values())
        updater = WeightUpdater(cfg, engine, lambda _: None)
        updater.check(header)
        await updater.load(header, verified(header, streamed(header, payload)))
        assert_replica_equals_actor(engine, state)
    finally:
        await engine.close()


def test_a_set_rollout_dtype_takes_float32_updates_and_casts_them() -> None:
    """A replica asked for bf16 on purpose casts a float32 push on load (the trainer on another
    host may resolve ``auto`` to float32) instead of refusing it."""
    cfg = config(TINY, "float32", "rollout.dtype=bfloat16")
    engine = HFEngine(cfg)  # not started: the header check needs no weights
    updater = WeightUpdater(cfg, engine, lambda _: None)
    updater.check(header_of(torch.float32))


def test_cast_weights_leaves_adapters_and_integers_alone() -> None:
    state = {"w": torch.ones(2), "lora::m.weight::A": torch.ones(2), "steps": torch.ones(2).long()}
    cast = cast_weights(state, "bfloat16")
    assert [t.dtype for t in cast.values()] == [torch.bfloat16, torch.float32, torch.int64]
    assert cast_weights({"w": state["w"]}, "float32")["w"] is state["w"]  # no copy


@pytest.mark.parametrize(
    ("model", "rollout", "fast", "expected"),
    [
        ("float32", None, True, "float32"),
        ("float32", "auto", True, "bfloat16"),
        ("float32", "auto", False, "float32"),
        ("float32", "float16", False, "float16"),
        ("bfloat16", None, False, "bfloat16"),
    ],
)
def test_serving_dtype(monkeypatch, model, rollout, fast, expected) -> None:
    monkeypatch.setattr("rlfleet.model.precision.fast_bf16", lambda device: fast)
    assert serving_dtype(model, rollout, "cpu") == expected


SMOLLM2_DIR = model_dir(SMOLLM2)


@pytest.mark.slow
@pytest.mark.skipif(not is_built(SMOLLM2_DIR), reason="SmolLM2 not built (make smollm2)")
async def test_smollm2_bf16_push_is_bit_exact() -> None:
    engine, state, header = await push_through_replica_path(SMOLLM2, "bfloat16", "shm")
    try:
        assert {entry.dtype for entry in header.tensors} == {"bfloat16"}
        assert header.total_bytes > 250 * 2**20  # the whole 135M model, 2 bytes a weight
        assert_replica_equals_actor(engine, state)
    finally:
        await engine.close()
