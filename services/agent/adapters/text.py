"""What the adapters share: calling user code, and an assistant turn as the text it wrote.

Why ``assistant_text``: OpenEnv and skyrl-gym environments read the model's raw text (they
parse their own actions out of it), but the loop hands environments the parsed OpenAI message,
whose ``content`` stops at the first ``<tool_call>``. The calls are written back in the
model's format, in the order it wrote them (the malformed ones as the text inside their tags),
so such an environment sees the calls too; whitespace between content and calls is not kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rlfleet.agent.environment import EnvError, Message
from rlfleet.agent.invoke import invoke
from rlfleet.agent.tool_calls import CLOSE, OPEN, ToolCallError, errors_of


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(...)`` awaited if async, in a thread of its own if sync (never on the event loop).
    No limit of its own: the loop's ``step_timeout_s`` bounds the adapter's whole call."""
    return await invoke(fn, *args, timeout_s=None, **kwargs)


def assistant_text(message: Message) -> str:
    """The assistant's turn as text: its content, then its tool calls in the model's format."""
    return (message.get("content") or "") + "".join(map(_render, calls_in_order(message)))


def calls_in_order(message: Message) -> list[dict[str, Any] | ToolCallError]:
    """The turn's calls, good and malformed, in the order the model wrote them."""
    calls: list[Any] = [*(message.get("tool_calls") or []), *errors_of(message)]
    return sorted(calls, key=_position)


def content_text(content: object, where: str) -> str:
    """Message content as text: a string, or OpenAI content parts of type ``text``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_is_text_part(part) for part in content):
        return "".join(part["text"] for part in content)
    raise EnvError(f"{where} must be a string or text content parts, got {type(content).__name__}")


def _is_text_part(part: object) -> bool:
    return (
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
    )


def _render(call: dict[str, Any] | ToolCallError) -> str:
    if isinstance(call, ToolCallError):
        return OPEN + call.raw + ("" if call.reason.startswith("no closing") else CLOSE)
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    body = {"name": function.get("name", ""), "arguments": arguments}
    return OPEN + json.dumps(body, separators=(",", ":"), ensure_ascii=False) + CLOSE


def _position(call: dict[str, Any] | ToolCallError) -> int:
    """Where the model wrote a call: the ``n`` of its ``call_<n>`` id (the loop's parser)."""
    if isinstance(call, ToolCallError):
        return call.index
    _, _, number = str(call.get("id", "")).rpartition("_")
    return int(number) if number.isdigit() else 0
