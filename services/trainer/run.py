"""Running a whole training job: load, connect, validate, loop, checkpoint, report."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from rlfleet.common.config import RlfleetConfig
from rlfleet.trainer.data import batches, load_records
from rlfleet.trainer.evaluate import accuracy_by_source, greedy_responses
from rlfleet.trainer.loggers import Tracker, progress_postfix
from rlfleet.trainer.metrics import plot_reward_curve
from rlfleet.trainer.state import TrainerState
from rlfleet.trainer.trainer import Trainer

log = logging.getLogger(__name__)


def build_actor(config: RlfleetConfig):
    """Tokenizer, actor (model + optimizer), from the checkpoint being resumed if any."""
    import torch

    from rlfleet.common.model_io import load_causal_lm, load_tokenizer
    from rlfleet.trainer.actor import Actor
    from rlfleet.trainer.checkpoints import resume_path

    torch.set_num_threads(config.trainer.torch_threads)
    torch.manual_seed(config.trainer.seed)
    resumed = resume_path(config)
    source = str(resumed) if resumed else config.model.path
    tokenizer = load_tokenizer(source)
    model = load_causal_lm(source, config.model.dtype)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return tokenizer, Actor(config, model, pad_id)


def restore(trainer: Trainer) -> None:
    """Continue from the checkpoint ``trainer.resume_mode`` names (the actor weights are
    already loaded): optimizer, schedule, step, weight version, data position, RNG states."""
    from rlfleet.trainer.checkpoints import resume_path, set_rng_state

    path = resume_path(trainer.config)
    if path is None:
        return
    state = trainer.actor.load_training_state(path)
    trainer.step = int(state["step"])
    trainer.resumed_version = int(state["version"])
    trainer.batches_consumed = int(state.get("batches_consumed", trainer.step))
    if "rng" in state:
        set_rng_state(state["rng"])
    log.info(
        "resumed from %s at step %d (weights v%d)", path, trainer.step, trainer.resumed_version
    )


async def validate(trainer: Trainer, records) -> dict[str, float]:
    """Greedy accuracy of what the replicas serve now, per data source."""
    responses = await greedy_responses(
        trainer.fleet.rollout, records, trainer.config.rollout.max_tokens, trainer.version
    )
    from rlfleet.trainer.batch import RolloutBatch

    batch = RolloutBatch(records=list(records), responses=responses)
    batch.texts = [trainer.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
    await trainer.collector.score(batch)
    return accuracy_by_source(records, batch.scores)


def progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="GRPO steps", unit="step", dynamic_ncols=True)


class TrainingClock:
    """Training time with validation excluded, and when validation first reached the target.

    ``time_to_target_s`` runs from the start of the first step to the end of the step after
    which validation first showed ``>= target`` (what ``make run`` prints as
    ``time_to_0.85_s``)."""

    def __init__(self, target: float) -> None:
        self.target = target
        self.training_s = 0.0
        self.time_to_target_s: float | None = None
        self._started: float | None = None

    def begin(self) -> None:
        self._started = time.perf_counter()

    def pause(self) -> None:
        if self._started is not None:
            self.training_s += time.perf_counter() - self._started
            self._started = None

    def observe(self, accuracy: float | None) -> None:
        if accuracy is not None and accuracy >= self.target and self.time_to_target_s is None:
            self.time_to_target_s = self.training_s


async def validate_during_training(trainer: Trainer, val, writer, clock, rollouts) -> None:
    """Periodic validation: the clock and the async producer stand still meanwhile."""
    clock.pause()
    if rollouts is not None:
        await rollouts.pause()
    await trainer.finish_push()
    accuracy = await validate(trainer, val)
    writer.write(trainer.step, {**accuracy, "training/time_s": clock.training_s})
    clock.observe(_first(accuracy))
    log.info("step %d held-out: %s (training %.1f s)", trainer.step, accuracy, clock.training_s)
    if rollouts is not None:
        rollouts.resume()
    clock.begin()


async def train_loop(trainer: Trainer, train_records, writer, val=(), clock=None) -> None:
    from rlfleet.trainer.pipeline import AsyncRollouts

    cfg = trainer.config
    clock = clock or TrainingClock(1.0)
    data = batches(train_records, cfg.data.train_batch_size, cfg.data.seed)
    for _ in range(trainer.batches_consumed):  # a resumed run continues the same data order
        next(data)
    rollouts = None
    if cfg.trainer.mode == "async":
        rollouts = AsyncRollouts(trainer, data, trainer.step)
        rollouts.start()
    bar = progress(cfg.trainer.total_steps)
    bar.update(trainer.step)
    clock.begin()
    try:
        while trainer.step < cfg.trainer.total_steps and not trainer.stop_requested:
            await trainer.wait_if_paused()
            metrics = await one_step(trainer, data, rollouts)
            after_step(trainer, writer, bar, metrics)
            if cfg.trainer.test_freq and trainer.step % cfg.trainer.test_freq == 0 and val:
                await validate_during_training(trainer, val, writer, clock, rollouts)
        clock.pause()
        await trainer.finish_push()
    finally:
        if rollouts is not None:
            await rollouts.close()
        bar.close()


async def one_step(trainer: Trainer, data, rollouts) -> dict[str, float]:
    if rollouts is None:
        await trainer.push_weights(only_stale=True)  # replicas that joined mid-run
        return await trainer.train_step(next(data), refill=lambda: next(data))
    # Async: every background push goes to all live replicas, joiners included.
    return await trainer.train_step_async(rollouts)


def after_step(trainer: Trainer, writer, bar, metrics: dict[str, float]) -> None:
    cfg = trainer.config
    trainer.step += 1
    metrics["training/global_step"] = float(trainer.step)
    writer.write(trainer.step, metrics)
    bar.update(1)
    bar.set_postfix(progress_postfix(metrics))
    if cfg.trainer.save_freq and trainer.step % cfg.trainer.save_freq == 0:
        save_step_checkpoint(trainer)


def save_checkpoint(trainer: Trainer, path: Path) -> Path:
    from rlfleet.trainer.checkpoints import rng_state

    trainer.actor.save_hf(path, trainer.tokenizer)
    extra = {
        "step": trainer.step,
        "version": trainer.version,
        "batches_consumed": trainer.batches_consumed,
        "rng": rng_state(),
    }
    trainer.actor.save_training_state(path, extra)
    log.info("checkpoint saved to %s", path)
    return path


def save_step_checkpoint(trainer: Trainer) -> None:
    from rlfleet.trainer.checkpoints import prune, step_dir

    cfg = trainer.config
    save_checkpoint(trainer, step_dir(cfg.run_dir, trainer.step))
    prune(cfg.run_dir, cfg.trainer.max_ckpt_to_keep)


async def run_training(config: RlfleetConfig, control_server_factory=None) -> dict:
    """The whole job; returns the summary also written to ``run_dir/summary.json``."""
    from rlfleet.trainer.fleet import connect_fleet

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, actor = await asyncio.to_thread(build_actor, config)
    train = load_records(config.data.train_files, tokenizer, config.data.max_prompt_length)
    val = load_records(config.data.val_files, tokenizer, config.data.max_prompt_length)[
        : config.data.val_size
    ]
    fleet = await connect_fleet(config)
    writer = Tracker.from_config(config, run_dir)
    trainer = Trainer(config, fleet, actor, tokenizer)
    restore(trainer)
    server = control_server_factory(trainer, writer) if control_server_factory else None
    if server is not None:
        await server.start()
    try:
        return await _run(trainer, train, val, writer, run_dir)
    finally:
        if server is not None:
            await server.stop(1.0)
        writer.close()
        await fleet.close()


async def _run(trainer: Trainer, train, val, writer, run_dir: Path) -> dict:
    config = trainer.config
    started = time.perf_counter()
    log.info("waiting for rollout replicas")
    await trainer.start(config.trainer.min_replicas, config.trainer.replica_wait_s)
    before = await validate(trainer, val) if config.trainer.val_before_train else {}
    log.info("held-out before training: %s", before)
    clock = TrainingClock(config.trainer.target_accuracy)
    clock.observe(_first(before))
    if clock.time_to_target_s is not None:
        clock.time_to_target_s = 0.0
    await train_loop(trainer, train, writer, val, clock)
    after = await validate(trainer, val)
    clock.observe(_first(after))
    log.info("held-out after training: %s", after)
    checkpoint = save_checkpoint(trainer, run_dir / "checkpoints" / "final")
    accuracy = {"before": _first(before), "after": _first(after)}
    plot = plot_reward_curve(
        writer.history,
        run_dir / "reward_curve.png",
        {k: v for k, v in accuracy.items() if v is not None},
    )
    trainer.state = TrainerState.DONE
    summary = {
        "steps": trainer.step,
        "weight_version": trainer.version,
        "wall_time_s": round(time.perf_counter() - started, 1),
        "training_time_s": round(clock.training_s, 1),
        "target_accuracy": clock.target,
        "time_to_target_s": _rounded(clock.time_to_target_s),
        "val_before": before,
        "val_after": after,
        "metrics_file": str(writer.path) if writer.path else None,
        "reward_curve": str(plot) if plot else None,
        "checkpoint": str(checkpoint),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _first(values: dict[str, float]) -> float | None:
    return next(iter(values.values()), None)
