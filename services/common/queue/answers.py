"""The request side of the queue, whatever stream a request went to: answers, bindings,
waiters and the server's data epoch.

Why apart from the streams: a request's answer, its binding to its content and its count of
waiters are keyed by its id alone (``Keys.result``, ``Keys.request``, ``Keys.waiters``,
``Keys.notify``), so whoever only waits for answers (the router, which queues a request on the
stream of the replica it picks, and batches on several) needs no stream object, and none
pretends to be one. ``QueueStream`` builds on this class, so every side of a stream reads its
answers the same way.

Waiting is cheap: a completer pushes a wake-up token to ``Keys.notify(request_id)`` (carrying
the answer), so a waiter blocks in one BLPOP instead of polling; it still re-reads the result
key every ``poll_s``, so a lost or expired wake-up only delays it. ``wait_all`` waits for many
answers on one connection (one MGET and one BLPOP per wake-up): the batch path of every
producer (``ScatterGather``, the router's ``GenerateBatch``) goes through it.

A waiter also notices when its request can no longer be answered because the server lost its
data (an empty restart, a flush): ``wait_all`` reads the data epoch (``epoch``) in the same
MGET as the answers and resubmits what is pending (or raises ``Vanished``) when it changed;
``wait_answer(bound=True)`` reads the request's binding beside its answer and raises
``Vanished`` when both are gone. Resubmitting is safe: answers are ``SET NX``, so a request
run twice is still answered once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from rlfleet.common.keys import Keys
from rlfleet.common.queue.entries import text
from rlfleet.common.queue.results import Result, decode_result, encode_result
from rlfleet.common.queue.scripts import Scripts

log = logging.getLogger(__name__)

NOTIFY_TTL_S = 60  # only waiters blocked right now need the token; later ones read the result
ANSWER_MIN_BYTES = len(encode_result(b""))  # an encoded answer is never shorter


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


def _bytes(reply: bytes | str) -> bytes:
    """A reply of the queue's client, which never decodes (``Answers.__init__`` checks)."""
    return reply if isinstance(reply, bytes) else reply.encode()


class Answers:
    """The answers, bindings and waiters of requests on any stream of one cluster."""

    def __init__(
        self, redis: Redis, keys: Keys, result_ttl_s: int = 3600, poll_s: float = 0.5
    ) -> None:
        if redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("the work queue needs a Redis client with decode_responses=False")
        if result_ttl_s < 1 or poll_s <= 0:
            raise ValueError("result_ttl_s and poll_s must be positive")
        self._redis, self.keys = redis, keys
        self.result_ttl_s, self.poll_s = result_ttl_s, poll_s
        self._scripts = Scripts(redis)
        self._notify_ttl_s = min(NOTIFY_TTL_S, result_ttl_s)

    async def epoch(self) -> str:
        """The server's data epoch (``Keys.epoch``, written if absent; one round trip). Read
        before submitting (a producer) or reading (a consumer): a different value later means
        the server lost its data meanwhile, and the entries, leases and answers with it."""
        token = await self._scripts.epoch(keys=[self.keys.epoch], args=[uuid.uuid4().hex])
        return text(token)

    async def get_result(self, request_id: str) -> Result | None:
        """The stored answer, if any."""
        raw = await self._redis.get(self.keys.result(request_id))
        return None if raw is None else decode_result(request_id, _bytes(raw))

    async def get_results(self, request_ids: list[str]) -> dict[str, Result]:
        """The answers stored so far for ``request_ids`` (one MGET); absent: none yet."""
        if not request_ids:
            return {}
        raws = await self._redis.mget([self.keys.result(rid) for rid in request_ids])
        pairs = zip(request_ids, raws, strict=True)
        return {rid: decode_result(rid, _bytes(raw)) for rid, raw in pairs if raw is not None}

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
        keys = [
            k.waiters(request_id),
            k.request(request_id),
            k.cancel(request_id),
            k.result(request_id),
        ]
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
        self,
        request_ids: list[str],
        deadline: float,
        poll_s: float | None = None,
        epoch: str | None = None,
        resubmit: Callable[[list[str]], Awaitable[None]] | None = None,
    ) -> dict[str, Result]:
        """Every answer that comes by ``deadline`` (event-loop time); absent: none by then.
        Two round trips per wake-up: one MGET, then one BLPOP on the wake-up lists of those
        still unanswered, for at most ``poll_s`` (default ``self.poll_s``). For ids only this
        caller waits on: their wake-ups are not passed on.

        ``epoch`` (read before the requests were submitted) is checked in the same MGET: when
        the server lost its data, the pending ids are handed to ``resubmit`` (and waited for
        under the new epoch), or ``Vanished`` is raised without one."""
        loop, answers = asyncio.get_running_loop(), dict[str, Result]()
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
        raws = await self._redis.mget(
            [*(self.keys.result(r) for r in request_ids), self.keys.epoch]
        )
        pairs = zip(request_ids, raws[:-1], strict=True)
        now = None if raws[-1] is None else text(raws[-1])
        return {rid: decode_result(rid, _bytes(raw)) for rid, raw in pairs if raw is not None}, now

    async def _resubmit(
        self, pending: list[str], resubmit: Callable[[list[str]], Awaitable[None]]
    ) -> str:
        """The new epoch (read first: a loss during the resubmission is seen next time)."""
        epoch = await self.epoch()
        log.warning("Redis lost its data (a restart?): resubmitting %d request(s)", len(pending))
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
                if (result := carried_answer(request_id, _bytes(popped[1]))) is not None:
                    break
        if popped is not None:
            await self._pass_token_on(notify, _bytes(popped[1]))
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
            if popped is not None and (result := carried_answer(request_id, _bytes(popped[1]))):
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
            return decode_result(request_id, _bytes(raw))
        if binding is None:
            raise Vanished([request_id])
        return None

    async def forget(self, request_ids: list[str]) -> None:
        """Drop stored answers that their only reader has read (saves memory until the TTL)."""
        if request_ids:
            await self._redis.unlink(*[self.keys.result(rid) for rid in request_ids])

    async def _pass_token_on(self, notify: str, token: bytes) -> None:
        """A waiter that popped the wake-up token puts it back for the next waiter."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.rpush(notify, token)
            pipe.expire(notify, self._notify_ttl_s)
            await pipe.execute()
