"""Asynchronous training (``trainer.mode: async``) with the in-process fakes of
``trainer_fakes``: k = 0 is the synchronous loop, staleness never exceeds k, stale responses
are dropped and counted."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from trainer_fakes import make_trainer, prompts

from rlfleet.common.errors import FailedPrecondition
from rlfleet.trainer.loggers import StepWriter
from rlfleet.trainer.pipeline import AsyncRollouts
from rlfleet.trainer.run import TrainingClock, train_loop
from rlfleet.trainer.staleness import drop_stale


class MemoryWriter(StepWriter):
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.samples: list[Mapping] = []

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.rows.append({"step": step, **metrics})

    def log_samples(self, step: int, samples: list[Mapping]) -> None:
        self.samples += samples


def run(trainer, steps: int) -> list[dict]:
    """Start the trainer and run ``steps`` steps of its configured mode."""
    writer = MemoryWriter()
    records = prompts(4 * steps)

    async def go():
        await trainer.start(1, 1.0)
        await train_loop(trainer, records, writer, (), TrainingClock(1.0))

    asyncio.run(go())
    return writer.rows


def seeded_trainer(mode: str, staleness: int, **overrides):
    torch.manual_seed(0)
    items: dict[str, Any] = {
        "trainer.mode": mode,
        "trainer.max_staleness": staleness,
        "trainer.total_steps": 3,
        "data.train_batch_size": 4,
        **overrides,
    }
    trainer = make_trainer(**items)
    torch.manual_seed(1)
    return trainer


def test_async_with_zero_staleness_equals_sync():
    sync_rows = run(seeded_trainer("sync", 0), 3)
    async_rows = run(seeded_trainer("async", 0), 3)
    for name in ("actor/pg_loss", "critic/score/mean", "actor/grad_norm"):
        assert [r[name] for r in async_rows] == pytest.approx([r[name] for r in sync_rows])
    assert all(r["async/staleness/max"] == 0 for r in async_rows)


class LaggingRollout:
    """Serves whatever version the replicas hold, if it meets the request's minimum."""

    def __init__(self, inner, sync) -> None:
        self.inner, self.sync = inner, sync

    async def generate(self, request):
        held = self.sync.pushed[-1] if self.sync.pushed else 0
        assert held >= request.min_weight_version, (held, request.min_weight_version)
        result = await self.inner.generate(request)
        result.weight_version = held
        return result

    async def generate_batch(self, requests):
        return [await self.generate(request) for request in requests]

    async def close(self):
        pass


def test_staleness_never_exceeds_k_and_overlap_happens():
    trainer = seeded_trainer("async", 1, **{"trainer.total_steps": 6})
    trainer.fleet.rollout = LaggingRollout(trainer.fleet.rollout, trainer.fleet.weight_sync)
    rows = run(trainer, 6)
    lags = [r["async/staleness/max"] for r in rows]
    assert max(lags) <= 1
    assert max(lags) == 1  # the producer really ran one version ahead
    assert all(r["async/dropped"] == 0 for r in rows)
    assert trainer.version == 7  # start push (v1) + 6 steps


def test_stale_rows_are_dropped_whole_groups():
    trainer = make_trainer()
    asyncio.run(trainer.start(1, 1.0))
    batch = asyncio.run(trainer.collector.generate(prompts(2), 0, 1))
    batch.weight_versions = [1] * 8 + [3] * 8
    # per-token versions agree with the rows' (staleness is per token)
    rows = zip(batch.weight_versions, batch.responses, strict=True)
    batch.token_versions = [[v] * len(r) for v, r in rows]
    kept, dropped = drop_stale(batch, oldest=2)
    assert dropped == 8 and len(kept) == 8
    assert kept.group_ids == [1] * 8 and kept.prompts == batch.prompts[8:]


def test_a_batch_with_nothing_fresh_enough_stops_the_run():
    trainer = seeded_trainer("async", 0, version_offset=-1)
    with pytest.raises(FailedPrecondition, match="older than weight version"):
        run(trainer, 1)


def test_min_version_follows_the_step():
    trainer = make_trainer(**{"trainer.mode": "async", "trainer.max_staleness": 2})
    trainer.version = 5
    rollouts = AsyncRollouts(
        trainer.collector,
        trainer.pushes,
        iter([]),
        first_step=10,
        first_version=trainer.version,
        staleness=2,
    )
    assert [rollouts.min_version(s) for s in (10, 11, 12, 13)] == [5, 5, 5, 6]


def test_skipping_zero_advantage_rows_gives_the_same_update():
    """Rows whose advantage is zero everywhere are not trained, and the weights after the
    step equal those of a step over every row."""
    from rlfleet.trainer.rollout_batch import response_mask

    def updated_weights(skip: bool):
        torch.manual_seed(0)
        # One forward per row in both runs: the shared-prompt forward groups different row
        # sets (1 prompt vs 3), whose float rounding Adam can magnify past this tolerance.
        overrides: dict[str, Any] = {
            "trainer.use_kl_loss": "false",
            "trainer.share_prompt_forward": "false",
        }
        trainer = make_trainer(**overrides)
        asyncio.run(trainer.start(1, 1.0))
        torch.manual_seed(2)
        batch = asyncio.run(trainer.collector.generate(prompts(3), 0, 1))
        mask = response_mask(batch.response_lengths())
        advantages = torch.zeros_like(mask)
        advantages[8:16] = torch.linspace(-1, 1, 8)[:, None]  # only the middle group learns
        if not skip:  # make the skip impossible without changing the gradient
            trainer.actor._rows_with_gradient = lambda idx, adv, m: (idx, 1.0)
        metrics = trainer.actor.update(batch, advantages * mask, mask)
        return metrics, [p.detach().clone() for p in trainer.actor.model.parameters()]

    skipped_metrics, skipped = updated_weights(skip=True)
    full_metrics, full = updated_weights(skip=False)
    assert skipped_metrics["actor/trained_fraction"] == pytest.approx(1 / 3)
    assert skipped_metrics["actor/grad_norm"] == pytest.approx(full_metrics["actor/grad_norm"])
    for a, b in zip(skipped, full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class ZeroEveryOtherCall:
    """The reward service, except that every other ``ScoreBatch`` scores all zeros: the first
    round of each step has no group with a spread and must be refilled."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    async def score_batch(self, requests):
        self.calls += 1
        results = await self.inner.score_batch(requests)
        if self.calls % 2:
            for result in results:
                result.score = 0.0
        return results

    async def close(self):
        pass


def test_async_mode_refills_groups_without_signal_and_counts_them():
    trainer = seeded_trainer(
        "async", 1, **{"algorithm.filter_groups.enable": "true", "rollout.n": 4}
    )
    trainer.fleet.reward = ZeroEveryOtherCall(trainer.fleet.reward)
    trainer.collector.fleet = trainer.fleet
    rows = run(trainer, 3)
    assert len(rows) == 3
    for row in rows:
        assert row["batch/dropped_groups"] >= 4  # the all-zero first round, every group of it
        assert row["batch/refill_rounds"] >= 1
        assert row["dapo/gen_rounds"] == row["batch/refill_rounds"] + 1
        assert row["async/staleness/max"] <= 1  # refills are drawn for the step's own version
    # every round drew a fresh batch from the producer's data stream, and the trainer counts
    # them (a resumed run skips exactly these)
    assert trainer.batches_consumed == sum(r["dapo/gen_rounds"] for r in rows)


def test_each_validation_of_an_async_run_is_pinned_to_the_version_just_trained():
    trainer = seeded_trainer("async", 1, **{"trainer.test_freq": 1})
    writer = MemoryWriter()

    async def go():
        await trainer.start(1, 1.0)
        await train_loop(trainer, prompts(12), writer, prompts(3), TrainingClock(1.0))

    asyncio.run(go())
    steps = [r for r in writer.rows if "training/weight_version" in r]
    validations = [r for r in writer.rows if "val/weight_version" in r]
    assert len(steps) == len(validations) == 3
    for step, val in zip(steps, validations, strict=True):
        assert val["step"] == step["step"]
        assert val["val/weight_version"] == step["training/weight_version"]  # one version each
        assert "val/mixed_versions" not in val


def test_answers_from_two_versions_are_flagged():
    from rlfleet.trainer.evaluate import Evaluator

    evaluator = Evaluator(seeded_trainer("async", 1).config, None, None)
    evaluator.versions = {4, 5}
    assert evaluator.version_metrics(4) == {"val/weight_version": 4.0, "val/mixed_versions": 1.0}
    evaluator.versions = set()
    assert evaluator.version_metrics(7) == {"val/weight_version": 7.0}


def test_async_steps_report_the_split_lag():
    trainer = seeded_trainer(
        "async", 1, **{"trainer.max_in_queue_lag": 1, "trainer.max_in_flight_lag": 0}
    )
    trainer.fleet.rollout = LaggingRollout(trainer.fleet.rollout, trainer.fleet.weight_sync)
    rows = run(trainer, 4)
    for row in rows:
        assert row["off_policy/in_flight/max"] == 0  # whole requests, no update crossed one
        assert row["off_policy/in_queue/max"] == row["async/staleness/max"] <= 1
        assert row["off_policy/dropped"] == row["async/dropped"] == 0
