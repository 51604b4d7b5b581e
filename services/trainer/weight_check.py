"""Verify every refit: after a push, the replicas must score fixed tokens as the actor does.

Why: a weight push that was acknowledged is not a push that was applied as meant. A replica
can report the new version while serving something else (a reload that mapped a fused tensor
wrong, a worker that kept its old weights, bytes corrupted after the checksum), and nothing
in the run says so until the curves go wrong. NeMo-RL checks each refit by comparing the
engine's log-probs with the trainer's; verl logs ``training/rollout_probs_diff_*`` over the
sampled tokens (``rlfleet.trainer.metrics.rollout_probs_diff``, its model here). This is the
cheap, deliberate version of both: a few fixed sequences (``trainer.weight_check.prompts``),
their last ``tokens`` tokens scored teacher-forced on each replica (``Rollout.ScoreTokens``)
and on the actor (once per version, before the actor trains on), compared as probabilities,
``max |p_replica - p_actor|``: bounded in [0, 1], so rounding on unlikely tokens (large in
log space under bf16) does not drown the signal, and one bound fits every recipe of a dtype
(``rlfleet.common.config.weight_check`` has the measurements behind the defaults).

A replica over the bound is named in an ERROR line with the version and the diff, and with
``on_mismatch: drain`` the router stops routing to it (``Router.DrainReplica``). What it
cannot see: a replica one step behind in bf16 at a small learning rate differs from the new
weights by less than the rounding does (0.003 on the tiny model at lr 1.5e-4, 0.00004 on
SmolLM2 at 1e-6); the weight version each response carries covers that case.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.config.weight_check import FP32_BOUND, LOW_PRECISION_BOUND
from rlfleet.common.errors import RlfleetError
from rlfleet.rollout.types import (
    ReplicaState,
    ReplicaStatus,
    ScoredSequence,
    ScoreRequest,
    TokenScores,
)

log = logging.getLogger(__name__)

METRIC = "weight/parity_max_abs_diff"
"""Max over the probed replicas; ``<METRIC>/<replica_id>`` per replica."""


@dataclass(frozen=True)
class Probe:
    """The fixed sequences: ``prompts[i]`` is context, ``targets[i]`` the tokens scored."""

    prompts: list[list[int]]
    targets: list[list[int]]

    def request(self, version: int) -> ScoreRequest:
        pairs = zip(self.prompts, self.targets, strict=True)
        return ScoreRequest([ScoredSequence(p, t) for p, t in pairs], version)


def probe_of(token_lists: Sequence[list[int]], tokens: int, max_len: int) -> Probe:
    """Each sequence cut to ``max_len`` tokens, its last ``tokens`` scored (the first token
    is always context); sequences of fewer than two tokens are left out."""
    prompts, targets = [], []
    for ids in token_lists:
        ids = list(ids[:max_len])
        if len(ids) < 2:
            continue
        split = max(1, len(ids) - tokens)
        prompts.append(ids[:split])
        targets.append(ids[split:])
    if not prompts:
        raise ValueError("trainer.weight_check.prompts: no prompt has two tokens or more")
    return Probe(prompts, targets)


@dataclass(frozen=True)
class Parity:
    """One replica against the actor: the largest probability gap and where it was
    (sequence, token); ``math.inf`` when the answer does not fit the probe."""

    replica_id: str
    version: int
    max_abs_diff: float
    where: tuple[int, int] = (-1, -1)


def parity(
    replica_id: str, version: int, expected: Sequence[Sequence[float]], got: TokenScores
) -> Parity:
    """``max |exp(got) - exp(expected)|`` over every scored token. A missing, extra or
    non-finite log-prob counts as an infinite gap: an answer that does not fit is a failure."""
    rows = got.logprobs
    if len(rows) != len(expected) or any(
        len(a) != len(b) for a, b in zip(rows, expected, strict=False)
    ):
        return Parity(replica_id, version, math.inf)
    worst, where = 0.0, (-1, -1)
    for i, (mine, theirs) in enumerate(zip(expected, rows, strict=True)):
        for j, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            gap = abs(math.exp(a) - math.exp(b)) if math.isfinite(b) else math.inf
            if gap > worst or where == (-1, -1):
                worst, where = gap, (i, j)
    return Parity(replica_id, version, worst, where)


def parity_metrics(results: Sequence[Parity]) -> dict[str, float]:
    """``weight/parity_max_abs_diff`` (max over replicas) and one per replica; {} if none."""
    if not results:
        return {}
    metrics = {METRIC: max(r.max_abs_diff for r in results)}
    metrics.update({f"{METRIC}/{r.replica_id}": r.max_abs_diff for r in results})
    return metrics


def default_bound(serving_dtype: str, actor_bf16: bool, actor_dtype: str) -> float:
    """0.01 when the engines and the actor compute in fp32, else 0.1 (see the config)."""
    fp32 = serving_dtype == "float32" and actor_dtype == "float32" and not actor_bf16
    return FP32_BOUND if fp32 else LOW_PRECISION_BOUND


class ReplicaProbe(Protocol):
    """The fleet side: who serves, a replica's scores, and taking one out of routing
    (``rlfleet.trainer.replica_probe.GrpcReplicaProbe``)."""

    async def list_replicas(self) -> list[ReplicaStatus]: ...

    async def score_tokens(self, replica: ReplicaStatus, request: ScoreRequest) -> TokenScores: ...

    async def drain_replica(self, replica_id: str) -> None: ...

    async def close(self) -> None: ...


class ScoringActor(Protocol):
    def logprobs(
        self, prompts: list[list[int]], responses: list[list[int]], temperature: float | None
    ) -> list[list[float]]: ...


@dataclass(frozen=True)
class Expected:
    """The actor's log-probs of the probe's targets at one weight version."""

    version: int
    logprobs: list[list[float]]


class WeightCheck:
    """The probe of one run: ``expect`` on the actor at push time, ``check`` once pushed."""

    def __init__(self, config: RlfleetConfig, probe: Probe, fleet: ReplicaProbe, bound: float):
        self.cfg = config.trainer.weight_check
        self.probe, self.fleet, self.bound = probe, fleet, bound
        self._checked_once = False

    def due(self, version: int) -> bool:
        """Every ``every`` versions, and the run's first push whatever its number."""
        return not self._checked_once or version % self.cfg.every == 0

    async def expect(self, actor: ScoringActor, version: int) -> Expected:
        """The actor's side, now (the actor may train on once this returns)."""
        p = self.probe
        rows = await asyncio.to_thread(actor.logprobs, p.prompts, p.targets, 1.0)
        return Expected(version, rows)

    async def check(self, expected: Expected) -> dict[str, float]:
        """Score on every serving replica at ``expected.version``, compare, act."""
        self._checked_once = True
        try:
            listed = await self.fleet.list_replicas()
        except RlfleetError as exc:  # the probe never fails a step; the next push probes
            log.warning("weight check of version %d skipped: %s", expected.version, exc)
            return {}
        replicas = [
            r
            for r in listed
            if r.state is ReplicaState.SERVING and r.weight_version == expected.version
        ]
        found = await asyncio.gather(*(self._parity(r, expected) for r in replicas))
        results = [r for r in found if r is not None]
        for bad in (r for r in results if r.max_abs_diff > self.bound):
            await self._refuse(bad)
        return parity_metrics(results)

    async def _parity(self, replica: ReplicaStatus, expected: Expected) -> Parity | None:
        """None when the replica could not answer for this version (gone, or moved on)."""
        try:
            got = await self.fleet.score_tokens(replica, self.probe.request(expected.version))
        except RlfleetError as exc:
            log.warning("weight check: %s did not score: %s", replica.replica_id, exc)
            return None
        if got.weight_version != expected.version:
            return None
        return parity(replica.replica_id, expected.version, expected.logprobs, got)

    async def _refuse(self, bad: Parity) -> None:
        """The ERROR line, and with ``drain`` the replica out of routing."""
        action = "draining it" if self.cfg.on_mismatch == "drain" else "left serving (warn)"
        log.error(
            "weight check: replica %s at weight version %d scores the probe %.4g away from "
            "the actor (max |p_replica - p_actor|, sequence %d token %d; bound %.4g): %s",
            bad.replica_id,
            bad.version,
            bad.max_abs_diff,
            *bad.where,
            self.bound,
            action,
        )
        if self.cfg.on_mismatch == "drain":
            try:
                await self.fleet.drain_replica(bad.replica_id)
            except RlfleetError as exc:
                log.error("weight check: could not drain %s: %s", bad.replica_id, exc)

    async def close(self) -> None:
        await self.fleet.close()


def weight_check_for(
    config: RlfleetConfig, fleet: ReplicaProbe | None, tokenizer, actor
) -> WeightCheck | None:
    """The run's probe when ``trainer.weight_check.enable`` (None otherwise, or when the
    fleet offers no way to reach replicas: in-process test fleets)."""
    cfg = config.trainer.weight_check
    if not cfg.enable or fleet is None:
        return None
    from rlfleet.model.precision import serving_dtype

    ids = [tokenizer.encode(text) for text in cfg.prompts]
    probe = probe_of(ids, cfg.tokens, config.rollout.max_model_len - 1)  # see ScoreTokens
    engines = serving_dtype(config.model.dtype, config.rollout.dtype, actor.device.type)
    held = str(next(actor.model.parameters()).dtype).removeprefix("torch.")
    bound = cfg.max_abs_diff or default_bound(engines, actor.uses_bf16, held)
    return WeightCheck(config, probe, fleet, bound)
