"""The parity probe in the trainer's pushes (``WeightPushes``): a sync push reports
``weight/parity_max_abs_diff``; an async publish takes the actor's side at publish time, so
the actor training on while the push lands does not fail a replica holding what was pushed;
a replica holding other weights is drained."""

from __future__ import annotations

import asyncio
import copy

import torch
from test_weight_check import FakeFleet
from trainer_fakes import make_trainer

from rlfleet.rollout.engines.hf import teacher_forced
from rlfleet.rollout.types import ReplicaStatus, ScoreRequest, TokenScores
from rlfleet.trainer.weight_check import METRIC, WeightCheck, probe_of


class ModelReplica(FakeFleet):
    """One replica, ``r0``, at the version last pushed, scoring with a model of its own."""

    def __init__(self, model, pushed: list[int]) -> None:
        super().__init__({}, {})
        self.model, self.pushed = model, pushed

    async def list_replicas(self) -> list[ReplicaStatus]:
        self.versions = {"r0": self.pushed[-1]}
        return await super().list_replicas()

    async def score_tokens(self, replica: ReplicaStatus, request: ScoreRequest) -> TokenScores:
        rows = [
            teacher_forced(self.model, s.prompt_token_ids, s.target_token_ids)
            for s in request.sequences
        ]
        return TokenScores(rows, self.pushed[-1])


def attach(trainer, replica_model) -> ModelReplica:
    replica = ModelReplica(replica_model, trainer.fleet.weight_sync.pushed)
    config = trainer.config.model_copy(deep=True)
    config.trainer.weight_check.enable = True
    probe = probe_of([[1, 2, 3, 4, 5, 6]], tokens=4, max_len=32)
    trainer.pushes.check = WeightCheck(config, probe, replica, bound=0.01)
    return replica


def test_a_sync_push_reports_the_parity_of_a_replica_holding_the_weights():
    trainer = make_trainer()
    replica = attach(trainer, trainer.actor.model)
    metrics = asyncio.run(trainer.pushes.push(1))
    assert metrics[METRIC] < 1e-5 and f"{METRIC}/r0" in metrics
    assert "timing_s/weight_check" in metrics and replica.drained == []


def test_a_replica_holding_other_weights_is_drained():
    trainer = make_trainer()
    other = copy.deepcopy(trainer.actor.model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(3.0)
    replica = attach(trainer, other)
    metrics = asyncio.run(trainer.pushes.push(1))
    assert metrics[METRIC] > 0.01 and replica.drained == ["r0"]


def test_an_async_publish_scores_the_actor_before_it_trains_on():
    trainer = make_trainer(**{"trainer.mode": "async"})
    replica = attach(trainer, copy.deepcopy(trainer.actor.model))  # what the push carries

    async def publish_then_train() -> dict[str, float]:
        await trainer.pushes.publish(1)
        with torch.no_grad():  # the next update, while the push is in flight
            for p in trainer.actor.model.parameters():
                p.mul_(3.0)
        return await trainer.pushes.finish()

    metrics = asyncio.run(publish_then_train())
    assert metrics[METRIC] < 1e-5 and replica.drained == []
