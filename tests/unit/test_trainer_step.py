"""The trainer's step logic with in-process fakes for the other services (``trainer_fakes``).

The actor is a real (tiny, random) Qwen2 model; generation samples from that same model so
the step is genuinely on-policy, and the reward prefers one token. The integration tests
run the same step through real servers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
import torch
from trainer_fakes import (
    GOOD_TOKEN,
    CharTokenizer,
    RecordingSync,
    SamplingRollout,
    make_trainer,
    prompts,
)

from rlfleet.common.errors import FailedPrecondition
from rlfleet.trainer.loggers import StepWriter


def good_token_probability(trainer) -> float:
    with torch.no_grad():
        logits = trainer.actor.model(torch.tensor([[1, 2, 3]])).logits[0, -1]
    return torch.softmax(logits, -1)[GOOD_TOKEN].item()


def test_step_pushes_next_version_and_reports_verl_metrics():
    trainer = make_trainer()
    asyncio.run(trainer.start(1, 1.0))
    metrics = asyncio.run(trainer.train_step(prompts()))
    # a catch-up push may repeat version 1 when the step runs slowly (a loaded machine)
    pushed = trainer.fleet.weight_sync.pushed
    assert sorted(set(pushed)) == [1, 2] and pushed[-1] == 2 and pushed == sorted(pushed)
    assert trainer.version == 2
    for name in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/kl_loss",
        "timing_s/gen",
        "timing_s/update_weights",
        "response_length/mean",
        "critic/advantages/mean",
    ):
        assert name in metrics, name
    requests = trainer.fleet.rollout.requests
    assert all(r.min_weight_version == 1 for r in requests)
    assert len({r.session_id for r in requests}) == len(requests)  # one session per group


def test_responses_from_other_weight_versions_are_refused():
    trainer = make_trainer(version_offset=-1)
    asyncio.run(trainer.start(1, 1.0))
    with pytest.raises(FailedPrecondition, match="weight versions"):
        asyncio.run(trainer.train_step(prompts()))
    assert trainer.version == 1  # nothing was trained or pushed


def test_grpo_steps_raise_probability_of_rewarded_token():
    trainer = make_trainer(**{"trainer.use_kl_loss": "false"})
    asyncio.run(trainer.start(1, 1.0))
    before = good_token_probability(trainer)
    for _ in range(15):
        asyncio.run(trainer.train_step(prompts(8)))
    after = good_token_probability(trainer)
    assert after > before * 1.5, (before, after)


def test_resume_continues_step_version_optimizer_and_weights(tmp_path):
    from rlfleet.trainer.run import restore, save_checkpoint

    class SavingTokenizer(CharTokenizer):
        def save_pretrained(self, path):
            (path / "tokenizer.marker").write_text("char")

    first = make_trainer()
    first.tokenizer = SavingTokenizer()
    asyncio.run(first.start(1, 1.0))
    for _ in range(2):
        asyncio.run(first.train_step(prompts()))
        first.step += 1
    checkpoint = save_checkpoint(first, tmp_path / "global_step_2")

    second = make_trainer(**{"trainer.resume_from": str(checkpoint)})
    second.actor.model.load_state_dict(first.actor.model.state_dict())  # build_actor's job
    restore(second)
    asyncio.run(second.start(1, 1.0))
    assert second.step == 2
    assert second.version == first.version + 1  # replicas get a version newer than any served
    assert second.actor.updates == first.actor.updates == 2
    first_state = first.actor.optimizer.state_dict()["state"]
    second_state = second.actor.optimizer.state_dict()["state"]
    assert torch.equal(first_state[0]["exp_avg"], second_state[0]["exp_avg"])


def test_resume_from_a_directory_without_state_is_refused(tmp_path):
    from rlfleet.common.errors import InvalidArgument
    from rlfleet.trainer.run import restore

    trainer = make_trainer(**{"trainer.resume_from": str(tmp_path)})
    with pytest.raises(InvalidArgument, match="trainer_state.pt"):
        restore(trainer)


def test_resume_mid_run_continues_exactly(tmp_path):
    """4 uninterrupted steps vs 2 steps, a checkpoint, a fresh trainer restored from it
    (``resume_mode: auto``) and 2 more: the same batches, losses and weights."""
    from rlfleet.trainer.checkpoints import step_checkpoints
    from rlfleet.trainer.run import TrainingClock, restore, train_loop

    class SavingTokenizer(CharTokenizer):
        def save_pretrained(self, path):
            (path / "tokenizer.marker").write_text("char")

    class Rows(StepWriter):
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def write(self, step: int, metrics: Mapping[str, float]) -> None:
            self.rows.append(dict(metrics))

        def log_samples(self, step: int, samples: list[Mapping]) -> None:
            pass

    records = prompts(16)
    settings = {"run_dir": str(tmp_path), "data.train_batch_size": 4, "trainer.save_freq": 2}

    def run_steps(trainer, total):
        trainer.config.trainer.total_steps = total
        writer = Rows()

        async def go():
            await trainer.start(1, 1.0)
            await train_loop(trainer, records, writer, (), TrainingClock(1.0))

        asyncio.run(go())
        return writer.rows

    torch.manual_seed(0)
    straight = make_trainer(**{**settings, "run_dir": str(tmp_path / "straight")})
    straight.tokenizer = SavingTokenizer()
    torch.manual_seed(1)
    expected = run_steps(straight, 4)

    torch.manual_seed(0)
    first = make_trainer(**settings)
    first.tokenizer = SavingTokenizer()
    torch.manual_seed(1)
    run_steps(first, 2)
    assert [step for step, _ in step_checkpoints(tmp_path)] == [2]

    torch.manual_seed(123)  # whatever the new process's seed, the checkpoint's RNG wins
    second = make_trainer(**settings)
    second.actor.model.load_state_dict(first.actor.model.state_dict())  # build_actor's job
    second.tokenizer = SavingTokenizer()
    restore(second)
    assert second.step == 2 and second.batches_consumed == 2
    resumed = run_steps(second, 4)
    for name in ("actor/pg_loss", "critic/score/mean", "actor/grad_norm"):
        assert [r[name] for r in resumed] == pytest.approx([r[name] for r in expected[2:]])
    for a, b in zip(
        second.actor.model.parameters(), straight.actor.model.parameters(), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_old_checkpoints_beyond_max_ckpt_to_keep_are_removed(tmp_path):
    from rlfleet.trainer.checkpoints import prune, step_checkpoints

    for step in (2, 4, 6):
        (tmp_path / "checkpoints" / f"global_step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"global_step_{step}" / "trainer_state.pt").write_text("x")
    prune(tmp_path, keep=2)
    assert [step for step, _ in step_checkpoints(tmp_path)] == [4, 6]


@pytest.mark.parametrize("source, forwards", [("engine", 0), ("actor", 1)])
def test_old_logprobs_come_from_the_engine_without_a_forward(source, forwards):
    trainer = make_trainer(
        **{"trainer.ppo_mini_batch_size": 8, "trainer.old_logprob_source": source}
    )
    asyncio.run(trainer.start(1, 1.0))
    batch = asyncio.run(trainer.collector.generate(prompts(2), 0, 1))
    batch.engine_logprobs = [[-0.5] * len(r) for r in batch.responses]
    calls = []
    real = trainer.actor.logprobs
    trainer.actor.logprobs = lambda p, r: calls.append(1) or real(p, r)
    asyncio.run(trainer.old_logprobs(batch))
    assert len(calls) == forwards
    if source == "engine":
        assert batch.old_logprobs is batch.engine_logprobs


class ParkingRollout(SamplingRollout):
    """Like a replica restarted under its old id: holds the step's work until a push reaches
    it again (``released``), as the real one parks entries needing weights it lost."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.released = asyncio.Event()

    async def generate_batch(self, requests):
        await self.released.wait()
        return await super().generate_batch(requests)


class ReleasingSync(RecordingSync):
    """Records ``(version, only_stale)``; a push of stale replicas releases the parked work."""

    def __init__(self, rollout: ParkingRollout) -> None:
        super().__init__()
        self.rollout = rollout

    async def push(self, state, version, flush=True, only_stale=False):
        self.pushed.append((version, only_stale))
        if only_stale:
            self.rollout.released.set()
        return {"weight_sync/replicas": 1.0 if only_stale else 0.0}


def test_a_rollout_held_by_a_replica_behind_the_weights_gets_them_while_the_trainer_waits(
    monkeypatch,
):
    """Without the catch-up push the step would wait for the replica and the replica for the
    next push, which comes only after the step."""
    monkeypatch.setattr("rlfleet.trainer.pushes.CATCH_UP_POLL_S", 0.05)
    trainer = make_trainer()
    rollout = ParkingRollout(trainer.actor.model)
    sync = ReleasingSync(rollout)
    trainer.fleet.rollout, trainer.fleet.weight_sync = rollout, sync

    async def step():
        await trainer.start(1, 1.0)
        return await asyncio.wait_for(trainer.train_step(prompts()), 30)

    metrics = asyncio.run(step())
    # The first push, then catch-up pushes of version 1 to stale replicas only (one, or more
    # when generating after the release outlasts a poll on a busy machine), then version 2.
    first, *catch_ups, last = sync.pushed
    assert first == (1, False) and last == (2, False)
    assert catch_ups and set(catch_ups) == {(1, True)}
    assert "actor/pg_loss" in metrics
