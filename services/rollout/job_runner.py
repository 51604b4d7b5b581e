"""Runs a replica's requests on its engine and stores the answers of queue jobs.

Why apart from the job loop (``job_loop.py``): the loop decides *when* a job runs (read,
park, retry); this decides *what running it means*. A plain entry is one request; a packed
entry (a router's ``GenerateBatch`` share for this replica) runs all its members at once, so
the engine batches them together, and each member's answer is stored under its own request
id before the entry is completed. Answers go through the fence (``WorkQueue.finish``): one
that arrives after our lease lapsed, or after the janitor moved the entry, is discarded and
counted. A job cancelled by an update or shutdown is handed back for a retry (its entry stays
unacknowledged); one whose callers all gave up is dropped unanswered.

``rollout.debug_generate_delay_s`` (testing aid, 0 in real runs) sleeps inside every queued
request before generating, so tests can kill a replica while it holds work.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import ErrorCode, FailedPrecondition
from rlfleet.common.queue.results import encode_result
from rlfleet.common.queue.workqueue import Failure, Finish, Job, WorkQueue
from rlfleet.rollout import continuation, tokenize
from rlfleet.rollout.engines.base import Engine
from rlfleet.rollout.inflight import InFlight
from rlfleet.rollout.limits import PromptLimits
from rlfleet.rollout.types import GenerateRequest, GenerateResult, unpack_requests

log = logging.getLogger(__name__)

_Answer = tuple[bytes, Failure | None]  # a member's packed result, or why it failed
T = TypeVar("T")


class JobRunner:
    """Generates for one request or one queue job; counts what it served and discarded."""

    def __init__(
        self,
        config: RlfleetConfig,
        engine: Engine,
        queue: WorkQueue,
        replica_id: str,
        inflight: InFlight,
        version: Callable[[], int],
        requeue: Callable[[Job], None],
    ) -> None:
        self.config, self.engine, self.queue, self.replica_id = config, engine, queue, replica_id
        self._inflight, self._version, self._requeue = inflight, version, requeue
        self._limits = PromptLimits.of(config.rollout)  # text bounded before it is tokenized
        self.served = 0  # requests answered
        self.generated_tokens = 0  # completion tokens so far (metrics: tokens/s)
        self.discarded = 0  # answers dropped by the fence (lease lapsed, or job moved away)

    async def generate(self, request: GenerateRequest, key: str) -> GenerateResult:
        """One request on the engine (``key``: its engine request id), tagged with the weight
        version it was generated with."""
        self._limits.check(request)
        prompt = request.prompt_token_ids or await tokenize.encode(
            self.engine, request.prompt_text or "", self._limits
        )  # off the event loop: the lease, the stream and other jobs go on meanwhile
        self._check_request(request, prompt)
        completions = await continuation.generate(
            self._inflight.gate, self.engine, key, prompt, request.sampling, self._version
        )
        version = continuation.oldest_version(completions, self._version())
        self.generated_tokens += sum(len(c.token_ids) for c in completions)
        return GenerateResult(request.request_id, completions, version, self.replica_id, prompt)

    def _check_request(self, request: GenerateRequest, prompt: list[int]) -> None:
        self.engine.check_prompt(prompt, request.sampling.max_tokens)
        if request.min_weight_version > self._version():
            raise FailedPrecondition(
                f"needs weight version >= {request.min_weight_version}, "
                f"replica has {self._version()}"
            )

    async def run(self, job: Job, key: str) -> None:
        """Run a queue job and answer it (a packed one member by member)."""
        try:
            if (members := unpack_requests(job.payload)) is None:
                request = GenerateRequest.from_json(job.payload)
                request.validate()
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            bad = Failure(ErrorCode.INVALID_ARGUMENT, f"bad request: {exc}")
            await self._complete(job, b"", bad)
            return
        if members is not None:
            await self._run_packed(job, members, key)
            return
        try:
            if self.config.rollout.debug_generate_delay_s > 0:
                await asyncio.sleep(self.config.rollout.debug_generate_delay_s)
            result = await self.generate(request, key)
        except asyncio.CancelledError:
            if self._inflight.was_aborted(key):  # its callers gave up: dropped unanswered
                log.info("request %s aborted: its callers gave up", job.request_id)
                await with_retries(job.request_id, lambda: self.queue.discard(job))
            else:
                self._requeue(job)  # an update (or shutdown) cancelled it: still unacked
            return
        except Exception as exc:  # noqa: BLE001 - the waiter gets the reason
            if not self.engine.is_alive():
                return  # not the request's fault: leave it queued for whoever takes over
            log.warning("request %s failed: %s", job.request_id, exc)
            await self._complete(job, b"", Failure.of(exc))
            return
        if await self._complete(job, result.to_json(), None) is Finish.STORED:  # JSON: any router
            self.served += 1

    async def _run_packed(self, job: Job, members: list[GenerateRequest], key: str) -> None:
        """All members at once (the engine sees them in one tick); answers stored per member."""
        try:
            if self.config.rollout.debug_generate_delay_s > 0:
                await asyncio.sleep(self.config.rollout.debug_generate_delay_s)
            answers = await asyncio.gather(
                *(self._member_answer(r, f"{key}.{i}") for i, r in enumerate(members))
            )
        except asyncio.CancelledError:
            self._requeue(job)  # as a single job: the entry stays unacked, re-run whole
            return
        if not self.engine.is_alive():
            return  # not the requests' fault: leave the entry for whoever takes over
        if await self._answer_packed(job, members, answers) is Finish.STORED:
            self.served += sum(failure is None for _, failure in answers)

    async def _member_answer(self, request: GenerateRequest, key: str) -> _Answer:
        """A member's packed result, or why it failed (its own fault, not its neighbours')."""
        try:
            request.validate()
            return (await self.generate(request, key)).encode(), None
        except Exception as exc:  # noqa: BLE001 - this member's waiter gets the reason
            if self.engine.is_alive():
                log.warning("request %s failed: %s", request.request_id, exc)
            return b"", Failure.of(exc)

    async def _answer_packed(
        self, job: Job, members: list[GenerateRequest], answers: list[_Answer]
    ) -> Finish | None:
        """Members' answers and the entry's in one fenced step (the first answer per id wins);
        the entry's completion wakes the router, which then reads the members' answers."""
        mine = {
            request.request_id: encode_result(payload, failure)
            for request, (payload, failure) in zip(members, answers, strict=True)
        }
        return await self._finish(job, encode_result(b""), mine)

    async def _complete(self, job: Job, payload: bytes, error: Failure | None) -> Finish | None:
        return await self._finish(job, encode_result(payload, error))

    async def _finish(
        self, job: Job, answer: bytes, members: dict[str, bytes] | None = None
    ) -> Finish | None:
        """Store an answer through the fence; a discarded one is counted and logged."""
        outcome = await with_retries(
            job.request_id, lambda: self.queue.finish(job, answer, members)
        )
        if outcome in (Finish.FENCED, Finish.GONE):
            self.discarded += 1
            why = "our lease lapsed" if outcome is Finish.FENCED else "it was moved away"
            log.warning("discarded the answer to %s: %s", job.request_id, why)
        return outcome


async def with_retries(request_id: str, answer: Callable[[], Awaitable[T]]) -> T | None:
    """``answer()``, tried three times over Redis hiccups; None (logged) if all failed: the
    entry then stays pending in the stream for recovery."""
    for attempt in range(3):
        try:
            return await answer()
        except Exception as exc:  # noqa: BLE001
            log.warning("completing %s failed (%s), attempt %d", request_id, exc, attempt)
            await asyncio.sleep(0.5 * (attempt + 1))
    log.error("could not answer %s; its entry stays pending for recovery", request_id)
    return None
