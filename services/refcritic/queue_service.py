"""The refcritic's queue path: stateless reads (reference log-probs, values) as Redis jobs.

Why a queue: reference log-probs need no state beyond the frozen weights, so any number of
processes (``rlfleet refcritic --worker-only``) can share the work, and a job held by a worker
that dies stays pending until a live worker reclaims it (``rlfleet.common.queue``).

Local first (``refcritic.local_first``, ``rlfleet.common.queue.local_first.LocalFirst``): in the process
that serves gRPC, a read arriving while that process's own worker of its kind is idle is
computed right there, on the plain lists from the proto: no JSON, no Redis. Otherwise the
batch becomes one job (JSON ``{"kind", "prompts", "responses"}``), or a few consecutive ones
when ``IdleWorkers`` sees several workers waiting (never under ``chunk_size`` sequences each),
handed to the shared ``ScatterGather`` producer. Answers (JSON rows) are put back in input
order; a batch not answered within ``refcritic.request_timeout_s`` raises DeadlineExceeded (a
TimeoutError); a worker's failure is re-raised by its error code (``Result.unwrap``). The
sequences are validated once, by the model that computes them (``RefPolicy``/``Critic``), on
whichever path; a bad one in a later job is reported with that job's offset.

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

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar, overload

from redis.asyncio import Redis

from rlfleet.common.errors import InvalidArgument
from rlfleet.common.keys import REFCRITIC_GROUP, Keys
from rlfleet.common.queue.consumer import Consumer
from rlfleet.common.queue.local_first import IdleWorkers, LocalFirst, WorkerSlots, parts_for
from rlfleet.common.queue.producer import Producer
from rlfleet.common.queue.results import Result
from rlfleet.common.queue.scatter import ScatterGather
from rlfleet.common.queue.stream import QueueStream
from rlfleet.refcritic.models import Rows

GROUP = REFCRITIC_GROUP  # re-exported for tools and tests that inspect the streams
MAX_DELIVERIES = 3
RESULT_TTL_S = 900

Kind = Literal["ref", "values"]
KINDS: tuple[Kind, ...] = ("ref", "values")
LocalCompute = Callable[[list[list[int]], list[list[int]]], Awaitable[Rows]]
Side = TypeVar("Side", bound=QueueStream)


@overload
def refcritic_queue(redis: Redis, keys: Keys, kind: Kind) -> Consumer: ...
@overload
def refcritic_queue(redis: Redis, keys: Keys, kind: Kind, side: type[Side]) -> Side: ...
def refcritic_queue(
    redis: Redis, keys: Keys, kind: Kind, side: type[QueueStream] = Consumer
) -> QueueStream:
    """One side (a worker's ``Consumer``, the default; the front door's ``Producer``) of the
    queue of one kind of job; producers and workers build it the same way."""
    stream = keys.refcritic_stream if kind == "ref" else keys.refcritic_values_stream
    return side(redis, keys, stream, REFCRITIC_GROUP, MAX_DELIVERIES, RESULT_TTL_S)


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


def rows_of(answer: Result) -> Rows:
    """The rows of an answer; a worker's failure is raised as its code's rlfleet exception."""
    return json.loads(answer.unwrap())


def chunk_rows(chunk: Chunk, answer: Result) -> Rows:
    """``rows_of``, with a bad input's message placed in the whole batch (job offsets)."""
    try:
        return rows_of(answer)
    except InvalidArgument as exc:
        if chunk.start == 0:
            raise
        raise InvalidArgument(f"in the job starting at sequence {chunk.start}: {exc}") from exc


class QueuedCompute:
    """Producer side: a read computed in-process when a local worker is idle (``serve_locally``),
    else submitted as one or a few jobs, answered, and returned as rows in input order."""

    def __init__(self, redis: Redis, keys: Keys, chunk_size: int, timeout_s: float) -> None:
        self.chunk_size, self.timeout_s = chunk_size, timeout_s
        queues = {kind: refcritic_queue(redis, keys, kind, Producer) for kind in KINDS}
        self.producers = {
            kind: ScatterGather(queue, timeout_s, "refcritic workers")
            for kind, queue in queues.items()
        }
        self.idle = {kind: IdleWorkers(queue) for kind, queue in queues.items()}
        self.routes = {kind: LocalFirst(None, timeout_s) for kind in KINDS}
        self.local: dict[Kind, LocalCompute] = {}

    def serve_locally(self, kind: Kind, slots: WorkerSlots, compute: LocalCompute) -> None:
        """Compute ``kind`` reads with ``compute`` whenever one of ``slots`` is idle."""
        self.routes[kind] = LocalFirst(slots, self.timeout_s)
        self.local[kind] = compute

    async def start(self) -> None:
        for producer in self.producers.values():
            await producer.start()

    async def compute(self, kind: Kind, prompts: list[list[int]], responses: list[list[int]]):
        """Rows for every sequence, in order; DeadlineExceeded if not answered in time."""
        if len(prompts) != len(responses):
            raise InvalidArgument(f"{len(prompts)} prompts but {len(responses)} responses")
        if not prompts:
            raise InvalidArgument("the batch is empty")
        return await self.routes[kind].run(
            lambda: self.local[kind](prompts, responses),
            lambda: self._queued(kind, prompts, responses),
        )

    async def _queued(self, kind: Kind, prompts: list[list[int]], responses: list[list[int]]):
        parts = parts_for(len(prompts), await self.idle[kind].count(), self.chunk_size)
        chunks = chunk_batch(prompts, responses, -(-len(prompts) // parts))
        payloads = [encode_job(kind, chunk.prompts, chunk.responses) for chunk in chunks]
        answers = await self.producers[kind].run(payloads)
        return reassemble(chunks, [chunk_rows(c, a) for c, a in zip(chunks, answers, strict=True)])
