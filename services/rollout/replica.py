"""One rollout replica: an engine, its Redis request stream, its registry entry, weight updates.
No gRPC here: ``server.py`` converts protos to the plain objects this class takes.

- Work arrives on the replica's own stream (the router picks the replica), read through the
  shared ``WorkQueue`` as consumer ``replica_id`` of group ``rollout``. A restarted replica with
  the same id first re-reads its own never-acknowledged entries, so nothing queued is lost.
- A weight update stops new work, lets in-flight requests finish for up to
  ``rollout.drain_timeout_s``, then cancels the rest. Cancelled queue jobs stay unacknowledged
  in Redis (a crash now loses nothing) and are run again here once the new weights are in;
  cancelled direct calls are retried the same way. So every answer was produced by exactly one
  weight version, the one it reports. The payload is verified, and the engine checks names and
  shapes, before anything changes: a bad update leaves the old weights serving. Versions only
  go up unless the header says ``force``; a load that fails midway (weights possibly half
  replaced) leaves the replica ``update_failed``, out of routing, until an update succeeds.
- If the engine dies, the replica stops heartbeating and exits; its unanswered entries stay in
  its stream for the router's janitor to move (they are not answered with errors).
- ``rollout.debug_generate_delay_s`` (testing aid, 0 in real runs) sleeps inside every queued
  request before generating, so tests can kill a replica while it holds work.
- An entry that needs newer weights than ours (a replica restarted under its id comes back at
  version 0 and re-reads entries queued for the weights it had) is parked, unacknowledged,
  until an update brings that version: it is not answered FAILED_PRECONDITION, so a caller
  retrying under the same id still gets it generated. Callers that give up are honoured for
  parked entries too.
- Leases fence answers: the heartbeat key holds a token new to each registration, and an
  answer is stored only while the key still holds ours and the entry is still in our stream
  (one Lua step, ``WorkQueue.fence``). A replica stalled past ``heartbeat_ttl_s`` (SIGSTOP, a
  long GC) has lost its lease, and the janitor may have moved its work: its late answers are
  discarded, and at its next beat it drops the jobs it held, registers again with a new token
  and re-reads whatever of its stream is still there.
- Callers that give up (a router's timeout or cancellation, with nobody else waiting) mark the
  submission cancelled; a watcher cancels such jobs here, which aborts them in the engine, and
  drops their entries unanswered (a retry under the same id is queued afresh).
- A packed entry (a router's ``GenerateBatch`` share for this replica) runs all its requests at
  once, so the engine batches them together; each member's answer is stored under its own
  request id, then the entry is completed. A weight update cancels and re-runs it as a whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis

from rlfleet.common import weights
from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import ErrorCode, FailedPrecondition, InvalidArgument, Unavailable
from rlfleet.common.keys import ROLLOUT_GROUP, Keys
from rlfleet.common.results import encode_result
from rlfleet.common.workqueue import Failure, Finish, Job, WorkQueue
from rlfleet.rollout.engine import Engine
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.types import (
    GenerateRequest,
    GenerateResult,
    ReplicaState,
    ReplicaStatus,
    UpdateOutcome,
    entry_demand,
    unpack_requests,
)

log = logging.getLogger(__name__)

GROUP = ROLLOUT_GROUP
_Answer = tuple[bytes, Failure | None]  # a member's packed result, or why it failed

READ_BLOCK_MS = 500  # how long one read waits; bounds how fast pause/stop take effect
CANCEL_POLL_S = 0.25  # how often running jobs are checked for callers that gave up
S = ReplicaState
T = TypeVar("T")


class Replica:
    """The replica core; see the module docstring."""

    def __init__(
        self, config: RlfleetConfig, engine: Engine, redis: Redis, keys: Keys,
        replica_id: str, address: str,
    ) -> None:  # fmt: skip
        self.config, self.engine, self.keys = config, engine, keys
        self.replica_id, self.address = replica_id, address
        self.registry = ReplicaRegistry(redis, keys, config.rollout.heartbeat_ttl_s)
        self.queue = WorkQueue(redis, keys, keys.rollout_stream(replica_id), GROUP)
        self.version, self.state, self.served, self._paused = 0, S.STARTING, 0, False
        self.generated_tokens = 0  # completion tokens so far (metrics: tokens/s)
        self._serving = asyncio.Event()  # set exactly when state is SERVING
        self._changed = asyncio.Event()  # pulsed on every state change
        self._running: dict[str, asyncio.Task] = {}  # engine request id -> task
        self._retry: deque[Job] = deque()  # jobs cancelled by an update, still unacked
        self._parked: list[tuple[int, Job]] = []  # (version needed, job) waiting for weights
        self._update_lock = asyncio.Lock()
        self._weights_intact = True  # False after a load that failed midway
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count()
        self._last_beat = 0.0
        self._lease = ""  # our token in the heartbeat key; "" until the first registration
        self._jobs: dict[str, Job] = {}  # engine request id -> the queue job it runs
        self._aborted: set[str] = set()  # engine request ids cancelled because callers left
        self.discarded = 0  # answers dropped by the fence (lease lapsed, or job moved away)
        self.failed = asyncio.Event()  # the engine died: stop, let the heartbeat TTL lapse
        self.drained = asyncio.Event()  # a router drained us and our work is done: exit

    async def start(self) -> None:
        """Register as starting, start the engine, then serve and consume."""
        await self._beat()
        started = time.perf_counter()
        await self.engine.start()
        log.info("%s engine started in %.1f s", self.engine.name, time.perf_counter() - started)
        await self.queue.ensure_group()
        self._set_state(S.PAUSED if self._paused else S.SERVING)
        await self._beat()
        self._tasks = [asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
                       asyncio.create_task(self._consume_loop(), name="consume"),
                       asyncio.create_task(self._cancel_loop(), name="cancel")]  # fmt: skip
        log.info("replica %s serving at %s", self.replica_id, self.address)

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop consuming, give in-flight work ``grace_s`` to finish, deregister. Routers see
        the replica draining at once (no new work), and the janitor moves whatever is still
        queued for it once it has deregistered."""
        self._set_state(S.DRAINING)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._lease:
            await self._beat()
        grace_s = min(grace_s, self.config.rollout.drain_timeout_s) if self.engine.is_alive() else 0
        await self._finish_or_cancel(grace_s)
        with contextlib.suppress(Exception):
            await self.registry.deregister(self.replica_id)
        log.info("replica %s deregistered", self.replica_id)

    async def generate_direct(self, request: GenerateRequest) -> GenerateResult:
        """Serve a Generate RPC; retried transparently if a weight update cancels it."""
        request.validate()
        while True:
            await self._wait_until_serving()
            task = self._track(lambda key: self._generate(request, key))
            try:
                result = await task
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise
                continue
            self.served += 1
            return result

    async def _generate(self, request: GenerateRequest, key: str) -> GenerateResult:
        prompt = request.prompt_token_ids or self.engine.encode(request.prompt_text or "")
        self._check_request(request, prompt)
        version = self.version
        completions = await self.engine.generate(key, prompt, request.sampling)
        self.generated_tokens += sum(len(c.token_ids) for c in completions)
        return GenerateResult(request.request_id, completions, version, self.replica_id, prompt)

    def _check_request(self, request: GenerateRequest, prompt: list[int]) -> None:
        self.engine.check_prompt(prompt, request.sampling.max_tokens)
        if request.min_weight_version > self.version:
            raise FailedPrecondition(f"needs weight version >= {request.min_weight_version}, "
                                     f"replica has {self.version}")  # fmt: skip

    def _track(
        self, make: Callable[[str], Awaitable[object]], job: Job | None = None
    ) -> asyncio.Task:
        """Run ``make(engine_request_id)`` as a task that updates and shutdown can find."""
        key = f"{self.replica_id}-{next(self._ids)}"
        task = asyncio.create_task(make(key))
        self._running[key] = task
        if job is not None:
            self._jobs[key] = job
        task.add_done_callback(lambda _: self._untrack(key))
        return task

    def _untrack(self, key: str) -> None:
        self._running.pop(key, None)
        self._jobs.pop(key, None)
        self._aborted.discard(key)

    async def _cancel_loop(self) -> None:
        """Cancel the jobs whose callers all gave up (the engine aborts them); parked ones
        are dropped unanswered. One round trip per poll for both."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            held, parked = dict(self._jobs), [job for _, job in self._parked]
            if not held and not parked:
                continue
            try:
                gone = {id(job) for job in await self.queue.cancelled([*held.values(), *parked])}
            except Exception as exc:  # noqa: BLE001 - Redis hiccups must not kill the loop
                log.warning("checking for cancelled requests failed: %s", exc)
                continue
            for key, job in held.items():
                if id(job) in gone and (task := self._running.get(key)) is not None:
                    self._aborted.add(key)
                    task.cancel()
            await self._drop_parked([job for job in parked if id(job) in gone])

    async def _drop_parked(self, abandoned: list[Job]) -> None:
        for job in abandoned:
            log.info("parked request %s dropped: its callers gave up", job.request_id)
            await self._with_retries(job.request_id, lambda job=job: self.queue.discard(job))
        dropped = {id(job) for job in abandoned}
        self._parked = [(n, job) for n, job in self._parked if id(job) not in dropped]

    async def _consume_loop(self) -> None:
        while True:
            await self._serving.wait()
            free = self.config.rollout.max_concurrency - len(self._running)
            if free <= 0:
                await self._wait_changed(0.05)
                continue
            retries = [self._retry.popleft() for _ in range(min(free, len(self._retry)))]
            jobs = retries or await self._read(free)
            for job in jobs:
                if (needed := _needed_version(job)) > self.version:
                    self._park(job, needed)
                elif self._serving.is_set():
                    self._track(lambda key, job=job: self._run_job(job, key), job)
                else:
                    self._retry.append(job)  # read just as an update began: run it after

    def _park(self, job: Job, needed: int) -> None:
        log.info("request %s needs weights v%d (serving v%d): parked until they arrive",
                 job.request_id, needed, self.version)  # fmt: skip
        self._parked.append((needed, job))

    def _unpark(self) -> None:
        """Queue for running the parked jobs the current weights can serve."""
        ready = [job for needed, job in self._parked if needed <= self.version]
        self._parked = [(n, job) for n, job in self._parked if n > self.version]
        self._retry.extend(ready)

    async def _read(self, count: int) -> list[Job]:
        try:
            return await self.queue.read(self.replica_id, count=count, block_ms=READ_BLOCK_MS)
        except Exception as exc:  # noqa: BLE001 - Redis hiccups must not kill the loop
            log.warning("reading %s failed (%s); retrying in 1 s", self.queue.stream, exc)
            await asyncio.sleep(1.0)
            return []

    async def _run_job(self, job: Job, key: str) -> None:
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
            result = await self._generate(request, key)
        except asyncio.CancelledError:
            if key in self._aborted:  # its callers gave up: aborted, dropped unanswered
                log.info("request %s aborted: its callers gave up", job.request_id)
                await self._with_retries(job.request_id, lambda: self.queue.discard(job))
            elif self._lease:
                self._retry.append(job)  # an update (or shutdown) cancelled it: still unacked
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
            if self._lease:
                self._retry.append(job)  # as a single job: the entry stays unacked, re-run whole
            return
        if not self.engine.is_alive():
            return  # not the requests' fault: leave the entry for whoever takes over
        if await self._answer_packed(job, members, answers) is Finish.STORED:
            self.served += sum(failure is None for _, failure in answers)

    async def _member_answer(self, request: GenerateRequest, key: str) -> _Answer:
        """A member's packed result, or why it failed (its own fault, not its neighbours')."""
        try:
            request.validate()
            return (await self._generate(request, key)).encode(), None
        except Exception as exc:  # noqa: BLE001 - this member's waiter gets the reason
            if self.engine.is_alive():
                log.warning("request %s failed: %s", request.request_id, exc)
            return b"", Failure.of(exc)

    async def _answer_packed(
        self, job: Job, members: list[GenerateRequest], answers: list[_Answer]
    ) -> Finish | None:
        """Members' answers and the entry's in one fenced step (the first answer per id wins);
        the entry's completion wakes the router, which then reads the members' answers."""
        mine = {request.request_id: encode_result(payload, failure)
                for request, (payload, failure) in zip(members, answers, strict=True)}  # fmt: skip
        return await self._finish(job, encode_result(b""), mine)

    async def _complete(self, job: Job, payload: bytes, error: Failure | None) -> Finish | None:
        return await self._finish(job, encode_result(payload, error))

    async def _finish(
        self, job: Job, answer: bytes, members: dict[str, bytes] | None = None
    ) -> Finish | None:
        """Store an answer through the fence; a discarded one is counted and logged."""
        outcome = await self._with_retries(job.request_id,
                                           lambda: self.queue.finish(job, answer, members))  # fmt: skip
        if outcome in (Finish.FENCED, Finish.GONE):
            self.discarded += 1
            why = "our lease lapsed" if outcome is Finish.FENCED else "it was moved away"
            log.warning("discarded the answer to %s: %s", job.request_id, why)
        return outcome

    async def _with_retries(self, request_id: str, answer: Callable[[], Awaitable[T]]) -> T | None:
        for attempt in range(3):
            try:
                return await answer()
            except Exception as exc:  # noqa: BLE001
                log.warning("completing %s failed (%s), attempt %d", request_id, exc, attempt)
                await asyncio.sleep(0.5 * (attempt + 1))
        log.error("could not answer %s; its entry stays pending for recovery", request_id)
        return None

    def check_update(self, header: weights.WeightHeader) -> None:
        """Refuse an update before its bytes arrive: a malformed header (InvalidArgument), a
        version not newer than ours unless forced (FailedPrecondition), or a payload bigger
        than this model can take (InvalidArgument; checked before anything is allocated)."""
        weights.validate_header(header)
        if header.version <= self.version and not header.force:
            raise FailedPrecondition(f"weight version {header.version} is not newer than "
                                     f"{self.version} (set force to roll back)")  # fmt: skip
        numel = self.engine.weight_numel()
        if numel and header.total_bytes > weights.max_bytes_for(numel):
            raise InvalidArgument(f"weight update of {header.total_bytes} bytes is larger than "
                                  f"this model ({numel} parameters) can take")  # fmt: skip

    async def update_weights(
        self, header: weights.WeightHeader, payload: weights.BytesLike
    ) -> UpdateOutcome:
        """Verify while still serving (checksum, finite values), then drain, load in one step,
        flush, bump the version. A refused update changes nothing; a load that fails midway
        leaves the replica UPDATE_FAILED (out of routing) until an update succeeds."""
        async with self._update_lock:
            self.check_update(header)  # again: another update may have landed meanwhile
            state_dict = await asyncio.to_thread(_verified, header, payload)
            if self.state not in (S.SERVING, S.PAUSED, S.UPDATE_FAILED):
                raise Unavailable(f"replica {self.replica_id} is {self.state}")
            self._set_state(S.UPDATING)
            await self._beat()
            try:
                return await self._load(header, state_dict)
            finally:
                self._set_state(self._resting_state())
                await self._beat()

    def _resting_state(self) -> ReplicaState:
        """Where an update ends: failed weights take no work, whatever pause asked for."""
        if not self._weights_intact:
            return S.UPDATE_FAILED
        return S.PAUSED if self._paused else S.SERVING

    async def _load(self, header: weights.WeightHeader, state_dict: dict) -> UpdateOutcome:
        await self._finish_or_cancel(self.config.rollout.drain_timeout_s)
        started = time.perf_counter()
        intact, self._weights_intact = self._weights_intact, False
        try:
            await self.engine.load_weights(state_dict)
        except InvalidArgument:
            self._weights_intact = intact  # engines refuse a mismatch before changing anything
            raise
        old, self.version, self._weights_intact = self.version, header.version, True
        self._unpark()
        flushed = False
        if header.flush_cache and self.config.rollout.flush_cache_on_update:
            flushed = await self.engine.flush_cache()
        seconds = time.perf_counter() - started
        log.info("weights v%d -> v%d loaded in %.3f s (cache flushed: %s)",
                 old, self.version, seconds, flushed)  # fmt: skip
        return UpdateOutcome(self.version, seconds, flushed)

    async def _finish_or_cancel(self, timeout_s: float) -> None:
        """Wait for in-flight requests, then cancel the rest (engines abort cancelled requests:
        vLLM's ``generate`` does on cancellation, the hf engine stops their rows)."""
        if tasks := list(self._running.values()):
            await asyncio.wait(tasks, timeout=timeout_s)
        stragglers = {key: task for key, task in self._running.items() if not task.done()}
        for task in stragglers.values():
            task.cancel()
        await asyncio.gather(*stragglers.values(), return_exceptions=True)
        if stragglers:
            log.info("cancelled %d in-flight requests; queued ones will re-run", len(stragglers))

    async def flush_cache(self) -> bool:
        return await self.engine.flush_cache()

    async def pause(self) -> ReplicaStatus:
        """Stop taking new work (in-flight requests finish); direct calls get Unavailable."""
        return await self._set_paused(True, S.SERVING, S.PAUSED)

    async def resume(self) -> ReplicaStatus:
        return await self._set_paused(False, S.PAUSED, S.SERVING)

    async def _set_paused(
        self, paused: bool, from_state: ReplicaState, to_state: ReplicaState
    ) -> ReplicaStatus:
        self._paused = paused  # an update in progress ends in the state this asks for
        if self.state == from_state:
            self._set_state(to_state)
            await self._beat()
        return self.status()

    def status(self) -> ReplicaStatus:
        age = time.time() - self._last_beat if self._last_beat else -1.0
        return ReplicaStatus(self.replica_id, self.address, self.version, self.state,
                             len(self._running), self.engine.name, self.served, age)  # fmt: skip

    def _set_state(self, state: ReplicaState) -> None:
        self.state = state
        (self._serving.set if state is S.SERVING else self._serving.clear)()
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_changed(self, timeout_s: float | None = None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    async def _wait_until_serving(self) -> None:
        """Direct calls wait out an update; paused, starting or draining replicas refuse."""
        while self.state is not S.SERVING:
            if self.state is not S.UPDATING:
                raise Unavailable(f"replica {self.replica_id} is {self.state}")
            await self._wait_changed()

    async def _heartbeat_loop(self) -> None:
        while self.engine.is_alive():
            await asyncio.sleep(self.config.rollout.heartbeat_interval_s)
            await self._beat()
            await self._check_drained()
        log.error("%s engine died; %s stops heartbeating", self.engine.name, self.replica_id)
        self.failed.set()

    async def _check_drained(self) -> None:
        """Drained by a router (``DrainReplica``): keep answering what is queued here, and
        once nothing is left (running, to retry, or in our stream) set ``drained`` so the
        process deregisters and exits 0."""
        if self.drained.is_set() or self._running or self._retry or self._parked:
            return
        try:
            if not await self.registry.is_draining(self.replica_id) or await self.queue.length():
                return
        except Exception as exc:  # noqa: BLE001 - checked again at the next beat
            log.warning("checking whether %s is drained failed: %s", self.replica_id, exc)
            return
        log.info("replica %s is drained and has no work left: exiting", self.replica_id)
        self.drained.set()

    async def _beat(self) -> None:
        """Renew our lease with the whole entry; if it lapsed, drop the jobs we held and
        register again under a new lease (re-adding the entry if a janitor removed it)."""
        info = ReplicaInfo(self.replica_id, self.address, self.version, self.state,
                           self.engine.name, self.served)  # fmt: skip
        try:
            if not self._lease or not await self.registry.renew(info, self._lease):
                await self._relet(info)
            self._last_beat = time.time()
        except Exception as exc:  # noqa: BLE001 - a missed beat is retried next interval
            log.warning("heartbeat for %s failed: %s", self.replica_id, exc)

    async def _relet(self, info: ReplicaInfo) -> None:
        """Take a new lease. After a lapse (not at start): our work may have moved, so the jobs
        we hold are cancelled (their answers would be fenced anyway) and forgotten, and the
        next read starts again with whatever of our stream is still pending for us."""
        if self._lease:
            log.warning("replica %s lost its lease (no heartbeat for %.1f s): dropping %d jobs "
                        "and registering again", self.replica_id, time.time() - self._last_beat,
                        len(self._jobs))  # fmt: skip
            self._lease = ""  # cancelled jobs are not queued for a retry
            held = [self._running[key] for key in list(self._jobs) if key in self._running]
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            self._retry.clear()
            self._parked.clear()
            self.queue.replay(self.replica_id)
        lease = uuid.uuid4().hex
        self.queue.fence = (self.registry.lease_key(self.replica_id), lease)
        await self.registry.register(info, lease)
        self._lease = lease


def _needed_version(job: Job) -> int:
    """The weight version a queue entry needs; 0 when unreadable (``_run_job`` answers it)."""
    try:
        return entry_demand(job.payload)[0]
    except (ValueError, TypeError, AttributeError):
        return 0


def _verified(header: weights.WeightHeader, payload: weights.BytesLike) -> dict:
    """Tensors viewing the payload once size, checksum and finiteness hold (a worker thread)."""
    state_dict = weights.decode(header, payload)
    weights.check_finite(state_dict)
    return state_dict
