"""The SDK's futures: every training and sampling call answers a request id at once, and the
client polls ``retrieve_future`` for the outcome.

Why keyed submission: the SDK re-sends a call it got no answer to (a timeout, a 5xx), with the
same ``(model_id, seq_id)`` (or sampling session and ``seq_id``). A key seen before returns the
request id it got the first time, so the work runs once and every copy is answered with the
same outcome. Finished outcomes are kept (the newest ``kept``) so a repeated poll still finds
its answer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from rlfleet.common.errors import NotFound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    """Not done yet: poll again."""


@dataclass(frozen=True)
class Done:
    value: Any


@dataclass(frozen=True)
class Failed:
    error: BaseException


Outcome = Pending | Done | Failed


class Futures:
    """Request ids for submitted work, the work's tasks, and their outcomes."""

    def __init__(self, kept: int = 10_000, wait_s: float = 20.0) -> None:
        self.kept, self.wait_s = kept, wait_s
        self._ids = itertools.count(1)
        self._by_key: OrderedDict[str, str] = OrderedDict()
        self._tasks: dict[str, asyncio.Task] = {}
        self._outcomes: OrderedDict[str, Outcome] = OrderedDict()

    def submit(
        self, key: str | None, work: Callable[[], Coroutine[Any, Any, Any]]
    ) -> tuple[str, bool]:
        """Start ``work`` under a new request id, or return the id ``key`` already has.
        Returns ``(request_id, started)``; ``started`` is False for a repeat."""
        if key is not None and key in self._by_key:
            return self._by_key[key], False
        request_id = f"req-{next(self._ids)}"
        if key is not None:
            self._by_key[key] = request_id
        task = asyncio.create_task(work())
        self._tasks[request_id] = task
        task.add_done_callback(lambda t: self._finish(request_id, t))
        return request_id, True

    def request_for(self, key: str) -> str | None:
        """The request id ``key`` was submitted under, if it was."""
        return self._by_key.get(key)

    def known(self, request_id: str) -> bool:
        return request_id in self._tasks or request_id in self._outcomes

    async def retrieve(self, request_id: str, wait_s: float | None = None) -> Outcome:
        """The outcome, waiting up to ``wait_s`` (default ``self.wait_s``) for it."""
        if request_id in self._outcomes:
            return self._outcomes[request_id]
        task = self._tasks.get(request_id)
        if task is None:
            raise NotFound(f"no request {request_id!r} (unknown, or its answer expired)")
        await asyncio.wait({task}, timeout=self.wait_s if wait_s is None else wait_s)
        return self._outcomes.get(request_id, Pending())

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _finish(self, request_id: str, task: asyncio.Task) -> None:
        self._tasks.pop(request_id, None)
        if task.cancelled():
            outcome: Outcome = Failed(asyncio.CancelledError("the server stopped"))
        elif (error := task.exception()) is not None:
            log.info("request %s failed: %s: %s", request_id, type(error).__name__, error)
            outcome = Failed(error)
        else:
            outcome = Done(task.result())
        self._outcomes[request_id] = outcome
        while len(self._outcomes) > self.kept:
            self._outcomes.popitem(last=False)
        while len(self._by_key) > self.kept:
            self._by_key.popitem(last=False)
