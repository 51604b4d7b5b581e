"""The producer side of a stream: queue requests, and take them back.

Waiting for the answers is the request side's (``answers.Answers``: one answer, many, the
data epoch, the waiters), which every side of a stream inherits through ``QueueStream``.
"""

from __future__ import annotations

import enum

from redis.typing import EncodableT

from rlfleet.common.errors import ErrorCode
from rlfleet.common.queue.entries import ID, text
from rlfleet.common.queue.results import Failure, encode_result
from rlfleet.common.queue.stream import QueueStream

WITHDRAWN = "withdrawn: the caller cancelled or timed out"


class Bound(enum.IntEnum):
    """What ``submit_bound`` did with a request."""

    CONFLICT = -1  # the id is bound to other content
    ANSWERED = 0  # the id has an answer already
    QUEUED = 1  # queued now
    JOINED = 2  # queued before (its first execution is alive): wait for its answer


class Producer(QueueStream):
    """Queues requests on one stream; reads their answers as ``Answers`` does."""

    async def submit(
        self, request_id: str, payload: bytes, prior_deliveries: int = 0, weight: int = 1
    ) -> bool:
        """Queue a request; False (and nothing queued) when it has been answered already.
        ``weight``: how many requests the entry holds (``Backlog.recount``).

        Check and add are one Lua script, so a retry can never be queued after its answer."""
        keys = [self.stream, self.keys.result(request_id)]
        args: list[EncodableT] = [request_id, payload, prior_deliveries, weight]
        return bool(await self._scripts.submit(keys=keys, args=args))

    async def submit_bound(
        self, request_id: str, payload: bytes, fingerprint: str, submission: str, weight: int = 1
    ) -> Bound:
        """Queue a request unless its id is known: the id is bound to ``fingerprint`` (its
        content) for ``result_ttl_s``, so the same id is queued once while it is outstanding
        or answered, and other content under it is refused (``Bound.CONFLICT``)."""
        keys = [self.stream, self.keys.result(request_id), self.keys.request(request_id)]
        args: list[EncodableT] = [
            request_id,
            payload,
            0,
            fingerprint,
            self.result_ttl_s,
            weight,
            submission,
        ]
        return Bound(int(await self._scripts.submit_bound(keys=keys, args=args)))

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
