"""A transient failure (Redis outage, a restarting service) costs the trainer a retry of the
step's rollout or of its weight push, never the run; other errors still end it at once.

In-process fakes (``trainer_fakes``) stand in for the services; the integration test
``test_redis_outage`` restarts a real Redis under a real fleet and trainer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from trainer_fakes import RecordingSync, SamplingRollout, make_trainer, prompts

from rlfleet.common.errors import InvalidArgument, Unavailable
from rlfleet.rollout.types import GenerateRequest, GenerateResult
from rlfleet.trainer import retry


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(retry, "FIRST_PAUSE_S", 0.01)


class FlakyRollout(SamplingRollout):
    """Fails the first ``failures`` batches with ``error``; records every batch's ids."""

    def __init__(self, model: Any, failures: int, error: Exception) -> None:
        super().__init__(model)
        self.failures, self.error = failures, error
        self.batches: list[list[str]] = []

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        self.batches.append([r.request_id for r in requests])
        if len(self.batches) <= self.failures:
            raise self.error
        return await super().generate_batch(requests)


class FlakySync(RecordingSync):
    """The first push fails as if the router could not list replicas (Redis down)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool]] = []

    async def push(
        self, state_dict: dict, version: int, flush_cache: bool = True, only_stale: bool = False
    ) -> dict[str, float]:
        self.calls.append((version, only_stale))
        if len(self.calls) == 2:  # the first push after start
            raise Unavailable("router UNAVAILABLE: Redis down")
        return await super().push(state_dict, version, flush_cache, only_stale)


def flaky_trainer(failures: int, error: Exception, **overrides):
    trainer = make_trainer(**{"trainer.mode": "sync", **overrides})
    trainer.fleet.rollout = FlakyRollout(trainer.actor.model, failures, error)
    trainer.collector.fleet = trainer.fleet
    asyncio.run(trainer.start(1, 1.0))
    return trainer


def test_rollout_is_retried_with_the_same_request_ids():
    trainer = flaky_trainer(2, Unavailable("router UNAVAILABLE: Redis down"))
    asyncio.run(trainer.train_step(prompts()))
    batches = trainer.fleet.rollout.batches
    assert len(batches) == 3 and batches[0] == batches[1] == batches[2]
    assert trainer.version == 2  # one step, one update: the retry did not train twice


def test_errors_retrying_cannot_fix_end_the_step_at_once():
    trainer = flaky_trainer(1, InvalidArgument("prompt too long"))
    with pytest.raises(InvalidArgument):
        asyncio.run(trainer.train_step(prompts()))
    assert len(trainer.fleet.rollout.batches) == 1


def test_retries_stop_after_the_budget():
    """With no budget left the first failure still gets its one retry, then the step fails."""
    trainer = flaky_trainer(100, Unavailable("still down"), **{"trainer.step_retry_s": 0})
    with pytest.raises(Unavailable, match="still down"):
        asyncio.run(trainer.train_step(prompts()))
    assert len(trainer.fleet.rollout.batches) == 2


def test_failed_weight_push_is_retried_to_stale_replicas_only():
    trainer = make_trainer(**{"trainer.mode": "sync"})
    trainer.fleet.weight_sync = sync = FlakySync()
    asyncio.run(trainer.start(1, 1.0))
    asyncio.run(trainer.train_step(prompts()))
    # start pushes v1; the step's push of v2 fails once, then goes to replicas behind v2
    assert sync.calls == [(1, False), (2, False), (2, True)]
    assert sync.pushed == [1, 2] and trainer.pushes.landed_version == 2
