"""Tools as typed Python functions, and the ``ToolBox`` that answers a turn's calls.

Why typed functions with docstrings: it is the convention of transformers' chat templates
(``get_json_schema``), TRL and verifiers, so users' tools work unchanged, and the schema both
goes into the prompt (``tools=`` of the chat template) and checks the model's arguments before
the function runs. Every failure is an observation the model can read, never an exception:
an unknown tool, arguments that miss a required parameter or have the wrong JSON type, a
malformed call, an exception in the tool, or a call past its timeout each answer with a
``role: tool`` message whose content starts with ``error:``, and count in ``errors``.

Two runners: in-process (the default; sync tools in a daemon thread of their own, see
``invoke``), for trusted tools; and ``sandbox=True``, which runs each call as a program in the
reward service's sandbox (a confined child process: time, CPU and memory limits, no network,
killed at the timeout; see ``sandboxed``), for untrusted ones.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.agent.invoke import invoke
from rlfleet.agent.tool_calls import ToolCallError, errors_of
from rlfleet.agent.tool_types import Tool, ToolFailure

ERROR_PREFIX = "error: "
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def load_object(path: str) -> Any:
    """The object an import path ``module:attr`` (attr may be dotted) names; ValueError if none.

    Modules resolve from the working directory too (as uvicorn's ``module:app`` does), so a
    user's ``my_env.py`` next to their config works without being installed."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path of the form module:attr")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {path!r}: {exc}") from exc
    return target


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI function schema of a typed, documented function; ValueError saying why not."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 - transformers raises several kinds
        name = getattr(fn, "__name__", repr(fn))
        raise ValueError(f"tool {name}: no schema ({type(exc).__name__}: {exc})") from exc


def make_tool(spec: Callable[..., Any] | str) -> Tool:
    """A Tool from a function or its import path (config ``agent.tools``)."""
    path = spec if isinstance(spec, str) else None
    fn = load_object(spec) if isinstance(spec, str) else spec
    if not callable(fn):
        raise ValueError(f"tool {spec!r} is not callable")
    schema = tool_schema(fn)
    return Tool(schema["function"]["name"], fn, schema, path)


def check_arguments(parameters: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """What is wrong with ``arguments`` for a schema's ``parameters``; None when they fit."""
    properties = parameters.get("properties") or {}
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"unknown argument(s): {', '.join(unknown)}"
    for name, value in arguments.items():
        problem = _type_problem(properties[name], value)
        if problem:
            return f"argument {name} {problem}"
    return None


def _type_problem(schema: dict[str, Any], value: Any) -> str | None:
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if value is None and schema.get("nullable"):
        return None
    if kinds and not any(_JSON_TYPES.get(kind, lambda v: True)(value) for kind in kinds):
        return f"must be of type {' or '.join(kinds)}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {schema['enum']}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return next((p for p in (_type_problem(schema["items"], v) for v in value) if p), None)
    return None


def render_result(value: Any, max_chars: int) -> str:
    """A tool's return value as message content: text as is, anything else as JSON."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [{len(text) - max_chars} more characters cut]"
    return text


def tool_message(call_id: str, name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


@dataclass
class ToolAnswers:
    """The tool messages answering one assistant turn, and how many of them are errors."""

    messages: list[dict[str, Any]]
    errors: int


class ToolBox:
    """The tools of an environment; ``answer`` turns an assistant message into tool messages."""

    def __init__(
        self,
        tools: Sequence[Callable[..., Any] | str],
        *,
        timeout_s: float = 10.0,
        sandbox: bool = False,
        limits: Any = None,
        max_result_chars: int = 16_384,
    ) -> None:
        self.tools = {tool.name: tool for tool in map(make_tool, tools)}
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        self.calls = self.errors = 0
        self._runner = _in_process if not sandbox else _sandbox_runner(self.tools, limits)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, for the chat template's ``tools=``."""
        return [tool.schema for tool in self.tools.values()]

    async def answer(self, message: dict[str, Any]) -> ToolAnswers:
        """One tool message per call of an assistant message (malformed ones included), in
        the order the model wrote them; the calls run concurrently."""
        good = [(call.get("id", ""), call) for call in message.get("tool_calls") or []]
        broken = [(error.id, error) for error in errors_of(message)]
        ordered = sorted(good + broken, key=lambda item: _index_of(item[0]))
        replies = await asyncio.gather(*(self._answer(call) for _, call in ordered))
        return ToolAnswers([m for m, _ in replies], sum(failed for _, failed in replies))

    async def run(self, call: dict[str, Any] | ToolCallError) -> dict[str, Any]:
        """The ``role: tool`` answer to one call; an ``error:`` observation when it fails."""
        message, _ = await self._answer(call)
        return message

    async def _answer(self, call: dict[str, Any] | ToolCallError) -> tuple[dict[str, Any], bool]:
        """(the tool message, whether it is an error)."""
        self.calls += 1
        if isinstance(call, ToolCallError):
            return self._error(call.id, "", f"malformed tool call: {call.reason}")
        call_id, function = str(call.get("id", "")), call.get("function") or {}
        name = str(function.get("name", ""))
        tool = self.tools.get(name)
        if tool is None:
            return self._error(call_id, name, f"unknown tool {name!r}; tools: {sorted(self.tools)}")
        arguments, problem = _decode_arguments(function.get("arguments", "{}"))
        problem = problem or check_arguments(tool.parameters, arguments)
        if problem:
            return self._error(call_id, name, problem)
        return await self._execute(call_id, tool, arguments)

    async def _execute(
        self, call_id: str, tool: Tool, arguments: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        try:
            value = await self._runner(tool, arguments, self.timeout_s)
        except TimeoutError:
            return self._error(
                call_id, tool.name, f"{tool.name} timed out after {self.timeout_s:g}s"
            )
        except ToolFailure as exc:
            return self._error(call_id, tool.name, f"{tool.name} failed: {exc}")
        except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's observation
            return self._error(
                call_id, tool.name, f"{tool.name} raised {type(exc).__name__}: {exc}"
            )
        return tool_message(call_id, tool.name, render_result(value, self.max_result_chars)), False

    def _error(self, call_id: str, name: str, text: str) -> tuple[dict[str, Any], bool]:
        self.errors += 1
        return tool_message(call_id, name, ERROR_PREFIX + text), True


async def _in_process(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> Any:
    return await invoke(tool.fn, timeout_s=timeout_s, **arguments)


def _sandbox_runner(tools: dict[str, Tool], limits: Any) -> Callable[..., Any]:
    from rlfleet.agent.sandboxed import SandboxRunner

    return SandboxRunner(tools.values(), limits)


def _decode_arguments(raw: object) -> tuple[dict[str, Any], str | None]:
    if isinstance(raw, dict):
        return raw, None
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        return {}, "arguments must be a JSON object"
    return value, None


def _index_of(call_id: str) -> int:
    """Position of ``call_<n>`` ids (what ``parse_tool_calls`` writes); others keep their order."""
    _, _, number = call_id.rpartition("_")
    return int(number) if number.isdigit() else 0
