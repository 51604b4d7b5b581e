"""One weight update's order on a replica (``update_steps.UpdateSteps``): the bytes are
decoded, verified and staged while the replica serves; admission closes only for the swap
and the flush; a refused update never closes it; the pause is timed and reported.

The parts are the replica's own (``Phase``, ``InFlight``, ``WeightUpdater``) around an engine
that records, at each of its calls, the replica's state then; ``announce`` (the heartbeat in
a replica) records the state it publishes. A real replica process does the same in
tests/integration/test_fetch_before_pause.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from rlfleet.common.config import load_config
from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.model import weights, weights_delta
from rlfleet.rollout import convert
from rlfleet.rollout.engines.base import Engine, StagedWeights
from rlfleet.rollout.inflight import InFlight
from rlfleet.rollout.phase import Phase
from rlfleet.rollout.types import ReplicaState, UpdateOutcome
from rlfleet.rollout.update_steps import UpdateSteps
from rlfleet.rollout.weight_updates import WeightUpdater
from rlfleet.trainer.weight_sync import push_metrics
from rlfleet.trainer.weight_transport import PushResult

S = ReplicaState
V1 = {"a": torch.arange(8, dtype=torch.float32), "b": torch.ones(2, 2)}


class RecordingEngine(Engine):
    """Holds what it swaps in; logs ``(call, replica state)`` at staging and swapping."""

    name = "recording"

    def __init__(self, phase: Phase, log: list, stage_s: float = 0.0, swap_s: float = 0.0):
        super().__init__(load_config(overrides=["model.path=/nonexistent"], env={}))
        self.phase, self.log, self.stage_s, self.swap_s = phase, log, stage_s, swap_s
        self.held = {name: t.clone() for name, t in V1.items()}
        self.changes: Mapping[str, Any] | None = None

    async def stage_weights(self, state_dict, changes=None) -> StagedWeights:
        self.log.append(("stage", self.phase.state, self.phase.serving.is_set()))
        await asyncio.sleep(self.stage_s)
        if set(state_dict) != set(V1):
            raise InvalidArgument("names do not match")
        self.changes = changes
        return StagedWeights(lambda: self._swap(state_dict))

    async def _swap(self, state_dict) -> None:
        self.log.append(("swap", self.phase.state, self.phase.serving.is_set()))
        await asyncio.sleep(self.swap_s)
        self.held = {name: t.clone() for name, t in state_dict.items()}

    async def load_weights(self, state_dict) -> None:
        await (await self.stage_weights(state_dict)).apply()

    async def flush_cache(self) -> bool:
        self.log.append(("flush", self.phase.state, self.phase.serving.is_set()))
        return True

    async def start(self) -> None:
        return None

    async def generate(self, request_id, prompt_token_ids, sampling) -> list:
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        return None

    async def close(self) -> None:
        return None


def steps(stage_s: float = 0.0, swap_s: float = 0.0) -> tuple[UpdateSteps, RecordingEngine, list]:
    log: list = []
    phase = Phase("r0")
    phase.set(S.SERVING)
    engine = RecordingEngine(phase, log, stage_s, swap_s)
    config = engine.config
    updater = WeightUpdater(config, engine, lambda _: None)

    async def announce() -> None:
        log.append(("announce", phase.state, phase.serving.is_set()))

    return UpdateSteps(config, updater, phase, InFlight("r0"), announce), engine, log


def new_weights() -> dict[str, torch.Tensor]:
    return {"a": V1["a"] + 1, "b": V1["b"] * 2}


async def test_decode_verify_and_stage_run_while_serving_and_only_the_swap_is_paused() -> None:
    update, engine, log = steps()
    header, payload = weights.encode(new_weights(), 1)
    outcome = await update.run(header, bytearray(payload))
    assert [entry[0] for entry in log] == ["stage", "announce", "swap", "flush", "announce"]
    assert log[0] == ("stage", S.SERVING, True)  # decoded and verified before it
    assert log[2] == ("swap", S.UPDATING, False) and log[3] == ("flush", S.UPDATING, False)
    assert log[4] == ("announce", S.SERVING, True)
    assert outcome.version == 1 and update.phase.state is S.SERVING
    assert torch.equal(engine.held["a"], V1["a"] + 1)


async def test_the_pause_is_the_swap_not_the_staging_and_comes_back_in_the_reply() -> None:
    update, _, _ = steps(stage_s=0.5, swap_s=0.02)
    header, payload = weights.encode(new_weights(), 1)
    outcome = await update.run(header, bytearray(payload))
    assert 0.02 <= outcome.pause_seconds < 0.5  # staging (0.5 s) was outside it
    assert outcome.prepare_seconds >= 0.5
    assert outcome.load_seconds <= outcome.pause_seconds


def damaged(payload: memoryview) -> bytearray:
    raw = bytearray(payload)
    raw[3] ^= 0x40
    return raw


def non_finite() -> dict[str, torch.Tensor]:
    return {"a": torch.full((8,), float("nan")), "b": torch.ones(2, 2)}


@pytest.mark.parametrize("case", ["checksum", "nan", "engine refuses"])
async def test_a_refused_update_never_pauses_the_replica_and_changes_nothing(case: str) -> None:
    update, engine, log = steps()
    if case == "checksum":
        header, payload = weights.encode(new_weights(), 1)
        payload = damaged(payload)
    elif case == "nan":
        header, payload = weights.encode(non_finite(), 1)
    else:
        header, payload = weights.encode({"c": torch.ones(3)}, 1)
    with pytest.raises(InvalidArgument):
        await update.run(header, bytearray(payload))
    assert all(entry[1] is S.SERVING for entry in log)  # never closed admission
    assert all(entry[0] == "stage" for entry in log)
    assert update.updater.version == 0 and update.phase.state is S.SERVING
    assert all(torch.equal(engine.held[n], V1[n]) for n in V1)


def delta_of(full: dict[str, torch.Tensor], version: int, base: int, change: dict):
    """A delta from ``base`` to ``full`` (version ``version``) changing ``change``'s elements
    (tensor name -> list of flat indices), in the wire form of ``weights_delta``."""
    full_header, _ = weights.encode(full, version)
    meta_name, meta = weights_delta.meta_tensor(full_header, base)
    state = {meta_name: meta}
    for name, positions in change.items():
        index = torch.tensor(positions, dtype=torch.int32)
        state[weights_delta.wire_name("index", name)] = index
        state[weights_delta.wire_name("value", name)] = full[name].reshape(-1)[index.long()]
    return weights.encode(state, version)


async def test_a_delta_is_made_whole_while_serving_and_the_engine_hears_what_changed() -> None:
    update, engine, log = steps()
    full_header, full_payload = weights.encode(V1, 1)
    await update.run(full_header, bytearray(full_payload))
    v2 = {"a": V1["a"].clone(), "b": V1["b"].clone()}
    v2["a"][[1, 6]] = torch.tensor([-1.0, -6.0])
    header, payload = delta_of(v2, 2, 1, {"a": [1, 6]})
    log.clear()
    outcome = await update.run(header, bytearray(payload))
    assert outcome.version == 2 and log[0][:2] == ("stage", S.SERVING)
    assert set(engine.changes) == {"a"} and engine.changes["a"].index.tolist() == [1, 6]
    assert torch.equal(engine.held["a"], v2["a"]) and torch.equal(engine.held["b"], V1["b"])


async def test_a_delta_on_another_base_is_refused_before_the_pause_and_keeps_the_base() -> None:
    update, engine, log = steps()
    full_header, full_payload = weights.encode(V1, 1)
    await update.run(full_header, bytearray(full_payload))
    v2 = {"a": V1["a"] + 0.5, "b": V1["b"]}
    header, payload = delta_of(v2, 2, 1, {"a": [0]})  # claims only element 0 changed
    log.clear()
    with pytest.raises(FailedPrecondition):
        await update.run(header, bytearray(payload))
    assert log == [] and update.updater.version == 1
    assert torch.equal(update.updater.base["a"], V1["a"])  # put back: a delta may still land
    assert torch.equal(engine.held["a"], V1["a"])


def test_push_metrics_hold_the_longest_pause_and_each_replica_s() -> None:
    results = [
        PushResult("r0", True, 2, 0.3, 100, pause_s=0.02),
        PushResult("r1", True, 2, 0.4, 100, pause_s=0.07),
        PushResult("r2", False, 1, 0.1, 0, "refused"),
    ]
    metrics = push_metrics(results)
    assert metrics["weight/pause_s"] == 0.07
    assert metrics["weight/pause_s/r0"] == 0.02 and metrics["weight/pause_s/r1"] == 0.07
    assert "weight/pause_s/r2" not in metrics


def test_the_pause_and_the_staging_cross_the_wire_in_the_reply() -> None:
    outcome = UpdateOutcome(7, 0.01, True, pause_seconds=0.02, prepare_seconds=0.3)
    assert convert.outcome_from_proto(convert.outcome_to_proto(outcome)) == outcome
