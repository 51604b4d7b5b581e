"""What a tool is, to the ``ToolBox`` that answers calls and to the runners that run them.

Apart from ``tools`` so that a runner (``sandboxed``, imported by ``tools`` only when a box is
sandboxed) reads these types from below both, and the two modules do not import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tool:
    """One tool: its function, its OpenAI schema, and its import path when it has one."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    path: str | None = None

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters") or {}


class ToolFailure(RuntimeError):
    """A call failed outside this process (the sandboxed tool raised, or its child was stopped)."""
