"""Call user code (a tool, an environment's ``reset``/``step``) sync or async, under a time limit.

Why a daemon thread per sync call and not ``asyncio.to_thread``: a sync call that never
returns cannot be stopped from Python. In the default executor it would hold a pool thread
forever, and ``asyncio.run`` joins that pool on exit, so one hung tool would hang the worker's
shutdown. A daemon thread of its own costs tens of microseconds, is abandoned at the timeout
(its late result is dropped) and never blocks exit. Untrusted code belongs in a process that
can be killed (``ToolBox(sandbox=True)``); this path is for trusted, in-process code.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Callable
from typing import Any


async def invoke(fn: Callable[..., Any], *args: Any, timeout_s: float | None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, awaited if it is (or returns) awaitable; TimeoutError past
    ``timeout_s`` (None = no limit). Sync functions run off the event loop."""
    async with asyncio.timeout(timeout_s):
        if inspect.iscoroutinefunction(fn):
            value = await fn(*args, **kwargs)
        else:
            value = await _in_thread(fn, args, kwargs)
        if inspect.isawaitable(value):
            value = await value
    return value


def _in_thread(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args, **kwargs), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed while the call ran
            loop.call_soon_threadsafe(_settle, future, *outcome)

    threading.Thread(
        target=run, name=f"rlfleet-call-{getattr(fn, '__name__', 'fn')}", daemon=True
    ).start()
    return future


def _settle(future: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if future.done():  # timed out or cancelled: nobody waits for it any more
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
