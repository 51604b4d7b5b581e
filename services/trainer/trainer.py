"""The controller's step: learn from a batch the fleet produced, then publish the weights.

A step has two halves (docs/architecture.md, "One training step"). ``Collector.produce``
(``collect.py``) generates through the router, scores through the reward service, and asks
the refcritic for reference log-probs and values when the config needs them.
``Trainer.learn`` takes old log-probs, shapes rewards, computes advantages, updates the critic
and then the actor, and publishes version + 1 (``pushes.WeightPushes``). ``trainer.mode:
sync`` runs the halves in turn with the same weights (``train_step``: strictly on-policy);
``async`` learns from batches produced ahead by ``pipeline.AsyncRollouts``
(``train_step_async``), dropping what is too stale and correcting for the rest's lag. The
loop around the steps (data, validation, checkpoints, metrics) is ``run.py``'s.

The trainer is blind to the algorithm's details: advantages and losses come from
``rlfleet.rl`` selected by config, and the actor owns the optimizer.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import FailedPrecondition
from rlfleet.rl.advantages import AdvantageInputs, AdvantageParams, compute_advantage
from rlfleet.rl.sequences import pad_rows
from rlfleet.trainer.collect import Collector
from rlfleet.trainer.correction import correct_batch, needs_actor_old_logprobs
from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.determinism import DataOrder
from rlfleet.trainer.fleet import Fleet
from rlfleet.trainer.health import HealthMonitor
from rlfleet.trainer.metrics import Timer, batch_metrics, rollout_probs_diff, tensor_stats
from rlfleet.trainer.pushes import WeightPushes
from rlfleet.trainer.rewards_shaping import kl_controller_for, shape_rewards, shaping_inputs
from rlfleet.trainer.rollout_batch import RolloutBatch, response_mask, token_level_rewards
from rlfleet.trainer.samples import TrainSamples
from rlfleet.trainer.staleness import (
    bound_lag,
    drop_stale,
    split_lag_metrics,
    staleness_metrics,
)
from rlfleet.trainer.state import TrainerState
from rlfleet.trainer.weight_check import weight_check_for

if TYPE_CHECKING:
    from rlfleet.trainer.pipeline import AsyncRollouts

log = logging.getLogger(__name__)

T = TypeVar("T")


class Trainer:
    """The weight version, the step counter and one step's learning; the actor, its
    optimizer and the other services' clients are handed in."""

    def __init__(self, config: RlfleetConfig, fleet: Fleet, actor, tokenizer) -> None:
        self.config = config
        self.fleet = fleet
        self.actor = actor
        self.tokenizer = tokenizer
        self.version = 0
        self.resumed_version = 0
        """Weight version of the checkpoint this run resumed from (0 = fresh run)."""
        self.step = 0
        self.run_tag = uuid.uuid4().hex[:8]
        self.state = TrainerState.STARTING
        self._resume = asyncio.Event()
        self._resume.set()
        self.stop_requested = False
        self.collector = Collector(config, fleet, tokenizer, self.run_tag)
        self.batches_consumed = 0
        """Data batches behind the steps trained so far (DAPO may draw several per step): a
        resumed run skips exactly these."""
        self.prompt_sampler = None
        """The difficulty pools' sampler when ``data.pass_rate_sampling`` is on (its state
        goes into checkpoints)."""
        self.sampler_state: dict | None = None
        """That sampler's state in the checkpoint this run resumed from."""
        probe = fleet.probe if fleet is not None else None  # no fleet: control-only tests
        check = weight_check_for(config, probe, tokenizer, actor)
        self.pushes = WeightPushes(config, fleet, actor, check)
        self.samples = TrainSamples(None)  # run_training points it at run_dir (the dashboard)
        self.data_order = DataOrder(None)  # and this at run_dir/data_order.jsonl
        self.health = HealthMonitor(config.trainer.health)  # rules over the step metrics
        algo = config.algorithm
        self.kl_ctrl = kl_controller_for(config)
        self.shaping_metrics: dict[str, float] = {}
        self.advantage_params = AdvantageParams(
            estimator=algo.adv_estimator,
            gamma=algo.gamma,
            lam=algo.lam,
            norm_by_std=algo.norm_adv_by_std_in_grpo,
        )

    # --- control (used by the Trainer gRPC service) ---------------------------------
    def pause(self) -> None:
        self._resume.clear()
        self.state = TrainerState.PAUSED

    def resume(self) -> None:
        self._resume.set()
        self.state = TrainerState.RUNNING

    def request_stop(self) -> None:
        self.stop_requested = True
        self._resume.set()

    async def wait_if_paused(self) -> None:
        await self._resume.wait()

    # --- weights (how they travel: ``WeightPushes``) ------------------------------------
    async def push_weights(self, only_stale: bool = False) -> dict[str, float]:
        """Send the actor's weights as ``self.version`` to replicas."""
        return await self.pushes.push(self.version, only_stale)

    async def catching_up_while(self, waiting: Awaitable[T]) -> T:
        """Await ``waiting`` while replicas behind ``self.version`` are brought up to it."""
        return await self.pushes.catching_up_while(waiting, self.version)

    async def start(self, n_replicas: int, timeout_s: float) -> None:
        """Wait for replicas, then push the actor's weights as the first version of this run:
        one past both the resumed checkpoint's and any version a replica serves (a trainer
        killed after its checkpoint may have pushed later ones), so every replica takes them as
        newer and no response of the old weights passes for one of these."""
        replicas = await self.fleet.weight_sync.wait_for_replicas(n_replicas, timeout_s)
        served = max((r.weight_version for r in replicas or []), default=0)
        self.version = max(self.resumed_version, served) + 1
        await self.push_weights()
        if self.fleet.env is not None:  # agent mode: the env service plays the episodes
            await self.fleet.env.wait_ready(timeout_s)
        self.state = TrainerState.RUNNING

    # --- one step --------------------------------------------------------------------------
    def check_versions(self, batch: RolloutBatch) -> None:
        """Every trained response must come from the weights the trainer holds now."""
        stale = {v for v in batch.weight_versions if v != self.version}
        if stale:
            raise FailedPrecondition(
                f"responses from weight versions {sorted(stale)} != current {self.version}"
            )

    def single_update_per_batch(self) -> bool:
        """One optimizer step on the whole batch: old log-probs equal the current ones."""
        cfg = self.config.trainer
        mini = cfg.ppo_mini_batch_size
        return cfg.ppo_epochs == 1 and (
            not mini or mini >= self.config.data.train_batch_size * self.config.rollout.n
        )

    async def old_logprobs(self, batch: RolloutBatch) -> dict[str, float]:
        """Old (proximal) log-probs for the PPO ratio, when the update takes several steps.

        With one optimizer step per batch the ratio is exactly 1: the actor reuses its own
        detached log-probs from the update's forward pass. Otherwise they come from the engine
        that sampled the batch (``trainer.old_logprob_source: engine``, no extra forward: the
        engine reports ``log_softmax(logits / T)`` of the same weights) or from a forward of
        the actor (``actor``; in async mode this is AReaL's proximal policy). Returns verl's
        ``training/rollout_probs_diff_*`` when the actor's forward ran and the engine's
        log-probs of the rows sampled with the current weights are at hand.
        """
        corr = self.config.algorithm.rollout_correction
        if corr.bypass_mode:  # verl's bypass: the engine's log-probs are the old policy
            if not batch.use_engine_logprobs_as_old():
                raise FailedPrecondition(
                    "rollout_correction.bypass_mode needs every token's engine log-prob"
                )
            return {}
        if self.single_update_per_batch() and not needs_actor_old_logprobs(self.config):
            return {}
        from_engine = self.config.trainer.old_logprob_source == "engine" and not corr.decoupled
        if from_engine and batch.use_engine_logprobs_as_old():
            return {}
        batch.old_logprobs = await asyncio.to_thread(
            self.actor.logprobs, batch.prompts, batch.responses
        )
        return self.probs_diff(batch)

    def probs_diff(self, batch: RolloutBatch) -> dict[str, float]:
        """Engine against actor on the rows the current weights sampled (stale rows differ by
        design)."""
        if not batch.engine_logprobs_complete():
            return {}
        rows = [i for i, v in enumerate(batch.weight_versions) if v == self.version]
        masks = batch.row_loss_masks()
        return rollout_probs_diff(
            [batch.engine_logprobs[i] for i in rows],
            [batch.old_logprobs[i] for i in rows],
            [masks[i] for i in rows] if masks is not None else None,
        )

    def advantages(self, batch: RolloutBatch):
        """``(advantages, returns, mask)`` as ``[B, R]`` tensors."""
        lengths = batch.response_lengths()
        loss_masks = batch.row_loss_masks()
        mask = response_mask(lengths, loss_masks)
        values = pad_rows(batch.values, mask.shape[1]) if batch.values else None
        outcome = token_level_rewards(batch.scores, lengths, loss_masks)
        shaping = shaping_inputs(batch, outcome, mask)
        rewards, self.shaping_metrics = shape_rewards(shaping, self.config, self.kl_ctrl)
        inputs = AdvantageInputs(
            token_level_rewards=rewards,
            response_mask=mask,
            group_index=batch.group_ids,
            episode_index=batch.row_episodes(),
            values=values,
            baseline_scores=torch.tensor(batch.baseline_scores) if batch.baseline_scores else None,
        )
        advantages, returns = compute_advantage(self.advantage_params, inputs)
        return advantages, returns, mask

    async def update_critic(self, batch: RolloutBatch, returns, mask) -> dict[str, float]:
        rows = [returns[i, : int(mask[i].sum())].tolist() for i in range(len(batch))]
        return await self.fleet.needed_refcritic().update_critic(
            batch.prompts, batch.responses, rows, batch.values
        )

    async def learn(self, batch: RolloutBatch, timer: Timer) -> dict[str, float]:
        """Update the critic and the actor on ``batch``, then publish version + 1."""
        self.batches_consumed += batch.data_batches
        if self.config.reference_from_actor:  # LoRA: the base is the actor with its adapter off
            with timer.phase("ref"):
                batch.ref_logprobs = await asyncio.to_thread(
                    self.actor.ref_logprobs, batch.prompts, batch.responses
                )
        with timer.phase("old_log_prob"):
            probs_diff = await self.old_logprobs(batch)
        with timer.phase("adv"):
            advantages, returns, mask = self.advantages(batch)
        actor_old = bool(batch.old_logprobs) and batch.old_logprobs is not batch.engine_logprobs
        mask, corr_metrics = correct_batch(batch, mask, self.config, actor_old)
        metrics: dict[str, float] = {
            **probs_diff,
            **corr_metrics,
            **self.shaping_metrics,
            **batch.sampling_metrics,
            **batch.agent_metrics,
        }
        if self.config.needs_critic:
            with timer.phase("update_critic"):
                metrics.update(await self.update_critic(batch, returns, mask))
        with timer.phase("update_actor"):
            metrics.update(await asyncio.to_thread(self.actor.update, batch, advantages, mask))
        self.version += 1
        with timer.phase("push_weights"):
            metrics.update(await self.pushes.publish(self.version))
        metrics.update(batch_metrics(batch, self.config.rollout.max_tokens))
        metrics.update(tensor_stats("critic/advantages", advantages, mask))
        metrics.update(tensor_stats("critic/returns", returns, mask))
        metrics["training/weight_version"] = float(self.version)
        self.samples.write(self.step + 1, batch)
        self.data_order.write(self.step + 1, batch.prompt_indices())
        return metrics

    async def train_step(
        self, prompts: list[PromptRecord], refill: Callable[[], list[PromptRecord]] | None = None
    ) -> dict[str, float]:
        """One step of ``trainer.mode: sync``: produce with the current weights, then learn."""
        timer = Timer()
        with timer.phase("step"):
            produce = self.collector.produce(prompts, self.step, self.version, timer, refill)
            batch = await self.catching_up_while(produce)
            self.check_versions(batch)
            metrics = await self.learn(batch, timer)
        metrics.update(timer.metrics)
        return metrics

    def corrects_staleness(self, batch: RolloutBatch) -> bool:
        """Whether stale rows get truncated importance weights pi_prox / pi_behav. Not when the
        old log-probs are the engine's: then the PPO ratio is already against the behaviour
        policy and the weight would be exactly 1."""
        if self.config.algorithm.rollout_correction.active:  # the suite corrects instead
            return False
        if not any(v != self.version for v in batch.weight_versions):
            return False
        from_engine = self.config.trainer.old_logprob_source == "engine"
        return self.single_update_per_batch() or not from_engine

    async def train_step_async(self, rollouts: AsyncRollouts) -> dict[str, float]:
        """One asynchronous step: take the batch produced ahead (``AsyncRollouts``), drop what
        is older than ``max_staleness``, and learn with the off-policy correction."""
        timer = Timer()
        with timer.phase("step"):
            with timer.phase("idle_trainer"):
                batch, produced = await self.catching_up_while(rollouts.next())
            oldest = self.version - self.config.trainer.max_staleness
            trainer = self.config.trainer
            arrived = split_lag_metrics(batch, self.version, 0)
            batch, dropped = drop_stale(
                batch, oldest, trainer.stale_tokens, trainer.mask_pre_update_segments
            )
            batch, over = bound_lag(
                batch,
                self.version,
                trainer.max_in_flight_lag,
                trainer.max_in_queue_lag,
                trainer.stale_tokens,
            )
            if not len(batch):
                raise FailedPrecondition(
                    f"all {dropped + over} responses were older than weight version {oldest} "
                    "or over trainer.max_in_flight_lag / max_in_queue_lag"
                )
            lag = {
                **staleness_metrics(batch, self.version, dropped),
                **arrived,
                "off_policy/dropped": float(dropped + over),
            }
            if self.corrects_staleness(batch):
                batch.use_engine_logprobs_as_behaviour()
            metrics = await self.learn(batch, timer)
        metrics.update(produced.metrics)
        metrics.update(timer.metrics)
        metrics.update(lag)
        metrics["timing_s/idle_rollout"] = rollouts.take_idle()
        return metrics
