"""The producer side of a stream: queue requests, wait for their answers, take them back.

Waiting is cheap: a completer pushes a wake-up token to ``Keys.notify(request_id)`` (carrying
the answer), so a waiter blocks in one BLPOP instead of polling; it still re-reads the result
key every ``poll_s``, so a lost or expired wake-up only delays it. ``wait_all`` waits for many
answers on one connection (one MGET and one BLPOP per wake-up): the batch path of every
producer (``ScatterGather``, the router's ``GenerateBatch``) goes through it.

A waiter also notices when its request can no longer be answered because the server lost its
data (an empty restart, a flush): ``wait_all`` reads the data epoch (``QueueStream.epoch``) in
the same MGET as the answers and resubmits what is pending (or raises ``Vanished``) when it
changed; ``wait_answer(bound=True)`` reads the request's binding beside its answer and raises
``Vanished`` when both are gone. Resubmitting is safe: answers are ``SET NX``, so a request run
twice is still answered once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable

from rlfleet.common.errors import ErrorCode
from rlfleet.common.queue.entries import ID, text
from rlfleet.common.queue.results import Failure, Result, decode_result, encode_result
from rlfleet.common.queue.stream import QueueStream

log = logging.getLogger(__name__)

ANSWER_MIN_BYTES = len(encode_result(b""))  # an encoded answer is never shorter
WITHDRAWN = "withdrawn: the caller cancelled or timed out"


class Bound(enum.IntEnum):
    """What ``submit_bound`` did with a request."""

    CONFLICT = -1  # the id is bound to other content
    ANSWERED = 0  # the id has an answer already
    QUEUED = 1  # queued now
    JOINED = 2  # queued before (its first execution is alive): wait for its answer


class Vanished(Exception):
    """Requests still unanswered whose queued work the server lost (an empty restart, a
    flush): nobody will answer them unless they are submitted again."""

    def __init__(self, pending: list[str], answers: dict[str, Result] | None = None) -> None:
        super().__init__(f"{len(pending)} request(s) lost by the server: {pending[:3]}")
        self.pending, self.answers = pending, answers or {}


def carried_answer(request_id: str, token: bytes) -> Result | None:
    """The answer a wake-up token carries (``FINISH_LUA`` pushes the stored answer); None for
    a bare token (``b"1"``, shorter than any encoded answer's header)."""
    return decode_result(request_id, token) if len(token) >= ANSWER_MIN_BYTES else None


class Producer(QueueStream):
    """Queues requests on one stream and reads their answers."""

    async def submit(
        self, request_id: str, payload: bytes, prior_deliveries: int = 0, weight: int = 1
    ) -> bool:
        """Queue a request; False (and nothing queued) when it has been answered already.
        ``weight``: how many requests the entry holds (``Backlog.recount``).

        Check and add are one Lua script, so a retry can never be queued after its answer."""
        keys = [self.stream, self.keys.result(request_id)]
        args = [request_id, payload, prior_deliveries, weight]
        return bool(await self._scripts.submit(keys=keys, args=args))

    async def submit_bound(
        self, request_id: str, payload: bytes, fingerprint: str, submission: str, weight: int = 1
    ) -> Bound:
        """Queue a request unless its id is known: the id is bound to ``fingerprint`` (its
        content) for ``result_ttl_s``, so the same id is queued once while it is outstanding
        or answered, and other content under it is refused (``Bound.CONFLICT``)."""
        keys = [self.stream, self.keys.result(request_id), self.keys.request(request_id)]
        args = [request_id, payload, 0, fingerprint, self.result_ttl_s, weight, submission]
        return Bound(int(await self._scripts.submit_bound(keys=keys, args=args)))

    async def unbind(self, request_id: str, marker_ttl_s: int = 600) -> bool:
        """Give up on an unanswered bound request nobody waits for any more: forget the
        binding (a retry queues it afresh) and mark its submission cancelled, for its consumer
        to abort (``Consumer.cancelled``). True if there was one to give up on."""
        k = self.keys
        keys = [k.request(request_id), k.cancel(request_id), k.result(request_id)]
        return bool(await self._scripts.unbind(keys=keys, args=[marker_ttl_s]))

    async def leave(self, request_id: str, marker_ttl_s: int = 600) -> bool:
        """A counted waiter (see ``wait_answer``) gives up without an answer; the last one out
        gives the request up as ``unbind`` does. True if it was given up."""
        k = self.keys
        keys = [k.waiters(request_id), k.request(request_id), k.cancel(request_id),
                k.result(request_id)]  # fmt: skip
        return bool(await self._scripts.leave(keys=keys, args=[marker_ttl_s]))

    async def bound_to(self, request_id: str) -> str | None:
        """The fingerprint a request id is bound to, if any (``scripts.BINDING_LUA``)."""
        raw = await self._redis.get(self.keys.request(request_id))
        return None if raw is None else text(raw).split(" ", 1)[0]

    async def wait_any(self, request_ids: list[str], timeout_s: float) -> bool:
        """Block until one of ``request_ids`` is answered (True) or ``timeout_s`` passes: one
        BLPOP on all their wake-up lists, so waiting for many answers holds one connection.
        For ids only this caller waits on: the popped token is not passed on."""
        timeout = max(0.01, timeout_s)  # BLPOP 0 would block forever
        notify = [self.keys.notify(rid) for rid in request_ids]
        return bool(notify) and bool(await self._redis.blpop(notify, timeout=timeout))

    async def wait_all(
        self, request_ids: list[str], deadline: float, poll_s: float | None = None,
        epoch: str | None = None, resubmit: Callable[[list[str]], Awaitable[None]] | None = None,
    ) -> dict[str, Result]:  # fmt: skip
        """Every answer that comes by ``deadline`` (event-loop time); absent: none by then.
        Two round trips per wake-up: one MGET, then one BLPOP on the wake-up lists of those
        still unanswered, for at most ``poll_s`` (default ``self.poll_s``). For ids only this
        caller waits on: their wake-ups are not passed on.

        ``epoch`` (read before the requests were submitted) is checked in the same MGET: when
        the server lost its data, the pending ids are handed to ``resubmit`` (and waited for
        under the new epoch), or ``Vanished`` is raised without one."""
        loop, answers = asyncio.get_running_loop(), {}
        poll_s = self.poll_s if poll_s is None else poll_s
        while pending := [rid for rid in request_ids if rid not in answers]:
            got, now = await self._results_under(pending, epoch)
            answers |= got
            pending = [rid for rid in pending if rid not in answers]
            if not pending or (remaining := deadline - loop.time()) <= 0:
                break
            if epoch is not None and now != epoch:
                if resubmit is None:
                    raise Vanished(pending, answers)
                epoch = await self._resubmit(pending, resubmit)
                continue
            await self.wait_any(pending, min(poll_s, remaining))
        return answers

    async def _results_under(
        self, request_ids: list[str], epoch: str | None
    ) -> tuple[dict[str, Result], str | None]:
        """``get_results`` and, with ``epoch``, the current epoch, in one MGET."""
        if epoch is None:
            return await self.get_results(request_ids), None
        raws = await self._redis.mget([*(self.keys.result(r) for r in request_ids),
                                       self.keys.epoch])  # fmt: skip
        pairs = zip(request_ids, raws[:-1], strict=True)
        now = None if raws[-1] is None else text(raws[-1])
        return {rid: decode_result(rid, raw) for rid, raw in pairs if raw is not None}, now

    async def _resubmit(
        self, pending: list[str], resubmit: Callable[[list[str]], Awaitable[None]]
    ) -> str:
        """The new epoch (read first: a loss during the resubmission is seen next time)."""
        epoch = await self.epoch()
        log.warning("%s lost its data (a Redis restart?): resubmitting %d request(s)",
                    self.stream, len(pending))  # fmt: skip
        await resubmit(pending)
        return epoch

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
        self, request_id: str, timeout_s: float, poll_s: float = 1.0, bound: bool = False
    ) -> Result | None:
        """The answer for a *counted* waiter (``Keys.waiters``, or the submitter), or None
        after ``timeout_s``. Its completer pushed one copy of the answer per counted waiter,
        so this takes one and passes nothing on: one BLPOP in all, plus a GET when a wake-up
        carried no answer or ``poll_s`` passed (an answer stored another way, e.g. by a
        batch, or a wake-up that expired). ``bound``: the request was bound to its content
        (``Keys.request``, as the router's enqueue does), and that GET reads the binding too:
        both gone means the server lost the request, and ``Vanished`` is raised."""
        loop = asyncio.get_running_loop()
        deadline, notify = loop.time() + timeout_s, [self.keys.notify(request_id)]
        while True:
            remaining = deadline - loop.time()
            popped = await self._redis.blpop(notify, timeout=max(0.01, min(poll_s, remaining)))
            if popped is not None and (result := carried_answer(request_id, popped[1])):
                return result
            if (result := await self._answer_or_vanished(request_id, bound)) is not None:
                return result
            if deadline - loop.time() <= 0:
                return None

    async def _answer_or_vanished(self, request_id: str, bound: bool) -> Result | None:
        """The stored answer; with ``bound``, ``Vanished`` when neither it nor the request's
        binding is there (a binding outlives the answer's arrival: it is never unbound while
        a counted waiter waits)."""
        if not bound:
            return await self.get_result(request_id)
        raw, binding = await self._redis.mget(
            [self.keys.result(request_id), self.keys.request(request_id)]
        )
        if raw is not None:
            return decode_result(request_id, raw)
        if binding is None:
            raise Vanished([request_id])
        return None

    async def forget(self, request_ids: list[str]) -> None:
        """Drop stored answers that their only reader has read (saves memory until the TTL)."""
        if request_ids:
            await self._redis.unlink(*[self.keys.result(rid) for rid in request_ids])

    async def withdraw(self, request_ids: list[str]) -> int:
        """Take back requests whose caller has gone: mark each unanswered one answered
        (``WITHDRAWN``, ``SET NX``: no consumer's late answer is taken for a real one, and a
        consumer busy with it sees it is answered: ``Consumer.answered``) and delete their
        entries. Returns how many were marked (the rest had an answer already)."""
        marker = encode_result(b"", Failure(ErrorCode.DEADLINE_EXCEEDED, WITHDRAWN))
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.set(self.keys.result(request_id), marker, nx=True, ex=self.result_ttl_s)
            marked = sum(bool(ok) for ok in await pipe.execute())
        wanted = set(request_ids)
        async for entries in self._entries():
            if doomed := [eid for eid, f in entries if text(f.get(ID.encode(), b"")) in wanted]:
                await self._remove(doomed)
        return marked

    async def _pass_token_on(self, notify: str, token: bytes) -> None:
        """A waiter that popped the wake-up token puts it back for the next waiter."""
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.rpush(notify, token).expire(notify, self._notify_ttl_s).execute()
