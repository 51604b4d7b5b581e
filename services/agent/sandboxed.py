"""Run tool calls in the platform's sandbox: one confined child process per call.

Why reuse it: ``rlfleet.common.sandbox.run_program`` already runs a Python program in a child
that confines itself before user code runs (rlimits on CPU, memory, file size and processes,
no network where the kernel allows, an audit hook against writes outside its directory and
new processes) and is killed at its wall clock. A tool call becomes such a program: it imports
the tool by its import path, calls it with the arguments read from stdin, and prints the
result as one JSON line. A fresh process per call costs a Python start-up (tens of
milliseconds), the price of isolation; the in-process runner is the fast path for trusted
tools. Only sync functions with an import path (``module:attr``, or a module-level function)
can be sandboxed: the child has nothing of the parent but ``sys.path``.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Iterable
from typing import Any

from rlfleet.agent.tool_types import Tool, ToolFailure

PROGRAM = """
import importlib, json, sys
sys.path[:0] = {paths!r}

def main():
    request = json.loads(sys.stdin.read())
    module, _, attr = request["tool"].partition(":")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    try:
        value = fn(**request["arguments"])
    except Exception as exc:
        print(json.dumps({{"error": type(exc).__name__ + ": " + str(exc)}}))
        return
    print(json.dumps({{"result": value}}, ensure_ascii=False, default=str))

main()
"""


class SandboxRunner:
    """Runs a ToolBox's calls in sandboxed children (``ToolBox(..., sandbox=True)``)."""

    def __init__(self, tools: Iterable[Tool], limits: Any = None) -> None:
        from rlfleet.common.config import SandboxLimits

        self.paths = {tool.name: import_path(tool) for tool in tools}
        self.limits = limits or SandboxLimits()
        self.program = PROGRAM.format(paths=list(sys.path))

    async def __call__(self, tool: Tool, arguments: dict[str, Any], timeout_s: float) -> Any:
        """The tool's return value; TimeoutError past ``timeout_s``, ToolFailure otherwise."""
        from rlfleet.common.sandbox import run_program

        limits = self.limits.model_copy(update={"timeout_s": timeout_s})
        request = json.dumps({"tool": self.paths[tool.name], "arguments": arguments})
        outcome = await run_program(self.program, request, limits)
        if outcome.reason.startswith("timed out"):
            raise TimeoutError(outcome.reason)
        reply = _last_json_line(outcome.stdout)
        if reply is None or not outcome.ok:
            why = outcome.reason or (outcome.stderr.strip().splitlines() or ["no reply"])[-1]
            raise ToolFailure(f"sandboxed call failed: {why}")
        if "error" in reply:
            raise ToolFailure(str(reply["error"]))
        return reply.get("result")


def import_path(tool: Tool) -> str:
    """``module:attr`` the child can import; ValueError for tools it could not reach."""
    if inspect.iscoroutinefunction(tool.fn):
        raise ValueError(f"tool {tool.name}: async tools cannot run sandboxed")
    if tool.path:
        return tool.path
    module, qualname = getattr(tool.fn, "__module__", None), getattr(tool.fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname:
        raise ValueError(f"tool {tool.name}: a sandboxed tool needs an importable module:attr")
    return f"{module}:{qualname}"


def _last_json_line(stdout: str) -> dict[str, Any] | None:
    """The program's reply: its last stdout line (the tool's own prints come before it)."""
    lines = stdout.strip().splitlines()
    try:
        reply = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return reply if isinstance(reply, dict) else None
