"""Sampling through the fleet: the sampled weights onto the replicas, then batched generation.

Replicas serve one set of weights at a time (the base plus at most one merged adapter), each
with a version. A sampling session names a snapshot of one client's adapter (or the base);
a ``sample`` for the snapshot the replicas hold goes straight to the router; one for another
snapshot waits until the samples in flight are answered, pushes its snapshot as the next
version, and samples with ``min_weight_version`` at that version, so no completion is drawn
from another client's weights. Swaps are first come, first served (one lock), so two clients
sampling in turn both progress. Concurrent samples go to the router together
(``generate_batch``: each replica gets its share as one queue entry) once no other has arrived
for a few milliseconds (``Batcher``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from rlfleet.rollout.types import GenerateRequest, GenerateResult, SamplingParams
from rlfleet.trainer.fleet import Generator, WeightPublisher
from rlfleet.trainer.tinker.types import SampledSequence, SampleSpec, StopReason

log = logging.getLogger(__name__)

LINGER_S = 0.015
"""A batch goes once no sample has joined it for this long... (the gaps between one round's
16 calls, through the SDK on a loaded 2-core machine: 95% under 4.2 ms, 99% under 7.9 ms, at
most 15 ms; at 5 ms a round still went as 1.7-7 calls, at 15 ms as 1.2-2)"""
MAX_LINGER_S = 0.05
"""...or this long after its first sample arrived, whichever comes first."""


@dataclass(frozen=True)
class Snapshot:
    """Weights to sample from: a copy of an adapter in wire form (``rlfleet.model.lora``)."""

    key: str
    state: dict


class Batcher:
    """Concurrent ``generate`` calls as one ``generate_batch`` to the router.

    Why a quiet gap rather than a fixed wait after the first call: the SDK sends a round's
    ``sample`` calls at once, but the server reads them one HTTP request at a time, a
    few milliseconds apart (more on a loaded machine). A fixed 5 ms after the first cut a
    16-prompt round into ~10 ``GenerateBatch`` calls; waiting until the calls stop coming (at
    most ``max_linger_s``) sends it as one or two (bench/bench_tinker.py)."""

    def __init__(
        self, rollout: Generator, linger_s: float = LINGER_S, max_linger_s: float = MAX_LINGER_S
    ) -> None:
        self.rollout, self.linger_s, self.max_linger_s = rollout, linger_s, max_linger_s
        self._pending: list[tuple[GenerateRequest, asyncio.Future]] = []
        self._flush: asyncio.Task | None = None
        self._last = 0.0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((request, future))
        self._last = loop.time()
        if self._flush is None:
            self._flush = asyncio.create_task(self._send())
        return await future

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_linger_s
        while (now := loop.time()) < deadline and now < self._last + self.linger_s:
            await asyncio.sleep(min(self._last + self.linger_s, deadline) - now)
        batch, self._pending, self._flush = self._pending, [], None
        try:
            results = await self.rollout.generate_batch([request for request, _ in batch])
        except Exception as exc:  # every caller of the batch gets the failure
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


class Sampler:
    """One fleet of replicas shared by every sampling session (see the module docstring)."""

    def __init__(
        self,
        rollout: Generator,
        weights: WeightPublisher,
        min_replicas: int,
        replica_wait_s: float,
        timeout_s: float,
    ) -> None:
        self.weights, self.batcher = weights, Batcher(rollout)
        self.min_replicas, self.replica_wait_s, self.timeout_s = (
            min_replicas,
            replica_wait_s,
            timeout_s,
        )
        self.current: str | None = None
        """The key of the snapshot the replicas hold (None: not pushed yet)."""
        self.version = 0
        self._swap = asyncio.Lock()
        self._in_flight = 0
        self._idle = asyncio.Condition()
        self._ready = False

    async def close(self) -> None:
        await self.batcher.rollout.close()
        await self.weights.close()

    async def sample(
        self, snapshot: Snapshot, spec: SampleSpec, max_tokens: int, session: str
    ) -> list[SampledSequence]:
        """``spec.num_samples`` completions of ``spec.prompt`` under ``snapshot``."""
        await self._enter(snapshot)
        try:
            request = GenerateRequest(
                request_id=f"tinker-{uuid.uuid4().hex}",
                sampling=sampling_params(spec, max_tokens),
                prompt_token_ids=list(spec.prompt),
                session_id=session,
                min_weight_version=self.version,
                timeout_s=self.timeout_s,
            )
            result = await self.batcher.generate(request)
        finally:
            await self._leave()
        return [sequence_of(c.token_ids, c.logprobs, c.finish_reason) for c in result.completions]

    async def _enter(self, snapshot: Snapshot) -> None:
        async with self._swap:
            if self.current != snapshot.key:
                async with self._idle:
                    await self._idle.wait_for(lambda: self._in_flight == 0)
                await self._push(snapshot)
            self._in_flight += 1

    async def _leave(self) -> None:
        async with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    async def _push(self, snapshot: Snapshot) -> None:
        if not self._ready:
            await self.weights.wait_for_replicas(self.min_replicas, self.replica_wait_s)
            self._ready = True
        version = self.version + 1
        await self.weights.push(snapshot.state, version, flush_cache=True)
        self.current, self.version = snapshot.key, version
        log.info("replicas serve %s as weight version %d", snapshot.key, version)


def sampling_params(spec: SampleSpec, max_tokens: int) -> SamplingParams:
    """The fleet's sampling parameters for ``spec`` (``top_k`` -1, "no limit", is 0 here)."""
    return SamplingParams(
        n=spec.num_samples,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=max(spec.top_k, 0),
        max_tokens=max_tokens,
        stop=list(spec.stop),
        seed=spec.seed,
        logprobs=1,
    )


def sequence_of(tokens: list[int], logprobs: list[float], finish_reason: str) -> SampledSequence:
    reason: StopReason = "length" if finish_reason == "length" else "stop"
    return SampledSequence(list(tokens), [float(x) for x in logprobs], reason)
