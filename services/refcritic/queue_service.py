"""The refcritic's queue path: stateless reads (reference log-probs, values) as Redis jobs.

Why a queue: reference log-probs need no state beyond the frozen weights, so any number of
processes (``rlfleet refcritic --worker-only``) can share the work, and a job held by a worker
that dies stays pending until a live worker reclaims it (``rlfleet.common.workqueue``).

A batch is cut into consecutive chunks of ``refcritic.micro_batch_size`` sequences, one job
each (JSON ``{"kind", "prompts", "responses"}``), under request ids generated here (callers'
ids would collide from batch to batch). Answers (JSON rows) are put back in input order; a batch
not fully answered within ``refcritic.request_timeout_s`` raises TimeoutError.

Two streams, because the two reads differ in who may answer them:

- ``ref`` jobs go to ``Keys.refcritic_stream``; every refcritic process's workers read it.
- ``values`` jobs go to ``<refcritic_stream>:values``, read only by the workers inside the process
  that serves gRPC. That process alone holds the *trained* critic: UpdateCritic, Save and Load
  stay direct calls there, since the optimizer state must have exactly one writer, and a
  worker-only process's critic would be the untrained initial one. Worker-only processes
  therefore load just the reference policy.

This module never imports grpc; ``server.py`` wraps it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Literal

from redis.asyncio import Redis

from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.common.keys import Keys
from rlfleet.common.workqueue import Result, WorkQueue

GROUP = "refcritic"
MAX_DELIVERIES = 3
RESULT_TTL_S = 900

Kind = Literal["ref", "values"]
Rows = list[list[float]]
_ERRORS = {"InvalidArgument": InvalidArgument, "FailedPrecondition": FailedPrecondition}


def values_stream(keys: Keys) -> str:
    """Stream of values jobs: the refcritic stream's name plus ``:values`` (same namespace)."""
    return keys.refcritic_values_stream


def refcritic_queue(redis: Redis, keys: Keys, kind: Kind) -> WorkQueue:
    """The queue of one kind of job; producers and workers build it the same way."""
    stream = keys.refcritic_stream if kind == "ref" else values_stream(keys)
    return WorkQueue(redis, keys, stream, GROUP, MAX_DELIVERIES, RESULT_TTL_S)


@dataclass
class Chunk:
    """Consecutive sequences ``start .. start + len(prompts)`` of a batch."""

    start: int
    prompts: list[list[int]]
    responses: list[list[int]]


def chunk_batch(prompts: list[list[int]], responses: list[list[int]], size: int) -> list[Chunk]:
    """Consecutive chunks of at most ``size`` sequences (``size < 1`` counts as 1)."""
    if len(prompts) != len(responses):
        raise InvalidArgument(f"{len(prompts)} prompts but {len(responses)} responses")
    size = max(1, size)
    return [
        Chunk(start, prompts[start : start + size], responses[start : start + size])
        for start in range(0, len(prompts), size)
    ]


def reassemble(chunks: list[Chunk], answers: list[Rows]) -> Rows:
    """The chunks' rows as one list in input order; checks each chunk got one row a sequence."""
    rows: Rows = []
    for chunk, answer in zip(chunks, answers, strict=True):
        if len(answer) != len(chunk.prompts) or chunk.start != len(rows):
            raise RuntimeError(
                f"chunk at {chunk.start}: {len(answer)} rows for {len(chunk.prompts)} sequences"
            )
        rows.extend(answer)
    return rows


def encode_job(kind: Kind, prompts: list[list[int]], responses: list[list[int]]) -> bytes:
    return json.dumps({"kind": kind, "prompts": prompts, "responses": responses}).encode()


def decode_job(payload: bytes) -> tuple[Kind, list[list[int]], list[list[int]]]:
    """(kind, prompts, responses); InvalidArgument for a payload that is not a job."""
    try:
        job = json.loads(payload)
        kind, prompts, responses = job["kind"], job["prompts"], job["responses"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"not a refcritic job: {exc}") from exc
    if kind not in ("ref", "values"):
        raise InvalidArgument(f"unknown job kind {kind!r}")
    return kind, prompts, responses


def encode_rows(rows: Rows) -> bytes:
    return json.dumps(rows).encode()


def error_text(exc: Exception) -> str:
    """How a worker reports a failure: ``<ExceptionName>: message`` (see ``raise_answer``)."""
    return f"{type(exc).__name__}: {exc}"


def rows_of(answer: Result) -> Rows:
    """The rows of an answer; a worker's InvalidArgument / FailedPrecondition is re-raised as
    such (so callers still get the right status), anything else as RuntimeError."""
    if answer.ok:
        return json.loads(answer.payload)
    name, _, message = (answer.error or "unknown queue error").partition(": ")
    raise _ERRORS.get(name, RuntimeError)(message if name in _ERRORS else answer.error)


class QueuedCompute:
    """Producer side: submit a batch's chunks, wait for all answers, return rows in order."""

    def __init__(self, redis: Redis, keys: Keys, chunk_size: int, timeout_s: float) -> None:
        self.queues = {kind: refcritic_queue(redis, keys, kind) for kind in ("ref", "values")}
        self.keys, self.chunk_size, self.timeout_s = keys, chunk_size, timeout_s

    async def start(self) -> None:
        for queue in self.queues.values():
            await queue.ensure_group()

    async def compute(self, kind: Kind, prompts: list[list[int]], responses: list[list[int]]):
        """Rows for every sequence, in order; TimeoutError if workers do not answer in time."""
        queue, chunks = self.queues[kind], chunk_batch(prompts, responses, self.chunk_size)
        if not chunks:
            return []
        batch = uuid.uuid4().hex
        qids = [f"refcritic-{kind}-{batch}-{i}" for i in range(len(chunks))]
        try:
            for qid, chunk in zip(qids, chunks, strict=True):
                await queue.submit(qid, encode_job(kind, chunk.prompts, chunk.responses))
            answers = await self._wait_all(queue, qids)
        finally:
            await queue.redis.unlink(*[self.keys.result(qid) for qid in qids])
        return reassemble(chunks, [rows_of(answer) for answer in answers])

    async def _wait_all(self, queue: WorkQueue, qids: list[str]) -> list[Result]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s

        async def wait(qid: str) -> Result | None:
            return await queue.wait_result(qid, max(0.01, deadline - loop.time()))

        answers = await asyncio.gather(*(wait(qid) for qid in qids))
        missing = sum(answer is None for answer in answers)
        if missing:
            raise TimeoutError(
                f"{missing} of {len(qids)} {queue.stream} jobs not answered within "
                f"{self.timeout_s:g}s (are refcritic workers running?)"
            )
        return list(answers)
