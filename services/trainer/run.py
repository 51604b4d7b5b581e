"""Running a whole training job: load, connect, validate, loop, checkpoint, report."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from rlfleet.common.config import RlfleetConfig
from rlfleet.model.heap import lean_native_memory
from rlfleet.trainer.clock import TrainingClock
from rlfleet.trainer.data import load_records
from rlfleet.trainer.determinism import DataOrder, seed_process
from rlfleet.trainer.evaluate import Evaluator
from rlfleet.trainer.loggers import StepWriter, Tracker, progress_postfix
from rlfleet.trainer.pass_rate_sampler import prompt_stream
from rlfleet.trainer.report import curve_series, plot_reward_curve, write_report
from rlfleet.trainer.run_record import set_aside_previous
from rlfleet.trainer.samples import TrainSamples
from rlfleet.trainer.state import TrainerState
from rlfleet.trainer.trainer import Trainer

log = logging.getLogger(__name__)


def build_actor(config: RlfleetConfig):
    """Tokenizer, actor (model + optimizer), from the checkpoint being resumed if any."""
    import torch

    from rlfleet.model.model_io import load_causal_lm, load_tokenizer
    from rlfleet.trainer.actor import Actor
    from rlfleet.trainer.checkpoints import resume_path

    cfg = config.trainer
    torch.set_num_threads(cfg.torch_threads)
    lean_native_memory(cfg.malloc_mmap_threshold_kb, cfg.onednn_cache_capacity)
    seed_process(cfg.seed, cfg.deterministic)
    resumed = resume_path(config)
    source = str(resumed) if resumed else config.model.path
    tokenizer = load_tokenizer(source)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if config.model.lora_rank:  # the base from model.path, the adapter from the checkpoint
        from rlfleet.trainer.lora import build_lora_actor

        return tokenizer, build_lora_actor(config, pad_id, resumed)
    model = load_causal_lm(source, config.model.dtype, config.model.attn_implementation)
    if cfg.strategy == "single":
        return tokenizer, Actor(config, model, pad_id)
    from rlfleet.trainer.ddp import parallel_actor

    return tokenizer, parallel_actor(config, model, pad_id)


def restore(trainer: Trainer, clock: TrainingClock | None = None) -> Path | None:
    """Continue from the checkpoint ``trainer.resume_mode`` names (the actor weights are
    already loaded): optimizer, schedule, step, weight version, data position, RNG states, the
    in-reward KL coefficient, and the run's ``clock`` (training time, the accuracy before the
    first step). Returns the checkpoint (None = a fresh run); the critic, which lives in the
    refcritic, is restored by ``restore_critic``."""
    from rlfleet.trainer.checkpoints import resume_path, set_rng_state

    path = resume_path(trainer.config)
    if path is None:
        return None
    state = trainer.actor.load_training_state(path)
    trainer.step = int(state["step"])
    trainer.resumed_version = int(state["version"])
    trainer.batches_consumed = int(state.get("batches_consumed", trainer.step))
    trainer.sampler_state = state.get("sampler")
    if "rng" in state:
        set_rng_state(state["rng"])
    if "kl_coef" in state and trainer.kl_ctrl is not None:
        trainer.kl_ctrl.value = float(state["kl_coef"])
    if "clock" in state and clock is not None:  # older checkpoints have none
        clock.restore(state["clock"])
    log.info(
        "resumed from %s at step %d (weights v%d)", path, trainer.step, trainer.resumed_version
    )
    return path


async def restore_critic(trainer: Trainer, path: Path | None) -> None:
    """Load the critic saved with checkpoint ``path`` into the refcritic (GAE runs)."""
    from rlfleet.trainer.checkpoints import CRITIC_DIR

    if path is None or not trainer.config.needs_critic:
        return
    if not (path / CRITIC_DIR).is_dir():
        log.warning("%s holds no critic; the refcritic keeps the critic it has", path)
        return
    info = await trainer.fleet.needed_refcritic().load_checkpoint(
        str((path / CRITIC_DIR).resolve())
    )
    log.info("critic restored from %s (critic step %d)", info.path, info.step)


async def validate(trainer: Trainer, records, writer: StepWriter | None = None) -> dict[str, float]:
    """Held-out metrics (``validation``'s) without the version they were pinned to."""
    return (await validation(trainer, records, writer)).metrics


async def validation(trainer: Trainer, records, writer: StepWriter | None = None):
    """Held-out metrics of what the replicas serve now, per data source (greedy mean@1 first;
    mean/best/maj@n with ``trainer.val_n > 1``); sample generations go to ``writer``'s tables.

    A transient failure (a replica that restarted under its old id and took a request it
    cannot serve yet, a Redis outage) brings stale replicas to the current weights and
    validates again, with fresh request ids, for up to ``trainer.step_retry_s``."""
    from rlfleet.trainer.retry import retry_transient

    evaluator = Evaluator(trainer.config, trainer.fleet, trainer.tokenizer, trainer.step)

    async def attempt(n: int):
        if n:
            await trainer.push_weights(only_stale=True)
        return await trainer.catching_up_while(evaluator.validate(list(records), trainer.version))

    budget = trainer.config.trainer.step_retry_s
    result = await retry_transient(attempt, budget, f"validation at step {trainer.step}")
    if writer is not None:
        writer.log_samples(trainer.step, result.samples)
    return result


def progress(total: int, desc: str = "GRPO steps"):
    """The steps bar; off when INFO is (``rlfleet up -q``: warnings and the summary only)."""
    from tqdm import tqdm

    quiet = not log.isEnabledFor(logging.INFO)
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, disable=quiet)


async def validate_during_training(
    trainer: Trainer, val, writer: StepWriter, clock, rollouts
) -> None:
    """Periodic validation: the clock and the async producer stand still meanwhile."""
    clock.pause()
    if rollouts is not None:
        await rollouts.pause()
    await trainer.pushes.finish()
    await trainer.push_weights(only_stale=True)  # replicas restarted since the last push
    result = await validation(trainer, val, writer)
    accuracy = result.metrics
    trainer.health.observe(accuracy)  # held-out flat: its flag goes out with the next step
    writer.write(trainer.step, {**accuracy, **result.pinned, "training/time_s": clock.training_s})
    clock.observe(_first(accuracy))
    log.info("step %d held-out: %s (training %.1f s)", trainer.step, accuracy, clock.training_s)
    if rollouts is not None:
        rollouts.resume()
    clock.begin()


async def train_loop(
    trainer: Trainer, train_records, writer: StepWriter, val=(), clock=None
) -> None:
    from tqdm.contrib.logging import logging_redirect_tqdm

    cfg = trainer.config
    clock = clock or TrainingClock(1.0)
    data = prompt_stream(trainer, train_records)  # a resumed run goes on where it stopped
    bar = progress(
        cfg.trainer.total_steps, "SFT steps" if cfg.trainer.mode == "sft" else "GRPO steps"
    )
    bar.update(trainer.step)
    clock.begin()

    async def step_done(metrics: dict[str, float], rollouts=None) -> None:
        await after_step(trainer, writer, bar, metrics, clock)
        if cfg.trainer.test_freq and trainer.step % cfg.trainer.test_freq == 0 and val:
            await validate_during_training(trainer, val, writer, clock, rollouts)

    def should_stop() -> bool:
        return finished(cfg.trainer, trainer.step, clock) or trainer.stop_requested

    rollouts = None
    try:
        with logging_redirect_tqdm():  # log lines are written above the bar, never into it
            if cfg.trainer.sft_warmup_steps:
                from rlfleet.trainer.sft import warm_up

                await warm_up(trainer, step_done, should_stop)
            rollouts = start_rollouts(trainer, data) if cfg.trainer.mode == "async" else None
            while not should_stop():
                await trainer.wait_if_paused()
                await step_done(await one_step(trainer, data, rollouts), rollouts)
            clock.pause()
            await trainer.pushes.finish()
    finally:
        if rollouts is not None:
            await rollouts.close()
        bar.close()


def start_rollouts(trainer: Trainer, data):
    """Async mode's background producer of batches from ``data``, started."""
    from rlfleet.trainer.pipeline import AsyncRollouts

    rollouts = AsyncRollouts(
        trainer.collector,
        trainer.pushes,
        data,
        first_step=trainer.step,
        first_version=trainer.version,
        staleness=trainer.config.trainer.max_staleness,
    )
    rollouts.start()
    return rollouts


def finished(config, step: int, clock: TrainingClock) -> bool:
    """``total_steps`` done, or the training-time budget (``max_training_s``) spent."""
    budget = config.max_training_s
    return step >= config.total_steps or (budget > 0 and clock.elapsed() >= budget)


async def one_step(trainer: Trainer, data, rollouts) -> dict[str, float]:
    """One training step, plus the gRPC calls made since the last (async: producer's too)."""
    from rlfleet.common import call_counts

    calls_before = call_counts.snapshot()
    if trainer.config.trainer.mode == "sft":
        from rlfleet.trainer.sft import sft_step

        metrics = await sft_step(trainer, next(data))
    elif rollouts is None:
        await trainer.push_weights(only_stale=True)  # replicas that joined mid-run
        metrics = await trainer.train_step(next(data), refill=lambda: next(data))
    else:  # every background push goes to all live replicas, joiners included
        metrics = await trainer.train_step_async(rollouts)
    if trainer.prompt_sampler is not None:
        metrics.update(trainer.prompt_sampler.metrics())
    return {**metrics, **call_counts.per_step_metrics(calls_before, call_counts.snapshot())}


async def after_step(
    trainer: Trainer, writer: StepWriter, bar, metrics: dict[str, float], clock=None
) -> None:
    cfg = trainer.config
    trainer.step += 1
    metrics["training/global_step"] = float(trainer.step)
    metrics.update(trainer.health.observe(metrics))  # health/<rule> flags; WARNING on firing
    writer.write(trainer.step, metrics)
    bar.update(1)
    bar.set_postfix(progress_postfix(metrics))
    if cfg.trainer.save_freq and trainer.step % cfg.trainer.save_freq == 0:
        await save_step_checkpoint(trainer, clock)


def save_checkpoint(trainer: Trainer, path: Path, clock: TrainingClock | None = None) -> Path:
    from rlfleet.trainer.checkpoints import rng_state

    trainer.actor.save_hf(path, trainer.tokenizer)
    extra = {
        "step": trainer.step,
        "version": trainer.version,
        "batches_consumed": trainer.batches_consumed,
        "rng": rng_state(),
    }
    if trainer.prompt_sampler is not None:
        extra["sampler"] = trainer.prompt_sampler.state()
    if trainer.kl_ctrl is not None:
        extra["kl_coef"] = float(trainer.kl_ctrl.value)
    if clock is not None:  # a resumed run goes on with the run's clock, not a fresh one
        extra["clock"] = clock.state()
    trainer.actor.save_training_state(path, extra)
    log.info("checkpoint saved to %s", path)
    return path


async def save_full_checkpoint(
    trainer: Trainer, path: Path, clock: TrainingClock | None = None
) -> Path:
    """The critic (through the refcritic, GAE runs) first, then the actor and its state file:
    a directory with ``trainer_state.pt`` is complete."""
    from rlfleet.trainer.checkpoints import CRITIC_DIR

    if trainer.config.needs_critic:
        path.mkdir(parents=True, exist_ok=True)
        await trainer.fleet.needed_refcritic().save_checkpoint(str((path / CRITIC_DIR).resolve()))
    return save_checkpoint(trainer, path, clock)


async def save_step_checkpoint(trainer: Trainer, clock: TrainingClock | None = None) -> None:
    from rlfleet.trainer.checkpoints import prune, step_dir

    cfg = trainer.config
    await save_full_checkpoint(trainer, step_dir(cfg.run_dir, trainer.step), clock)
    prune(cfg.run_dir, cfg.trainer.max_ckpt_to_keep)


def load_train_rows(config: RlfleetConfig, tokenizer) -> list:
    """The training rows: prompts for RL, tokenized conversations for ``trainer.mode: sft``."""
    data, chat = config.data, config.data.apply_chat_template
    if config.trainer.mode == "sft":
        from rlfleet.trainer.sft import load_sft_records

        limits = data.max_prompt_length, config.rollout.max_tokens
        return load_sft_records(data.train_files, tokenizer, *limits, chat)
    return load_records(data.train_files, tokenizer, data.max_prompt_length, chat)


async def run_training(config: RlfleetConfig, control_server_factory=None) -> dict:
    """The whole job; returns the summary also written to ``run_dir/summary.json``."""
    from rlfleet.trainer.checkpoints import resume_path
    from rlfleet.trainer.fleet import connect_fleet

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume_path(config) is None:  # one run, one record: a fresh run starts its files afresh
        set_aside_previous(run_dir)
    tokenizer, actor = await asyncio.to_thread(build_actor, config)
    data, chat = config.data, config.data.apply_chat_template
    train = await asyncio.to_thread(load_train_rows, config, tokenizer)
    val = load_records(data.val_files, tokenizer, data.max_prompt_length, chat)[: data.val_size]
    fleet = await connect_fleet(config)
    writer = Tracker.from_config(config, run_dir)
    trainer = Trainer(config, fleet, actor, tokenizer)
    trainer.samples = TrainSamples.from_config(config)  # run_dir/train_samples.jsonl
    trainer.data_order = DataOrder.from_config(config)  # run_dir/data_order.jsonl
    clock = TrainingClock(config.trainer.target_accuracy)
    resumed = restore(trainer, clock)
    if resumed is not None:  # metrics.jsonl marks the rows of this segment
        writer.resume(trainer.step)
        trainer.health.replay(writer.history)  # the rules go on from the rows that stand
    await restore_critic(trainer, resumed)
    server = control_server_factory(trainer, writer) if control_server_factory else None
    if server is not None:
        await server.start()
    try:
        return await _run(trainer, train, val, writer, run_dir, clock)
    finally:
        if server is not None:
            await server.stop(1.0)
        writer.close()
        await fleet.close()
        await asyncio.to_thread(actor.close)


async def _run(trainer: Trainer, train, val, writer, run_dir: Path, clock: TrainingClock) -> dict:
    config = trainer.config
    started = time.perf_counter()
    log.info("waiting for rollout replicas")
    await trainer.start(config.trainer.min_replicas, config.trainer.replica_wait_s)
    before = await held_out_before(trainer, val, writer, clock)
    await train_loop(trainer, train, writer, val, clock)
    final = await validation(trainer, val, writer)
    after = final.metrics
    clock.observe(_first(after))
    log.info("held-out after training: %s", after)
    checkpoint = await save_full_checkpoint(trainer, run_dir / "checkpoints" / "final", clock)
    series = curve_series(writer.history, before, after, trainer.step, clock.target)
    plot = plot_reward_curve(series, run_dir / "reward_curve.png")
    trainer.state = TrainerState.DONE
    summary = {
        "steps": trainer.step,
        "weight_version": trainer.version,
        "wall_time_s": round(time.perf_counter() - started, 1),
        "training_time_s": round(clock.training_s, 1),
        "target_accuracy": clock.target,
        "time_to_target_s": _rounded(clock.time_to_target_s),
        "segments": 1 + writer.segment,
        "val_before": before,
        "val_after": after,
        "val_weight_version": final.pinned.get("val/weight_version"),
        "metrics_file": str(writer.path) if writer.path else None,
        "reward_curve": str(plot) if plot else None,
        "report": str(run_dir / "report.html"),
        "checkpoint": str(checkpoint),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_report(
        series, writer.history, {"run_dir": str(run_dir), **summary}, run_dir / "report.html"
    )
    return summary


async def held_out_before(trainer: Trainer, val, writer, clock: TrainingClock) -> dict:
    """Held-out metrics before the run's first step. A resumed run's are the first
    segment's, kept in its clock (validating now would measure the checkpoint instead)."""
    if clock.restored:
        log.info("held-out before training (first segment): %s", clock.val_before)
        return clock.val_before
    config = trainer.config
    before = await validate(trainer, val, writer) if config.trainer.val_before_train else {}
    log.info("held-out before training: %s", before)
    clock.val_before = before
    clock.observe(_first(before))
    if clock.time_to_target_s is not None:
        clock.time_to_target_s = 0.0
    return before


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _first(values: dict[str, float]) -> float | None:
    return next(iter(values.values()), None)
