"""The one work queue behind rollout, reward and refcritic: Redis Streams with consumer groups.

Why streams: an entry stays pending until a worker acks it, so a worker dying mid-job loses
nothing, and ``XAUTOCLAIM`` lets a live worker take it over. An entry delivered more than
``max_deliveries`` times is poison: it goes to a dead-letter stream and its request gets an
error answer, so a bad input cannot crash workers forever nor leave a waiter hanging.
Answers are stored with ``SET NX`` under ``Keys.result(request_id)``: the first answer wins, so
a retried request is answered once. Completed entries are acked *and* deleted, so a stream
holds only outstanding work, which ``move_to`` can hand from a dead replica to a live one.

Request ids are idempotency keys: unique within a cluster for ``result_ttl_s``. The Redis
client must not decode responses (payloads are bytes); its socket timeout, if any, must exceed
``poll_s`` and ``block_ms``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from rlfleet.common.errors import ErrorCode
from rlfleet.common.keys import Keys
from rlfleet.common.results import Failure, Result, decode_result, encode_result

log = logging.getLogger(__name__)

ANSWER_MIN_BYTES = len(encode_result(b""))  # an encoded answer is never shorter
NOTIFY_TTL_S = 60  # only waiters blocked right now need the token; later ones read the result
_BATCH = 500

_SUBMIT_LUA = """if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'payload', ARGV[2], 'prior', ARGV[3], 'n', ARGV[4])
return 1"""

# A request id bound to its content (KEYS[3] holds the fingerprint, ARGV[4]): -1 when the id
# is bound to other content, 0 when answered, 2 when queued already (its first execution is
# alive), 1 when bound and queued now. ``sub`` tags this submission (see ``cancel_marker``).
_SUBMIT_BOUND_LUA = """local bound = redis.call('GET', KEYS[3])
if bound and string.sub(bound, 1, #ARGV[4] + 1) ~= ARGV[4] .. ' ' then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if bound then return 2 end
redis.call('SET', KEYS[3], ARGV[4] .. ' ' .. ARGV[7], 'EX', ARGV[5])
redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'payload', ARGV[2], 'prior', '0',
           'n', ARGV[6], 'sub', ARGV[7])
return 1"""

# Lua prelude of the scripts below: delete a request's binding and mark the submission it names
# cancelled for ``ttl`` s; 0 when there was no binding.
_FORGET_BINDING_LUA = """local function forget_binding(binding, mark, ttl)
  local bound = redis.call('GET', binding)
  if not bound then return 0 end
  redis.call('DEL', binding)
  local submission = string.match(bound, ' (.*)$')
  if submission then redis.call('SET', mark, submission, 'EX', ttl) end
  return 1
end
"""

# Forget an unanswered request's binding (KEYS[1]) and mark the submission it names cancelled
# (KEYS[2], for ARGV[1] s); nothing once it is answered (KEYS[3]): the binding must outlive it.
_UNBIND_LUA = (
    _FORGET_BINDING_LUA
    + """if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
return forget_binding(KEYS[1], KEYS[2], ARGV[1])"""
)

# Move one entry (KEYS[1] -> KEYS[2]) as one step: it is in exactly one stream at any instant,
# so a mover dying anywhere loses nothing and a second mover cannot copy it twice. An entry
# gone already (answered, or moved by another) is left alone (0); an answered one still
# queued is dropped (2). ARGV: group, entry id, deliveries so far.
_MOVE_LUA = """local found = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if #found == 0 then return 0 end
redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if redis.call('EXISTS', KEYS[3]) == 1 then return 2 end
local fields, out = found[1][2], {}
for i = 1, #fields, 2 do
  if fields[i] ~= 'prior' then out[#out + 1] = fields[i]; out[#out + 1] = fields[i + 1] end
end
out[#out + 1] = 'prior'; out[#out + 1] = ARGV[3]
redis.call('XADD', KEYS[2], '*', unpack(out))
return 1"""

# Answer a job in one step. KEYS: stream, fence key, dead stream, result, notify, waiters, then
# member result keys. ARGV: group, entry id, fence token ('' = none), ttl, notify ttl, '1' to
# require the entry still queued, k, k dead-letter fields (k = 0: none), the answer, member
# answers. -1: fenced (the lease is not ours), -2: entry gone (moved away), else 1 if ours was
# the first answer, 0 if one existed already. The wake-up carries the stored answer, one copy
# per counted waiter (``Keys.waiters``; at least one), so a waiter needs no GET after it.
_FINISH_LUA = """local got = redis.call('MGET', KEYS[2], KEYS[6])
if ARGV[3] ~= '' and got[1] ~= ARGV[3] then return -1 end
if redis.call('XDEL', KEYS[1], ARGV[2]) == 0 and ARGV[6] == '1' then return -2 end
local k = tonumber(ARGV[7])
local answer, first = ARGV[8 + k], 1
if not redis.call('SET', KEYS[4], answer, 'NX', 'EX', ARGV[4]) then
  first, answer = 0, redis.call('GET', KEYS[4])
end
for i = 7, #KEYS do redis.call('SET', KEYS[i], ARGV[2 + k + i], 'NX', 'EX', ARGV[4]) end
local copies = {}
for i = 1, math.min(1000, math.max(1, tonumber(got[2]) or 1)) do copies[i] = answer end
redis.call('RPUSH', KEYS[5], unpack(copies))
redis.call('EXPIRE', KEYS[5], ARGV[5])
redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
if k > 0 then redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', unpack(ARGV, 8, 7 + k)) end
return first"""

# A counted waiter (``Keys.waiters``; absent = only the submitter) gives up: the last one out
# of an unanswered request forgets its binding and marks its submission cancelled (as
# ``_UNBIND_LUA``). KEYS: waiters, binding, cancel mark, result; ARGV: mark ttl.
_LEAVE_LUA = (
    _FORGET_BINDING_LUA
    + """local left = 0
if redis.call('EXISTS', KEYS[1]) == 1 then left = redis.call('DECR', KEYS[1]) end
if left > 0 or redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
redis.call('DEL', KEYS[1])
return forget_binding(KEYS[2], KEYS[3], ARGV[1])"""
)

# Requests waiting in a stream (an entry's ``n``, 1 when absent), stored as KEYS[2][ARGV[1]].
_RECOUNT_LUA = """local total, start = 0, '-'
while true do
  local batch = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 1000)
  if #batch == 0 then break end
  for _, entry in ipairs(batch) do
    local n, fields = 1, entry[2]
    for i = 1, #fields, 2 do if fields[i] == 'n' then n = tonumber(fields[i + 1]) or 1 end end
    total = total + n
  end
  start = '(' .. batch[#batch][1]
end
if total > 0 then redis.call('HSET', KEYS[2], ARGV[1], total)
else redis.call('HDEL', KEYS[2], ARGV[1]) end
return total"""


class Finish(enum.IntEnum):
    """What became of an answer (``WorkQueue.finish``)."""

    FENCED = -1  # the consumer's lease lapsed: discarded, the entry is left to whoever owns it
    GONE = -2  # the entry left the stream (moved to another consumer): discarded
    DUPLICATE = 0  # the request had an answer already (ack'd and deleted all the same)
    STORED = 1  # this is the answer


class Bound(enum.IntEnum):
    """What ``submit_bound`` did with a request."""

    CONFLICT = -1  # the id is bound to other content
    ANSWERED = 0  # the id has an answer already
    QUEUED = 1  # queued now
    JOINED = 2  # queued before (its first execution is alive): wait for its answer


@dataclass(frozen=True)
class Job:
    """One delivery of a request to a consumer; ``deliveries`` counts this one too (for a
    job taken out by ``drain_jobs``: the deliveries so far, 0 if it was never read)."""

    entry_id: str
    request_id: str
    payload: bytes
    deliveries: int
    weight: int = 1
    """Requests the entry holds (a packed entry holds several; counted as in flight)."""
    submission: str = ""
    """Tag of the submission that queued it (``submit_bound``); travels with moves."""


class WorkQueue:
    """Producer and consumer side of one stream, read by one consumer group."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        stream: str,
        group: str,
        max_deliveries: int = 3,
        result_ttl_s: int = 3600,
        poll_s: float = 0.5,
    ) -> None:
        if redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("WorkQueue needs a Redis client with decode_responses=False")
        if max_deliveries < 1 or result_ttl_s < 1 or poll_s <= 0:
            raise ValueError("max_deliveries, result_ttl_s and poll_s must be positive")
        self._redis, self.keys, self.stream, self.group = redis, keys, stream, group
        self.max_deliveries, self.result_ttl_s, self.poll_s = max_deliveries, result_ttl_s, poll_s
        self.dead_stream = keys.dead_letter(stream)
        self._submit_script = redis.register_script(_SUBMIT_LUA)
        self._submit_bound_script = redis.register_script(_SUBMIT_BOUND_LUA)
        self._move_script = redis.register_script(_MOVE_LUA)
        self._unbind_script = redis.register_script(_UNBIND_LUA)
        self._finish_script = redis.register_script(_FINISH_LUA)
        self._leave_script = redis.register_script(_LEAVE_LUA)
        self._recount_script = redis.register_script(_RECOUNT_LUA)
        self.fence: tuple[str, str] | None = None
        """(key, token): answers are stored only while ``key`` holds ``token`` (a consumer's
        lease) and the job's entry is still in this stream; else they are discarded."""
        self._replay_from: dict[str, str | None] = {}  # consumer -> own-pending cursor, None=done
        self._claim_cursor = "0-0"
        self._notify_ttl_s = min(NOTIFY_TTL_S, result_ttl_s)

    async def ensure_group(self) -> None:
        """Create the group (and stream); from id 0 so entries queued before it are served."""
        try:
            await self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def submit(
        self, request_id: str, payload: bytes, prior_deliveries: int = 0, weight: int = 1
    ) -> bool:
        """Queue a request; False (and nothing queued) when it has been answered already.
        ``weight``: how many requests the entry holds (``recount``).

        Check and add are one Lua script, so a retry can never be queued after its answer."""
        keys = [self.stream, self.keys.result(request_id)]
        args = [request_id, payload, prior_deliveries, weight]
        return bool(await self._submit_script(keys=keys, args=args))

    async def submit_bound(
        self, request_id: str, payload: bytes, fingerprint: str, submission: str, weight: int = 1
    ) -> Bound:
        """Queue a request unless its id is known: the id is bound to ``fingerprint`` (its
        content) for ``result_ttl_s``, so the same id is queued once while it is outstanding
        or answered, and other content under it is refused (``Bound.CONFLICT``)."""
        keys = [self.stream, self.keys.result(request_id), self.keys.request(request_id)]
        args = [request_id, payload, 0, fingerprint, self.result_ttl_s, weight, submission]
        return Bound(int(await self._submit_bound_script(keys=keys, args=args)))

    async def unbind(self, request_id: str, marker_ttl_s: int = 600) -> bool:
        """Give up on an unanswered bound request nobody waits for any more: forget the
        binding (a retry queues it afresh) and mark its submission cancelled, for its consumer
        to abort (``cancelled``). True if there was one to give up on."""
        k = self.keys
        keys = [k.request(request_id), k.cancel(request_id), k.result(request_id)]
        return bool(await self._unbind_script(keys=keys, args=[marker_ttl_s]))

    async def leave(self, request_id: str, marker_ttl_s: int = 600) -> bool:
        """A counted waiter (see ``wait_answer``) gives up without an answer; the last one out
        gives the request up as ``unbind`` does. True if it was given up."""
        k = self.keys
        keys = [k.waiters(request_id), k.request(request_id), k.cancel(request_id),
                k.result(request_id)]  # fmt: skip
        return bool(await self._leave_script(keys=keys, args=[marker_ttl_s]))

    async def bound_to(self, request_id: str) -> str | None:
        """The fingerprint a request id is bound to, if any."""
        raw = await self._redis.get(self.keys.request(request_id))
        return None if raw is None else _text(raw).split(" ", 1)[0]

    async def cancelled(self, jobs: list[Job]) -> list[Job]:
        """The jobs whose submission was cancelled by ``unbind`` (one round trip)."""
        tagged = [job for job in jobs if job.submission]
        if not tagged:
            return []
        marks = await self._redis.mget([self.keys.cancel(job.request_id) for job in tagged])
        return [job for job, mark in zip(tagged, marks, strict=True)
                if mark is not None and _text(mark) == job.submission]  # fmt: skip

    async def get_result(self, request_id: str) -> Result | None:
        raw = await self._redis.get(self.keys.result(request_id))
        return None if raw is None else decode_result(request_id, raw)

    async def get_results(self, request_ids: list[str]) -> dict[str, Result]:
        """The answers stored so far for ``request_ids`` (one MGET); absent: none yet."""
        if not request_ids:
            return {}
        raws = await self._redis.mget([self.keys.result(rid) for rid in request_ids])
        pairs = zip(request_ids, raws, strict=True)
        return {rid: decode_result(rid, raw) for rid, raw in pairs if raw is not None}

    async def wait_any(self, request_ids: list[str], timeout_s: float) -> bool:
        """Block until one of ``request_ids`` is answered (True) or ``timeout_s`` passes: one
        BLPOP on all their wake-up lists, so waiting for many answers holds one connection.
        For ids only this caller waits on: the popped token is not passed on."""
        timeout = max(0.01, timeout_s)  # BLPOP 0 would block forever
        notify = [self.keys.notify(rid) for rid in request_ids]
        return bool(notify) and bool(await self._redis.blpop(notify, timeout=timeout))

    async def wait_result(self, request_id: str, timeout_s: float) -> Result | None:
        """The answer, or None after ``timeout_s``.

        Blocks on the notify list for at most ``poll_s`` at a time and re-reads the result key
        in between, so a lost or stolen wake-up only delays a waiter, never strands it. A waiter
        woken by the token (which carries the answer) puts it back for the next one; a stale
        token is swallowed.
        """
        loop = asyncio.get_running_loop()
        deadline, notify, popped = loop.time() + timeout_s, self.keys.notify(request_id), None
        while (result := await self.get_result(request_id)) is None:
            if (remaining := deadline - loop.time()) <= 0:
                return None
            timeout = max(0.01, min(self.poll_s, remaining))  # BLPOP 0 would block forever
            if (popped := await self._redis.blpop([notify], timeout=timeout)) is not None:
                if (result := carried_answer(request_id, popped[1])) is not None:
                    break
        if popped is not None:
            await self._pass_token_on(notify, popped[1])
        return result

    async def wait_answer(
        self, request_id: str, timeout_s: float, poll_s: float = 1.0
    ) -> Result | None:
        """The answer for a *counted* waiter (``Keys.waiters``, or the submitter), or None
        after ``timeout_s``. Its completer pushed one copy of the answer per counted waiter,
        so this takes one and passes nothing on: one BLPOP in all, plus a GET when a wake-up
        carried no answer or ``poll_s`` passed (an answer stored another way, e.g. by a
        batch, or a wake-up that expired)."""
        loop = asyncio.get_running_loop()
        deadline, notify = loop.time() + timeout_s, [self.keys.notify(request_id)]
        while True:
            remaining = deadline - loop.time()
            popped = await self._redis.blpop(notify, timeout=max(0.01, min(poll_s, remaining)))
            if popped is not None and (result := carried_answer(request_id, popped[1])):
                return result
            if (result := await self.get_result(request_id)) is not None:
                return result
            if deadline - loop.time() <= 0:
                return None

    async def read(self, consumer: str, count: int = 1, block_ms: int = 1000) -> list[Job]:
        """Jobs for ``consumer``: first its own never-acked entries (a restart under the same
        name), once per WorkQueue object; then new entries, waiting up to ``block_ms``
        (``<= 0``: no wait). Over-delivered entries are dead-lettered instead of returned.
        """
        start = self._replay_from.get(consumer, "0")
        if start is not None:
            entries = await self._xread(consumer, start, count, block_ms=0)
            self._replay_from[consumer] = entries[-1][0] if entries else None
            if entries:
                return await self._to_jobs(entries, await self._counts(entries))
        return await self._to_jobs(await self._xread(consumer, ">", count, block_ms))

    def replay(self, consumer: str) -> None:
        """Have the next ``read`` for ``consumer`` start again with its own pending entries
        (after it dropped the jobs it held, e.g. on losing its lease)."""
        self._replay_from.pop(consumer, None)

    async def complete(self, job: Job, payload: bytes, failure: Failure | None = None) -> bool:
        """Answer a job (a payload, or why it failed) and drop it from the stream; True if this
        was the first answer."""
        return await self.finish(job, encode_result(payload, failure)) is Finish.STORED

    async def finish(
        self, job: Job, answer: bytes, members: dict[str, bytes] | None = None
    ) -> Finish:
        """Store an encoded answer (and ``members``: more request ids' encoded answers) and
        drop the job's entry, in one step; with a ``fence``, only if the lease is still ours
        and the entry still here (a job moved to another consumer is answered there)."""
        return Finish(await self._finish(job, answer, members=members or {}))

    async def touch(self, consumer: str, jobs: list[Job]) -> None:
        """Reset the idle time of ``consumer``'s jobs, so ``reclaim`` leaves them alone while it
        works on them. ``XCLAIM ... JUSTID`` does not count as a delivery (no dead-lettering)."""
        ids = [job.entry_id for job in jobs]
        await self._redis.xclaim(self.stream, self.group, consumer, 0, ids, justid=True)

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int = 10) -> list[Job]:
        """Take over entries other (likely dead) consumers have held for ``min_idle_ms``."""
        args = (self.stream, self.group, consumer, min_idle_ms, self._claim_cursor)
        reply = await self._group_call(lambda: self._redis.xautoclaim(*args, count=count))
        if not reply:
            return []
        self._claim_cursor = _text(reply[0])
        entries = [(_text(eid), fields) for eid, fields in reply[1]]
        return await self._to_jobs(entries, await self._counts(entries))

    async def pending_count(self) -> int:
        """Entries delivered to some consumer and not yet completed."""
        summary = await self._group_call(lambda: self._redis.xpending(self.stream, self.group))
        return int(summary["pending"]) if summary else 0

    async def length(self) -> int:
        """Outstanding entries, delivered or not (completed ones are deleted)."""
        return int(await self._redis.xlen(self.stream))

    async def forget(self, request_ids: list[str]) -> None:
        """Drop stored answers that their only reader has read (saves memory until the TTL)."""
        if request_ids:
            await self._redis.unlink(*[self.keys.result(rid) for rid in request_ids])

    async def ping(self) -> bool:
        """Whether Redis answers (a health check for the role holding the queue)."""
        return bool(await self._redis.ping())

    async def drain_jobs(self) -> list[Job]:
        """Take every outstanding entry (pending or unread) out of this stream, with its
        delivery count, so whoever re-queues it can pass that on as ``prior_deliveries``."""
        taken: list[Job] = []
        async for batch in self._batches():
            await self._remove(batch)
            taken.extend(batch)
        return taken

    async def move(self, job: Job, other: WorkQueue) -> bool:
        """Move one entry (as ``_batches`` read it) to ``other`` in one step; True if it went
        there (False: it left meanwhile, or had been answered and is just dropped)."""
        keys = [self.stream, other.stream, self.keys.result(job.request_id)]
        args = [self.group, job.entry_id, job.deliveries]
        return await self._move_script(keys=keys, args=args) == 1

    async def outstanding(self) -> AsyncIterator[list[Job]]:
        """Outstanding entries in id order, in batches; ``deliveries`` = so far (0: unread)."""
        async for batch in self._batches():
            yield batch

    async def recount(self, hash_key: str, field: str) -> int:
        """Store the number of requests waiting in this stream (entries' weights) as
        ``hash_key[field]`` (deleted at 0), in one step; returns it."""
        return int(await self._recount_script(keys=[self.stream, hash_key], args=[field]))

    async def discard(self, job: Job) -> None:
        """Drop a job unanswered (its caller gave up)."""
        await self._remove([job])

    async def trim(self) -> int:
        """Trim entries every consumer is done with (ids below the oldest pending and unread
        entry) from the stream's memory; returns how many went."""
        groups = await self._group_call(lambda: self._redis.xinfo_groups(self.stream))
        ours = [g for g in groups or [] if _text(g["name"]) == self.group]
        if not ours:
            return 0
        boundary = _after(_text(ours[0]["last-delivered-id"]))
        summary = await self._redis.xpending(self.stream, self.group)
        if summary and summary["pending"]:
            boundary = min(boundary, _text(summary["min"]), key=_id_key)
        return int(await self._redis.xtrim(self.stream, minid=boundary, approximate=False))

    async def drain_entries(self) -> list[tuple[str, bytes]]:
        """``drain_jobs`` as (request_id, payload) pairs."""
        return [(job.request_id, job.payload) for job in await self.drain_jobs()]

    async def move_to(self, other: WorkQueue) -> int:
        """Move outstanding work to ``other``; returns how many entries were queued there.

        Each entry moves in one step (``move``), so a crash mid-move neither loses nor
        duplicates work, and running it again finishes the job. Delivery counts travel with the entries, so a
        job that kills every replica it lands on still ends in the dead-letter stream.
        """
        if other.stream == self.stream:
            raise ValueError(f"cannot move {self.stream} onto itself")
        moved = 0
        async for batch in self._batches():
            for job in batch:
                moved += await self.move(job, other)
        log.info("moved %d entries from %s to %s", moved, self.stream, other.stream)
        return moved

    async def _xread(self, consumer: str, start: str, count: int, block_ms: int) -> list[_Entry]:
        block = block_ms if block_ms > 0 else None  # BLOCK 0 would mean "forever"
        streams = {self.stream: start}
        reply = await self._group_call(
            lambda: self._redis.xreadgroup(self.group, consumer, streams, count=count, block=block)
        )
        return _stream_entries(reply)

    async def _to_jobs(self, entries: list[_Entry], counts: _Counts | None = None) -> list[Job]:
        """Jobs (``counts`` from the PEL; None: first delivery). Entries deleted meanwhile are
        acked away; over-delivered ones are dead-lettered instead of returned."""
        stale = [eid for eid, fields in entries if not fields]
        if stale:
            await self._redis.xack(self.stream, self.group, *stale)
        jobs = [_job(eid, fields, (counts or {}).get(eid, 1)) for eid, fields in entries if fields]
        for job in jobs:
            if job.deliveries > self.max_deliveries:
                await self.dead_letter(job, f"delivered {job.deliveries} times")
        return [job for job in jobs if job.deliveries <= self.max_deliveries]

    async def _counts(self, entries: list[_Entry]) -> _Counts:
        """How often each entry was delivered so far (absent: never, or no group)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for eid, _ in entries:
                pipe.xpending_range(self.stream, self.group, eid, eid, 1)
            replies = await pipe.execute(raise_on_error=False)
        pel = [p for reply in replies if isinstance(reply, list) for p in reply]
        return {_text(p["message_id"]): int(p["times_delivered"]) for p in pel}

    async def dead_letter(
        self, job: Job, reason: str, code: ErrorCode = ErrorCode.INTERNAL, queued: bool = False
    ) -> bool:
        """Give up on a job: error answer for its waiters, a copy in the dead-letter stream.
        Also for a drained job, whose entry is gone already; with ``queued`` only if its
        entry is still here (a mover racing a consumer). True if it was dead-lettered."""
        fields = {"id": job.request_id, "payload": job.payload, "reason": reason,
                  "stream": self.stream, "deliveries": job.deliveries}  # fmt: skip
        what = (
            "dead-lettered after too many deliveries" if code is ErrorCode.INTERNAL else "refused"
        )
        answer = encode_result(b"", Failure(code, f"{what}: {reason}"))
        done = await self._finish(job, answer, dead=fields, queued=queued) >= 0
        if done:
            log.warning("dead-lettered request %s from %s: %s", job.request_id, self.stream, reason)
        return done

    async def _finish(
        self, job: Job, answer: bytes, dead: dict[str, Any] | None = None,
        members: dict[str, bytes] | None = None, queued: bool = False,
    ) -> int:  # fmt: skip
        """One step (``_FINISH_LUA``): check the fence, store the answer unless one exists,
        wake waiters, ack and delete the entry, file it as dead if asked."""
        fence_key, token = self.fence or (self.stream, "")
        members = members or {}
        dead_args = [x for pair in (dead or {}).items() for x in pair]
        keys = [
            self.stream,
            fence_key,
            self.dead_stream,
            self.keys.result(job.request_id),
            self.keys.notify(job.request_id),
            self.keys.waiters(job.request_id),
            *(self.keys.result(m) for m in members),
        ]
        args = [self.group, job.entry_id, token, self.result_ttl_s, self._notify_ttl_s,
                "1" if token or queued else "0", len(dead_args), *dead_args, answer,
                *members.values()]  # fmt: skip
        return int(await self._finish_script(keys=keys, args=args))

    async def _pass_token_on(self, notify: str, token: bytes) -> None:
        """A waiter that popped the wake-up token puts it back for the next waiter."""
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.rpush(notify, token).expire(notify, self._notify_ttl_s).execute()

    async def _batches(self) -> AsyncIterator[list[Job]]:
        """Outstanding entries in id order; ``deliveries`` = deliveries so far (0 if unread)."""
        start = "-"
        while raw := await self._redis.xrange(self.stream, start, "+", count=_BATCH):
            entries = [(_text(eid), fields) for eid, fields in raw]
            counts = await self._counts(entries)
            yield [_job(eid, fields, counts.get(eid, 0)) for eid, fields in entries]
            start = "(" + entries[-1][0]

    async def _remove(self, jobs: list[Job]) -> None:
        """Ack and delete (XACK fails harmlessly when the stream never had a group)."""
        ids = [job.entry_id for job in jobs]
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, *ids).xdel(self.stream, *ids)
            await pipe.execute(raise_on_error=False)

    async def _group_call(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run a group command; if the stream or group vanished, recreate it and return None."""
        try:
            return await call()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("group %s on %s missing, recreating it", self.group, self.stream)
            await self.ensure_group()
            return None


_Entry = tuple[str, dict[bytes, bytes]]
_Counts = dict[str, int]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _job(entry_id: str, fields: dict[bytes, bytes], deliveries: int) -> Job:
    prior = int(fields.get(b"prior", 0))
    weight, submission = int(fields.get(b"n", 1)), _text(fields.get(b"sub", b""))
    return Job(entry_id, _text(fields[b"id"]), fields[b"payload"], deliveries + prior,
               weight, submission)  # fmt: skip


def carried_answer(request_id: str, token: bytes) -> Result | None:
    """The answer a wake-up token carries (``_FINISH_LUA`` pushes the stored answer); None for
    a bare token (``b"1"``, shorter than any encoded answer's header)."""
    return decode_result(request_id, token) if len(token) >= ANSWER_MIN_BYTES else None


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _after(entry_id: str) -> str:
    """The smallest stream id greater than ``entry_id``."""
    ms, seq = _id_key(entry_id)
    return f"{ms}-{seq + 1}"


def _stream_entries(reply: Any) -> list[_Entry]:
    """XREADGROUP's reply for our stream (a list; a dict with ``legacy_responses=False``)."""
    if not reply:
        return []
    per_stream = list(reply.values()) if isinstance(reply, dict) else [pair[1] for pair in reply]
    return [(_text(eid), fields or {}) for eid, fields in per_stream[0]]
