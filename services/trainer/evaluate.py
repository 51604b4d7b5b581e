"""Held-out accuracy through the fleet: greedy generation via the router, scored by the
reward service. Measuring through the same path the training uses means the number
reflects what the rollout replicas actually serve, not a private copy of the model."""

from __future__ import annotations

import uuid
from collections import defaultdict

from rlfleet.rollout.types import GenerateRequest, SamplingParams
from rlfleet.trainer.data import PromptRecord


async def greedy_responses(
    rollout, records: list[PromptRecord], max_tokens: int, min_version: int, chunk: int = 256
) -> list[list[int]]:
    """Token ids of the greedy completion of every record, ``chunk`` prompts per batch call."""
    tag = uuid.uuid4().hex[:8]
    sampling = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    requests = [
        GenerateRequest(
            request_id=f"val-{tag}-{index}",
            sampling=sampling,
            prompt_token_ids=record.token_ids,
            session_id=f"val-{tag}-{index}",
            min_weight_version=min_version,
        )
        for index, record in enumerate(records)
    ]
    responses: list[list[int]] = []
    for start in range(0, len(requests), chunk):
        results = await rollout.generate_batch(requests[start : start + chunk])
        responses.extend(result.completions[0].token_ids for result in results)
    return responses


def accuracy_by_source(records: list[PromptRecord], scores: list[float]) -> dict[str, float]:
    """``val-core/<data_source>/reward/mean@1`` (verl's name) per data source."""
    grouped: dict[str, list[float]] = defaultdict(list)
    for record, score in zip(records, scores, strict=True):
        grouped[record.data_source].append(score)
    return {f"val-core/{src}/reward/mean@1": sum(v) / len(v) for src, v in grouped.items()}
