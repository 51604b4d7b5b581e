"""Held-out accuracy through the fleet: generation via the router, scored by the reward
service. Measuring through the same path the training uses means the number reflects what the
rollout replicas actually serve, not a private copy of the model.

Every validation has a greedy pass (``val-core/<data_source>/reward/mean@1``, the number the
training clock's target is checked against). With ``trainer.val_n > 1`` a sampled pass adds
``mean@n``, ``best@n`` and ``maj@n`` (``rlfleet.trainer.val_metrics``). A few greedy samples
(prompt, response, ground truth, score) come back as a table for the loggers.

In agent mode (``agent.env`` set) the greedy pass plays one whole episode per held-out task
through the env service (temperature 0 on every turn) and its score is the episode's reward:
``mean@1`` is the held-out episode success rate.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rlfleet.common.config import RlfleetConfig
from rlfleet.rollout.types import GenerateRequest, SamplingParams
from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.determinism import generations_in_order, request_seed, scores_in_order
from rlfleet.trainer.episodes import episode_jobs
from rlfleet.trainer.fleet import Fleet
from rlfleet.trainer.val_metrics import answer_of, sampled_metrics

log = logging.getLogger(__name__)

SAMPLE_COLUMNS = ("prompt", "response", "ground_truth", "score")
"""Columns of the validation generations table (one row per logged sample)."""


@dataclass
class Validation:
    """What one validation measured: metrics by verl's names, and sample rows to log."""

    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    """Rows with the keys of ``SAMPLE_COLUMNS``."""
    pinned: dict[str, float] = field(default_factory=dict)
    """Which weights answered (``Evaluator.version_metrics``), for the metrics row."""


async def generate_all(
    rollout,
    records: list[PromptRecord],
    sampling: SamplingParams,
    min_version: int,
    chunk: int = 256,
    versions: set[int] | None = None,
    seeds: Sequence[int] | None = None,
) -> list[list[list[int]]]:
    """Token ids of every completion (``sampling.n`` per record), ``chunk`` prompts per call;
    the weight version of each result goes into ``versions`` when given; ``seeds``: one
    sampling seed per record (``trainer.deterministic``)."""
    tag = uuid.uuid4().hex[:8]
    requests = [
        GenerateRequest(
            request_id=f"val-{tag}-{index}",
            sampling=sampling if seeds is None else replace(sampling, seed=seeds[index]),
            prompt_token_ids=record.token_ids,
            session_id=f"val-{tag}-{index}",
            min_weight_version=min_version,
        )
        for index, record in enumerate(records)
    ]
    completions: list[list[list[int]]] = []
    for start in range(0, len(requests), chunk):
        part = requests[start : start + chunk]
        results = await rollout.generate_batch(part)
        results = generations_in_order(part, results)
        completions.extend([c.token_ids for c in result.completions] for result in results)
        if versions is not None:
            versions.update(r.weight_version for r in results)
    return completions


async def greedy_responses(
    rollout,
    records: list[PromptRecord],
    max_tokens: int,
    min_version: int,
    chunk: int = 256,
    versions: set[int] | None = None,
    seeds: Sequence[int] | None = None,
) -> list[list[int]]:
    """Token ids of the greedy completion of every record."""
    sampling = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    completions = await generate_all(
        rollout, records, sampling, min_version, chunk, versions, seeds
    )
    return [rows[0] for rows in completions]


async def score_texts(reward, records: list[PromptRecord], texts: list[str]):
    """``ScoreResult`` of each text against its record, in one ``ScoreBatch``."""
    tag = uuid.uuid4().hex[:8]
    requests = [
        record.score_request(f"val-{tag}-{i}", text)
        for i, (record, text) in enumerate(zip(records, texts, strict=True))
    ]
    results = await reward.score_batch(requests)
    return scores_in_order(requests, results)


def score_of(result) -> float:
    """A result's score; an unscorable response counts 0 (as in training)."""
    return 0.0 if result.error else float(result.score)


OVERALL = "all"
"""The pseudo data source of the mean over every held-out prompt, reported first when the
held-out set mixes sources: the run's one number (before -> after, ``time_to_target_s``)."""


def accuracy_by_source(records: list[PromptRecord], scores: list[float]) -> dict[str, float]:
    """``val-core/<data_source>/reward/mean@1`` (verl's name) per data source; with more than
    one source, ``val-core/all/reward/mean@1`` (every prompt) comes first."""
    grouped: dict[str, list[float]] = defaultdict(list)
    for record, score in zip(records, scores, strict=True):
        grouped[record.data_source].append(score)
    if len(grouped) > 1:
        grouped = {OVERALL: list(scores), **grouped}
    return {f"val-core/{src}/reward/mean@1": sum(v) / len(v) for src, v in grouped.items()}


def sample_rows(tokenizer, records, texts, scores, count: int) -> list[dict]:
    """The first ``count`` samples as table rows; the prompt as the model saw it."""
    rows = []
    for record, text, score in list(zip(records, texts, scores, strict=True))[:count]:
        prompt = tokenizer.decode(record.token_ids, skip_special_tokens=True)
        truth = record.ground_truth
        truth = truth if isinstance(truth, str) else json.dumps(truth)
        rows.append(dict(zip(SAMPLE_COLUMNS, (prompt, text, truth, score), strict=True)))
    return rows


class Evaluator:
    """Runs validations for one trainer: the fleet's rollout and reward, its tokenizer."""

    def __init__(self, config: RlfleetConfig, fleet: Fleet, tokenizer, step: int = 0) -> None:
        self.config = config
        self.fleet = fleet
        self.tokenizer = tokenizer
        self.step = step
        """Steps trained before this validation: part of each request's seed."""
        self.versions: set[int] = set()
        """Weight versions the replicas answered this evaluator's requests with."""

    def decode(self, responses: list[list[int]]) -> list[str]:
        return [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]

    async def greedy(self, records: list[PromptRecord], version: int) -> Validation:
        """mean@1 per data source, and the first rows as samples."""
        if self.config.agent.env:
            texts, scores = await self.greedy_episodes(records, version)
        else:
            texts, scores = await self.greedy_completions(records, version)
        count = self.config.trainer.log_val_generations
        return Validation(
            accuracy_by_source(records, scores),
            sample_rows(self.tokenizer, records, texts, scores, count),
        )

    async def greedy_completions(self, records, version) -> tuple[list[str], list[float]]:
        """Each record's greedy completion and its score from the reward service."""
        max_tokens = self.config.rollout.max_tokens
        texts = self.decode(
            await greedy_responses(
                self.fleet.rollout,
                records,
                max_tokens,
                version,
                versions=self.versions,
                seeds=self.seeds("val", len(records)),
            )
        )
        return texts, [score_of(r) for r in await score_texts(self.fleet.reward, records, texts)]

    async def greedy_episodes(self, records, version) -> tuple[list[str], list[float]]:
        """One greedy episode per record through the env service: transcript and reward."""
        jobs = episode_jobs(records, f"val-{uuid.uuid4().hex[:8]}", 1, version)
        sampling = SamplingParams(n=1, temperature=0.0, max_tokens=self.config.rollout.max_tokens)
        results = await self.fleet.needed_env().run_episodes(jobs, sampling)
        texts = self.decode([r.episode.response_ids for r in results])
        return texts, [float(r.episode.reward) for r in results]

    async def sampled(self, records: list[PromptRecord], version: int) -> dict[str, float]:
        """mean@n, best@n, maj@n per data source from ``trainer.val_n`` samples per prompt."""
        cfg = self.config.trainer
        sampling = SamplingParams(
            n=cfg.val_n, temperature=cfg.val_temperature, max_tokens=self.config.rollout.max_tokens
        )
        seeds = self.seeds("val-sampled", len(records))
        groups = await generate_all(
            self.fleet.rollout, records, sampling, version, versions=self.versions, seeds=seeds
        )
        flat_records = [record for record, rows in zip(records, groups, strict=True) for _ in rows]
        texts = self.decode([tokens for rows in groups for tokens in rows])
        results = await score_texts(self.fleet.reward, flat_records, texts)
        scores, answers, start = [], [], 0
        for rows in groups:
            chunk = range(start, start + len(rows))
            scores.append([score_of(results[i]) for i in chunk])
            answers.append([answer_of(texts[i], results[i].metrics) for i in chunk])
            start += len(rows)
        return sampled_metrics([r.data_source for r in records], scores, answers)

    def seeds(self, stream: str, count: int) -> list[int] | None:
        """One seed per held-out prompt when ``trainer.deterministic`` (a seeded greedy request
        runs alone in the HF engine: batch-invariant), else None."""
        trainer = self.config.trainer
        if not trainer.deterministic:
            return None
        return [request_seed(trainer.seed, stream, self.step, i) for i in range(count)]

    async def validate(self, records: list[PromptRecord], version: int) -> Validation:
        """The greedy pass, plus the sampled one when ``trainer.val_n > 1``."""
        self.versions.clear()
        result = await self.greedy(records, version)
        if self.config.trainer.val_n > 1:
            result.metrics.update(await self.sampled(records, version))
        result.pinned = self.version_metrics(version)
        return result

    def version_metrics(self, version: int) -> dict[str, float]:
        """``val/weight_version``: the one version every held-out answer came from (the
        trainer's, asked for as each request's minimum while training stands still), so an
        async run's curve says which weights each point measured. Answers from more than one
        version (a push landing mid-validation) are flagged (``val/mixed_versions``)."""
        seen = self.versions or {version}
        metrics = {"val/weight_version": float(min(seen))}
        if len(seen) > 1:
            log.warning("held-out answers came from weight versions %s", sorted(seen))
            metrics["val/mixed_versions"] = 1.0
        return metrics
