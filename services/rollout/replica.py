"""One rollout replica: an engine, its Redis request stream, its registry entry, weight updates.
No gRPC here: ``server.py`` converts protos to the plain objects this class takes.

``Replica`` assembles parts that each have one job, and runs the steps that span them
(start, shutdown, a weight update, pause):

- ``phase.Phase``: the state (starting, serving, paused, updating, ...) and waits on it;
- ``inflight.InFlight``: the requests running now, one task each, to finish or cancel;
- ``job_loop.JobLoop`` and ``HeldJobs``: when queued jobs run (read, park, retry, cancel);
- ``job_runner.JobRunner``: running a request or a queue job and storing its answer;
- ``weight_updates.WeightUpdater``: the version served, and checking and loading updates;
- ``update_steps.UpdateSteps``: one update's order (verify and stage while serving, then a
  short pause for the swap) and the pause's length;
- ``lease.Lease``: the registry entry, the heartbeat lease that fences answers, and the
  ends of the process (engine died, drained).

What the replica does, whichever part does it:

- Work arrives on the replica's own stream (the router picks the replica). A restarted
  replica with the same id first re-reads its own never-acknowledged entries, so nothing
  queued is lost. Direct ``Generate`` calls run beside queued work.
- A weight update stops new work, lets in-flight requests finish for up to
  ``rollout.drain_timeout_s``, then cancels the rest. Cancelled queue jobs stay unacknowledged
  in Redis (a crash now loses nothing) and are run again here once the new weights are in;
  cancelled direct calls are retried the same way. That is ``rollout.update_policy: restart``;
  ``finish`` waits for every request, and ``keep`` stops them where they are and continues
  them under the new weights (docs/in_flight_updates.md). Every token carries the version
  that sampled it; an answer reports the oldest. A refused update changes nothing; versions
  only go up unless the header says ``force``.
- An entry that needs newer weights than ours (a replica restarted under its id comes back at
  version 0 and re-reads entries queued for the weights it had) is parked until an update
  brings that version.
- If the engine dies, the replica stops heartbeating and exits; its unanswered entries stay in
  its stream for the router's janitor to move (they are not answered with errors). A replica
  whose lease lapsed (stalled past ``heartbeat_ttl_s``) has its late answers discarded.
- Callers that give up (a router's timeout or cancellation, with nobody else waiting) mark the
  submission cancelled; such jobs are aborted in the engine and dropped unanswered (a retry
  under the same id is queued afresh).
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import FailedPrecondition, Unavailable
from rlfleet.common.keys import ROLLOUT_GROUP, Keys
from rlfleet.common.queue.workqueue import Job, WorkQueue
from rlfleet.model import weights
from rlfleet.rollout.engines.base import Engine
from rlfleet.rollout.heartbeat import HeartbeatThread
from rlfleet.rollout.inflight import InFlight
from rlfleet.rollout.job_loop import HeldJobs, JobLoop
from rlfleet.rollout.job_runner import JobRunner
from rlfleet.rollout.lease import Lease
from rlfleet.rollout.phase import Phase
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.types import (
    GenerateRequest,
    GenerateResult,
    ReplicaState,
    ReplicaStatus,
    ScoreRequest,
    TokenScores,
    UpdateOutcome,
)
from rlfleet.rollout.update_steps import UpdateSteps
from rlfleet.rollout.weight_updates import WeightUpdater

log = logging.getLogger(__name__)

GROUP = ROLLOUT_GROUP
S = ReplicaState


class Replica:
    """The replica core; see the module docstring."""

    def __init__(
        self,
        config: RlfleetConfig,
        engine: Engine,
        redis: Redis,
        keys: Keys,
        replica_id: str,
        address: str,
    ) -> None:
        self.config, self.engine, self.keys = config, engine, keys
        self.replica_id, self.address = replica_id, address
        self.registry = ReplicaRegistry(redis, keys, config.rollout.heartbeat_ttl_s)
        self.queue = WorkQueue(redis, keys, keys.rollout_stream(replica_id), GROUP)
        self.phase = Phase(replica_id)
        self.inflight = InFlight(replica_id)
        self.held_jobs = HeldJobs()
        self.weights = WeightUpdater(config, engine, self.held_jobs.unpark)
        rollout = config.rollout
        pulse = HeartbeatThread(
            redis,
            keys,
            rollout.heartbeat_ttl_s,
            rollout.heartbeat_interval_s,
            rollout.loop_stall_s,
            self._info,
        )
        self.lease = Lease(
            self.registry, self.queue, replica_id, self.inflight, self.held_jobs, self._info, pulse
        )
        self.runner = JobRunner(
            config, engine, self.queue, replica_id, self.inflight, self._version, self._requeue
        )
        self.jobs = JobLoop(
            config,
            self.queue,
            replica_id,
            self.phase,
            self.inflight,
            self.held_jobs,
            self.runner,
            self._version,
        )
        self.updates = UpdateSteps(config, self.weights, self.phase, self.inflight, self.lease.beat)
        self.failed = self.lease.failed  # the engine died: stop, let the heartbeat TTL lapse
        self.drained = self.lease.drained  # a router drained us and our work is done: exit
        self._tasks: list[asyncio.Task] = []

    @property
    def version(self) -> int:
        """The weight version served."""
        return self.weights.version

    @property
    def state(self) -> ReplicaState:
        return self.phase.state

    @property
    def served(self) -> int:
        """Requests answered so far."""
        return self.runner.served

    @property
    def generated_tokens(self) -> int:
        """Completion tokens generated so far (metrics: tokens/s)."""
        return self.runner.generated_tokens

    @property
    def discarded(self) -> int:
        """Answers dropped by the fence (lease lapsed, or job moved away)."""
        return self.runner.discarded

    async def start(self) -> None:
        """Register as starting, start the engine, then serve and consume."""
        await self.lease.beat()
        started = time.perf_counter()
        await self.engine.start()
        engine_s = time.perf_counter() - started
        await self.queue.ensure_group()
        self.phase.set(S.PAUSED if self.phase.paused else S.SERVING)
        await self.lease.beat()
        beats = self.lease.run(self.engine, self.config.rollout.heartbeat_interval_s)
        self._tasks = [
            asyncio.create_task(beats, name="heartbeat"),
            asyncio.create_task(self.jobs.consume(), name="consume"),
            asyncio.create_task(self.jobs.watch_cancelled(), name="cancel"),
        ]
        log.info(
            "replica %s serving at %s (%s engine started in %.1f s)",
            self.replica_id,
            self.address,
            self.engine.name,
            engine_s,
        )

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop consuming, give in-flight work ``grace_s`` to finish, deregister. Routers see
        the replica draining at once (no new work), and the janitor moves whatever is still
        queued for it once it has deregistered."""
        self.phase.set(S.DRAINING)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.lease.held:
            await self.lease.beat()
        grace_s = min(grace_s, self.config.rollout.drain_timeout_s) if self.engine.is_alive() else 0
        await self.inflight.finish_or_cancel(grace_s)
        await self.lease.leave()
        log.info("replica %s deregistered", self.replica_id)

    async def generate_direct(self, request: GenerateRequest) -> GenerateResult:
        """Serve a Generate RPC; retried transparently if a weight update cancels it."""
        request.validate()
        while True:
            await self.phase.wait_until_serving()
            task = self.inflight.track(lambda key: self.runner.generate(request, key))
            try:
                result = await task
            except asyncio.CancelledError:
                if (me := asyncio.current_task()) is not None and me.cancelling():
                    raise
                continue
            self.runner.served += 1
            return result

    def check_update(self, header: weights.WeightHeader) -> None:
        """Refuse an update before its bytes arrive (``WeightUpdater.check``)."""
        self.weights.check(header)

    async def update_weights(
        self, header: weights.WeightHeader, payload: weights.BytesLike
    ) -> UpdateOutcome:
        """Verify and stage while still serving (checksum, finite values, magnitude, a delta
        made whole), then close admission only to make way, swap, flush and bump the version
        (``update_steps``). A refused update changes nothing; a swap that fails midway leaves
        the replica UPDATE_FAILED (out of routing) until an update succeeds."""
        return await self.updates.run(header, payload)

    async def flush_cache(self) -> bool:
        return await self.engine.flush_cache()

    async def score_tokens(self, request: ScoreRequest) -> TokenScores:
        """Teacher-forced log-probs of the request's targets under the weights served now
        (``types.ScoreRequest``); no update swaps weights meanwhile, so the version is the one that
        scored. FailedPrecondition when we serve an older version than asked for."""
        request.validate()
        if self.state is S.STARTING:
            raise Unavailable(f"replica {self.replica_id} is {self.state}")
        for seq in request.sequences:  # room for one token: vLLM scores by generating one
            self.engine.check_prompt(seq.prompt_token_ids + seq.target_token_ids, 1)
        async with self.weights.lock:
            if self.version < request.min_weight_version:
                raise FailedPrecondition(
                    f"replica {self.replica_id} serves weight version {self.version}, "
                    f"older than {request.min_weight_version}"
                )
            rows = [
                await self.engine.score_tokens(s.prompt_token_ids, s.target_token_ids)
                for s in request.sequences
            ]
            return TokenScores(rows, self.version, self.replica_id)

    async def pause(self) -> ReplicaStatus:
        """Stop taking new work (in-flight requests finish); direct calls get Unavailable."""
        return await self._set_paused(True, S.SERVING, S.PAUSED)

    async def resume(self) -> ReplicaStatus:
        return await self._set_paused(False, S.PAUSED, S.SERVING)

    async def _set_paused(
        self, paused: bool, from_state: ReplicaState, to_state: ReplicaState
    ) -> ReplicaStatus:
        if self.phase.ask_paused(paused, from_state, to_state):
            await self.lease.beat()
        return self.status()

    def status(self) -> ReplicaStatus:
        last_beat = self.lease.last_beat
        age = time.time() - last_beat if last_beat else -1.0
        return ReplicaStatus(
            self.replica_id,
            self.address,
            self.version,
            self.state,
            len(self.inflight),
            self.engine.name,
            self.served,
            age,
        )

    def _info(self) -> ReplicaInfo:
        """Our registry entry as of now (the lease writes it at every beat)."""
        return ReplicaInfo(
            self.replica_id, self.address, self.version, self.state, self.engine.name, self.served
        )

    def _version(self) -> int:
        return self.weights.version

    def _requeue(self, job: Job) -> None:
        """A job cancelled by an update or shutdown runs again here, unless our lease has
        lapsed (the jobs we held are then forgotten and read again: ``lease.py``)."""
        if self.lease.held:
            self.held_jobs.retry(job)
