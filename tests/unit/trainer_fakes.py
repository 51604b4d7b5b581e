"""In-process stand-ins for the services a ``Trainer`` calls, and a trainer wired to them.

The actor is a real (tiny, random) Qwen2 model; generation samples from that same model so a
step is genuinely on-policy, and the reward prefers one token (``GOOD_TOKEN``). Shared by the
trainer's unit tests (step, retries, sampling, async); the integration tests run the same
step through real servers.

Each stand-in subclasses the Protocol of ``rlfleet.trainer.fleet`` it replaces, and
``scripts/typecheck.py`` (``make typecheck``) checks this module with the package: a fake that
drifts from its Protocol fails the check, instead of production code bending to fit it.
"""

from __future__ import annotations

from typing import Any

import torch
from tiny_models import random_qwen2

from rlfleet.common.config import load_config
from rlfleet.refcritic.client import CheckpointInfo
from rlfleet.reward.types import ScoreRequest, ScoreResult
from rlfleet.rollout.types import Completion, GenerateRequest, GenerateResult, ReplicaStatus
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.fleet import Fleet, Generator, RefCritic, ScoreService, WeightPublisher
from rlfleet.trainer.trainer import Trainer

VOCAB = 16
GOOD_TOKEN = 5


def tiny_model():
    return random_qwen2(hidden=32, layers=1, heads=2, kv_heads=1, vocab=VOCAB)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


class SamplingRollout(Generator):
    """Samples from the actor's own model; reports a configurable weight version."""

    def __init__(self, model: Any, version_offset: int = 0) -> None:
        self.model = model
        self.version_offset = version_offset
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        prompt = torch.tensor([request.prompt_token_ids])
        with torch.no_grad():
            out = self.model.generate(
                prompt.repeat(request.sampling.n, 1),
                do_sample=True,
                max_new_tokens=request.sampling.max_tokens,
                min_new_tokens=request.sampling.max_tokens,
                pad_token_id=0,
            )
        completions = [Completion(row[prompt.shape[1] :].tolist(), [], "", "length") for row in out]
        version = request.min_weight_version + self.version_offset
        return GenerateResult(request.request_id, completions, version, "fake-0")

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return [await self.generate(request) for request in requests]

    async def close(self) -> None:
        pass


class CountingReward(ScoreService):
    async def score_batch(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        return [
            ScoreResult(r.id, r.solution_str.count(chr(ord("a") + GOOD_TOKEN)) / 2, {}, "")
            for r in requests
        ]

    async def close(self) -> None:
        pass


class FrozenRef(RefCritic):
    """A reference whose log-probs are all 0; no critic (these tests run GRPO)."""

    def __init__(self, actor: Actor) -> None:
        self.actor = actor

    async def ref_logprobs(
        self, prompts: list[list[int]], responses: list[list[int]]
    ) -> list[list[float]]:
        return [[0.0] * len(r) for r in responses]

    async def values(
        self, prompts: list[list[int]], responses: list[list[int]]
    ) -> list[list[float]]:
        raise AssertionError("no critic here")

    async def update_critic(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        returns: list[list[float]],
        old_values: list[list[float]],
    ) -> dict[str, float]:
        raise AssertionError("no critic here")

    async def save_checkpoint(self, path: str) -> CheckpointInfo:
        raise AssertionError("no critic here")

    async def load_checkpoint(self, path: str) -> CheckpointInfo:
        raise AssertionError("no critic here")

    async def close(self) -> None:
        pass


class RecordingSync(WeightPublisher):
    def __init__(self) -> None:
        self.pushed: list[int] = []

    async def push(
        self, state_dict: dict, version: int, flush_cache: bool = True, only_stale: bool = False
    ) -> dict[str, float]:
        self.pushed.append(version)
        return {"timing_s/update_weights": 0.0}

    async def wait_for_replicas(self, count: int, timeout_s: float) -> list[ReplicaStatus]:
        return []

    async def close(self) -> None:
        pass


def make_trainer(*, version_offset: int = 0, **overrides: Any) -> Trainer:
    items = {"trainer.lr": 5e-3, "rollout.max_tokens": 2, "rollout.n": 8, **overrides}
    config = load_config(None, [f"{k}={v}" for k, v in items.items()], env={})
    model = tiny_model()
    actor = Actor(config, model, pad_id=0)
    fleet = Fleet(
        SamplingRollout(model, version_offset), CountingReward(), FrozenRef(actor), RecordingSync()
    )
    return Trainer(config, fleet, actor, CharTokenizer())


def prompts(count=4):
    return [PromptRecord("p", "count", "", {}, [1, 2, 3 + i % 3]) for i in range(count)]
