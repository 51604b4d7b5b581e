"""The rollout side of a training step: everything that does not touch the actor.

``Collector`` turns a batch of prompts into a scored ``RolloutBatch``: one ``GenerateBatch``
through the router (plus ReMax's greedy baselines in the same call), one ``ScoreBatch``, and
the reference log-probs and critic values when the config needs them. DAPO's dynamic
sampling repeats generate+score until enough groups teach. The synchronous loop calls it
between updates; the asynchronous one runs it ahead in ``AsyncRollouts``.

In agent mode (``agent.env`` set) generation is one ``RunEpisodes`` to the env service instead:
``rollout.n`` episodes per prompt, each already rewarded by its environment, so there is no
``ScoreBatch`` (``rlfleet.trainer.episodes``).

Answers are put back in request order (``determinism.generations_in_order``,
``scores_in_order``) before a batch is built from them; with ``trainer.deterministic`` every
request also carries its own seed (``determinism.request_seed``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import replace

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import FailedPrecondition
from rlfleet.rollout.types import GenerateRequest, SamplingParams
from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.determinism import generations_in_order, request_seed, scores_in_order
from rlfleet.trainer.dynamic_sampling import fill_batch
from rlfleet.trainer.episodes import episode_jobs, episode_metrics
from rlfleet.trainer.fleet import Fleet
from rlfleet.trainer.metrics import Timer
from rlfleet.trainer.retry import retry_transient
from rlfleet.trainer.rollout_batch import RolloutBatch

log = logging.getLogger(__name__)


class Collector:
    def __init__(self, config: RlfleetConfig, fleet: Fleet, tokenizer, run_tag: str) -> None:
        self.config = config
        self.fleet = fleet
        self.tokenizer = tokenizer
        self.run_tag = run_tag
        self._calls = itertools.count()
        self.on_scored: Callable[[RolloutBatch], None] | None = None
        """Called with every scored batch (each DAPO round too): the difficulty pools'
        pass rates (``data.pass_rate_sampling``)."""

    async def produce(
        self,
        prompts: list[PromptRecord],
        step: int,
        min_version: int,
        timer: Timer,
        refill: Callable[[], list[PromptRecord]] | None = None,
    ) -> RolloutBatch:
        """Everything a step needs that does not touch the actor: generate and score (with
        DAPO's dynamic sampling when on, drawing more prompts from ``refill``), then reference
        log-probs and values. Async mode runs this ahead of ``learn``.

        A transient failure (a Redis outage, a restarting service) retries the whole rollout
        with the same request ids for up to ``trainer.step_retry_s``: what was answered before
        the failure is returned again, not run again."""

        async def attempt(_: int) -> RolloutBatch:
            return await self._produce_once(prompts, step, min_version, timer, refill)

        budget = self.config.trainer.step_retry_s
        return await retry_transient(attempt, budget, f"rollout of step {step}")

    async def _produce_once(
        self,
        prompts: list[PromptRecord],
        step: int,
        min_version: int,
        timer: Timer,
        refill: Callable[[], list[PromptRecord]] | None = None,
    ) -> RolloutBatch:
        dapo = self.config.algorithm.filter_groups
        if not (dapo.enable and refill is not None):
            with timer.phase("gen"):
                batch = await self.generate(prompts, step, min_version)
            await asyncio.gather(
                timer.timed("reward", self.score, batch),
                timer.timed("ref", self.reference_and_values, batch),
            )
            return batch
        batch = await self._generate_and_score(prompts, step, min_version, timer)

        async def one_round(more: list[PromptRecord], index: int) -> RolloutBatch:
            return await self._generate_and_score(more, step, min_version, timer, f"r{index}")

        target = self.config.data.train_batch_size
        batch, metrics = await fill_batch(
            batch, target, dapo.max_num_gen_batches, refill, one_round
        )
        batch.sampling_metrics = metrics
        batch.data_batches = int(metrics["dapo/gen_rounds"])
        with timer.phase("ref"):
            await self.reference_and_values(batch)
        return batch

    async def _generate_and_score(self, prompts, step, min_version, timer, tag="") -> RolloutBatch:
        with timer.phase("gen"):
            batch = await self.generate(prompts, step, min_version, tag)
        with timer.phase("reward"):
            await self.score(batch)
        return batch

    async def generate(
        self, prompts: list[PromptRecord], step: int, min_version: int, tag: str = ""
    ) -> RolloutBatch:
        """The whole step in one ``GenerateBatch``: each replica gets its share as one queue
        entry (one engine batch). One request per prompt with n samples; the group id is the
        sticky session, so a group's samples share a replica's prefix cache. ReMax adds one
        greedy request per prompt (its baseline) to the same call."""
        prefix = f"{self.run_tag}-s{step}{tag}"
        if self.config.agent.env:
            return await self.play_episodes(prompts, prefix, min_version)
        suffix = f"-{tag}" if tag else ""  # DAPO's refill rounds: streams of their own
        sampling = self._seeded(self._sampling, f"train{suffix}", step)
        requests = [
            self._request(f"{prefix}-p{i}", f"{prefix}-g{i}", record, min_version, sampling(i))
            for i, record in enumerate(prompts)
        ]
        if self.config.algorithm.adv_estimator == "remax":
            greedy = replace(self._sampling, n=1, temperature=0.0)
            baseline = self._seeded(greedy, f"baseline{suffix}", step)
            requests += [
                self._request(f"{prefix}-b{i}", f"{prefix}-g{i}", record, min_version, baseline(i))
                for i, record in enumerate(prompts)
            ]
        results = await self.fleet.rollout.generate_batch(requests)
        results = generations_in_order(requests, results)
        batch = RolloutBatch()
        for group_id, (record, result) in enumerate(zip(prompts, results, strict=False)):
            batch.add_group(record, group_id, result)
        batch.texts = self._decode(batch.responses)
        baselines = [r.completions[0].token_ids for r in results[len(prompts) :]]
        batch.baseline_texts = self._decode(baselines)
        return batch

    async def play_episodes(
        self, prompts: list[PromptRecord], prefix: str, min_version: int
    ) -> RolloutBatch:
        """``rollout.n`` episodes per prompt in one ``RunEpisodes``; one group per prompt."""
        n = self.config.rollout.n
        jobs = episode_jobs(prompts, prefix, n, min_version)
        results = await self.fleet.needed_env().run_episodes(jobs, replace(self._sampling, n=1))
        batch = RolloutBatch()
        for group_id, record in enumerate(prompts):
            batch.add_episode_group(record, group_id, results[group_id * n : (group_id + 1) * n])
        batch.texts = self._decode(batch.responses)  # the transcript after the prompt
        batch.agent_metrics = episode_metrics(results)
        failed = [r for r in results if r.error]
        if failed:
            log.warning(
                "%d of %d episodes failed (reward 0; those with no sampled token are left out): %s",
                len(failed),
                len(results),
                failed[0].error,
            )
        if not len(batch):
            raise FailedPrecondition(
                f"every episode of {prefix} failed before sampling a token: {failed[0].error}"
            )
        return batch

    @property
    def _sampling(self) -> SamplingParams:
        cfg = self.config.rollout
        return SamplingParams(
            n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens
        )

    def _seeded(self, sampling: SamplingParams, stream: str, step: int):
        """Position -> ``sampling``, with ``request_seed``'s seed when the run is
        ``trainer.deterministic`` (else unseeded: the engine may batch across prompts)."""
        trainer = self.config.trainer
        if not trainer.deterministic:
            return lambda position: sampling
        return lambda position: replace(
            sampling, seed=request_seed(trainer.seed, stream, step, position)
        )

    @staticmethod
    def _request(request_id, session_id, record, min_version, sampling) -> GenerateRequest:
        return GenerateRequest(
            request_id=request_id,
            sampling=sampling,
            prompt_token_ids=record.token_ids,
            session_id=session_id,
            min_weight_version=min_version,
        )

    def _decode(self, responses: list[list[int]]) -> list[str]:
        return [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]

    async def score(self, batch: RolloutBatch) -> None:
        """Score every response (and ReMax's greedy baselines) in one ``ScoreBatch``; in agent
        mode the episodes came back rewarded by their environments."""
        if self.config.agent.env:
            return

        first: dict[int, int] = {}  # group id -> its first row
        for row, group in enumerate(batch.group_ids):
            first.setdefault(group, row)
        groups = sorted(first)
        pairs = list(zip(batch.records, batch.texts, strict=True))
        pairs += [
            (batch.records[first[g]], text)
            for g, text in zip(groups, batch.baseline_texts, strict=False)
        ]
        call = next(self._calls)
        requests = [
            record.score_request(f"{self.run_tag}-c{call}-r{i}", text)
            for i, (record, text) in enumerate(pairs)
        ]
        results = await self.fleet.reward.score_batch(requests)
        results = scores_in_order(requests, results)
        scores = [0.0 if r.error else float(r.score) for r in results]
        batch.scores = scores[: len(batch)]
        if batch.baseline_texts:
            by_group = dict(zip(groups, scores[len(batch) :], strict=True))
            batch.baseline_scores = [by_group[g] for g in batch.group_ids]
        batch.score_errors = sum(1 for r in results if r.error)
        if batch.score_errors:
            log.warning("%d responses could not be scored", batch.score_errors)
        if self.on_scored is not None:
            self.on_scored(batch)

    async def reference_and_values(self, batch: RolloutBatch) -> None:
        if self.config.needs_reference and not self.config.reference_from_actor:
            refcritic = self.fleet.needed_refcritic()
            batch.ref_logprobs = await refcritic.ref_logprobs(batch.prompts, batch.responses)
        if self.config.needs_critic:
            refcritic = self.fleet.needed_refcritic()
            batch.values = await refcritic.values(batch.prompts, batch.responses)
