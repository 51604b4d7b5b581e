"""The sandbox: run untrusted Python (user reward functions, ``code`` solutions, agent tools) in
confined child processes, so whatever it does costs only its own call.

Platform code, below the roles: the reward role runs user functions and ``code`` tests in it,
the agent and env roles run sandboxed tools in it. ``parent`` is the service side
(``run_program``, ``SandboxProcess``); ``child`` is what runs in the sandbox, confined by
``isolation`` and ``mounts`` (kernel) and ``guard`` (audit hook); ``cgroup`` bounds the
processes of a call; ``scrub`` keeps the service's secrets out of what comes back.

Names are imported on first use (PEP 562): the child imports this package and should not pay
for asyncio and pydantic before it is confined.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "RunOutcome": "parent",
    "SandboxError": "parent",
    "SandboxProcess": "parent",
    "describe_exit": "parent",
    "isolation_report": "parent",
    "run_program": "parent",
    "add_secret": "scrub",
    "scrub": "scrub",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
