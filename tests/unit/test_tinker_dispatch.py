"""How the Tinker API hands work on: the sampler's batches, the compute queue, the key check.

``Batcher`` sends the samples that keep arriving as one ``generate_batch`` (and caps the wait);
a training client's next call is queued on the compute thread while the one before still
runs; the API key is checked on every route but ``healthz`` (``X-API-Key`` or ``Bearer``);
the SDK's HTTP client runs on pyqwest only over plain HTTP.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from fastapi.testclient import TestClient

from rlfleet.common.config.tinker import TinkerConfig
from rlfleet.rollout.types import GenerateResult
from rlfleet.trainer.tinker.app import create_app
from rlfleet.trainer.tinker.futures import Done
from rlfleet.trainer.tinker.sampler import Batcher
from rlfleet.trainer.tinker.service import TinkerService, TrainingModel
from rlfleet.trainer.tinker.types import LoraSpec


class Router:
    """Records the batches it is sent; answers each request with an empty result."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    async def generate_batch(self, requests) -> list[GenerateResult]:
        self.batches.append([r.request_id for r in requests])
        return [GenerateResult(r.request_id, [], 0, "r0") for r in requests]


class Request:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


async def _arrive(batcher: Batcher, names: list[str], gap_s: float) -> None:
    async def one(i: int, name: str) -> None:
        await asyncio.sleep(i * gap_s)
        assert (await batcher.generate(Request(name))).request_id == name  # type: ignore[arg-type]

    await asyncio.gather(*(one(i, n) for i, n in enumerate(names)))


async def test_samples_arriving_apart_still_go_as_one_batch() -> None:
    router = Router()
    # 6 calls 20 ms apart: past a fixed 50 ms after the first, within 50 ms of each other
    await _arrive(Batcher(router, linger_s=0.05, max_linger_s=1.0), list("abcdef"), 0.02)
    assert router.batches == [list("abcdef")]


async def test_a_quiet_gap_or_the_longest_wait_closes_a_batch() -> None:
    router = Router()
    batcher = Batcher(router, linger_s=0.02, max_linger_s=1.0)
    await asyncio.gather(_arrive(batcher, ["a", "b"], 0.0), _late(batcher, "c", 0.3))
    assert router.batches == [["a", "b"], ["c"]]
    capped = Router()
    await _arrive(Batcher(capped, linger_s=0.05, max_linger_s=0.1), list("abcdefgh"), 0.04)
    assert len(capped.batches) > 1 and sum(capped.batches, []) == list("abcdefgh")


async def _late(batcher: Batcher, name: str, after_s: float) -> None:
    await asyncio.sleep(after_s)
    await batcher.generate(Request(name))  # type: ignore[arg-type]


def _service() -> TinkerService:
    return TinkerService(TinkerConfig(), None, None, None, Path("."))  # type: ignore[arg-type]


async def test_the_next_call_is_queued_while_the_one_before_runs() -> None:
    service, running, release, ran = _service(), threading.Event(), threading.Event(), []
    model = TrainingModel("m", "s", "a", LoraSpec(rank=1))

    def first() -> str:
        running.set()
        release.wait(5)
        ran.append(1)
        return "first"

    ids = [service._ordered(model, 2, ran.append, 2), service._ordered(model, 1, first)]
    await asyncio.to_thread(running.wait, 5)
    for _ in range(50):  # call 2 gets its turn (is queued) without call 1 having ended
        if model.gate.next == 3:
            break
        await asyncio.sleep(0.01)
    assert model.gate.next == 3 and ran == []
    release.set()
    outcomes = [await service.futures.retrieve(i, wait_s=5) for i in ids]
    assert outcomes == [Done(None), Done("first")] and ran == [1, 2]
    service._compute.shutdown()


def test_the_key_guards_every_route_but_healthz_and_pyqwest_is_off_over_https() -> None:
    client = TestClient(create_app(_service(), "tml-key"))
    assert client.get("/api/v1/healthz").status_code == 200
    refused = client.post("/api/v1/client/config")
    assert refused.status_code == 401 and "API key" in refused.json()["detail"]
    wrong = client.post("/api/v1/client/config", headers={"X-API-Key": "tml-other"})
    assert wrong.status_code == 401
    for headers in ({"X-API-Key": "tml-key"}, {"Authorization": "Bearer tml-key"}):
        answer = client.post("/api/v1/client/config", headers=headers)
        assert answer.status_code == 200 and answer.json()["use_pyqwest_transport"] is True
    https = TestClient(create_app(_service(), None, https=True))
    assert https.post("/api/v1/client/config").json()["use_pyqwest_transport"] is False
