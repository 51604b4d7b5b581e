"""Held-out accuracy through the fleet: greedy generation via the router, scored by the
reward service. Measuring through the same path the training uses means the number
reflects what the rollout replicas actually serve, not a private copy of the model."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict

from rlfleet.rollout.types import GenerateRequest, SamplingParams
from rlfleet.trainer.data import PromptRecord


async def greedy_responses(
    rollout, records: list[PromptRecord], max_tokens: int, min_version: int, concurrency: int = 64
) -> list[list[int]]:
    """Token ids of the greedy completion of every record (bounded concurrency)."""
    gate = asyncio.Semaphore(concurrency)
    tag = uuid.uuid4().hex[:8]

    async def one(index: int, record: PromptRecord) -> list[int]:
        request = GenerateRequest(
            request_id=f"val-{tag}-{index}",
            sampling=SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens),
            prompt_token_ids=record.token_ids,
            session_id=f"val-{tag}-{index}",
            min_weight_version=min_version,
        )
        async with gate:
            result = await rollout.generate(request)
        return result.completions[0].token_ids

    return await asyncio.gather(*(one(i, r) for i, r in enumerate(records)))


def accuracy_by_source(records: list[PromptRecord], scores: list[float]) -> dict[str, float]:
    """``val-core/<data_source>/reward/mean@1`` (verl's name) per data source."""
    grouped: dict[str, list[float]] = defaultdict(list)
    for record, score in zip(records, scores, strict=True):
        grouped[record.data_source].append(score)
    return {f"val-core/{src}/reward/mean@1": sum(v) / len(v) for src, v in grouped.items()}
