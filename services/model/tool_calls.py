"""Tool calls in a decoded assistant turn: Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks.

Why in the model layer: the format is the chat template's, and two roles parse it, the
episode loop (``rlfleet.agent``) and the router's OpenAI front (``tools`` -> ``tool_calls``);
a role may not import another role's internals, so the parser sits below both.
Why a parser of our own and not the engine's: the environment worker sees token ids and their
text, not an OpenAI server's parsed answer, and a policy in training writes broken calls all
the time. Each block must hold a JSON object with a ``name`` (string) and ``arguments`` (an
object; a JSON string holding an object is accepted, as OpenAI-trained models write; absent
means no arguments). A block that fails becomes a ``ToolCallError`` record, never an exception,
so the environment can answer it with an error observation and the episode goes on.

Output is OpenAI's format: ``{"id", "type": "function", "function": {"name", "arguments"}}``
with ``arguments`` a compact JSON string; ids are ``call_<n>``, numbered across the episode by
the caller's ``first_index``. The assistant message carries the malformed calls under
``tool_call_errors`` (a list of ``ToolCallError.to_dict()``), the one key outside OpenAI's.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ERRORS_KEY = "tool_call_errors"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCallError:
    """A call the model attempted but wrote wrong; ``raw`` is the text inside the tags."""

    id: str
    index: int
    raw: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ToolCallError:
        return cls(
            str(raw.get("id", "")),
            int(raw.get("index", 0)),
            str(raw.get("raw", "")),
            str(raw.get("reason", "malformed tool call")),
        )


@dataclass
class ParsedTurn:
    """One assistant turn: its text before the calls, the good calls, the broken ones."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)

    @property
    def attempted(self) -> int:
        """Calls the model tried, good or broken."""
        return len(self.tool_calls) + len(self.errors)

    def message(self) -> dict[str, Any]:
        """The turn as an OpenAI assistant message (plus ``tool_call_errors`` when any)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.errors:
            message[ERRORS_KEY] = [error.to_dict() for error in self.errors]
        return message


def parse_tool_calls(text: str, first_index: int = 0) -> ParsedTurn:
    """Split ``text`` into content and calls; never raises for what the model wrote."""
    start = text.find(OPEN)
    if start < 0:
        return ParsedTurn(text)
    turn = ParsedTurn(text[:start].rstrip())
    index, end = first_index, start
    for match in _BLOCK.finditer(text, start):
        _add(turn, match.group(1), f"call_{index}", index)
        index, end = index + 1, match.end()
    rest = text.find(OPEN, end)
    if rest >= 0:  # an opening tag without its closing one
        raw = text[rest + len(OPEN) :]
        turn.errors.append(ToolCallError(f"call_{index}", index, raw, f"no closing {CLOSE}"))
    return turn


def errors_of(message: dict[str, Any]) -> list[ToolCallError]:
    """The malformed calls an assistant message carries (none for a plain OpenAI message)."""
    raw = message.get(ERRORS_KEY) or []
    return [ToolCallError.from_dict(item) for item in raw if isinstance(item, dict)]


def _add(turn: ParsedTurn, raw: str, call_id: str, index: int) -> None:
    try:
        name, arguments = _name_and_arguments(raw)
    except ValueError as exc:
        turn.errors.append(ToolCallError(call_id, index, raw, str(exc)))
        return
    function = {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}
    turn.tool_calls.append({"id": call_id, "type": "function", "function": function})


def _name_and_arguments(raw: str) -> tuple[str, dict[str, Any]]:
    """ValueError saying what is wrong with one block's JSON."""
    try:
        call = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call is not valid JSON ({exc.msg} at char {exc.pos})") from exc
    if not isinstance(call, dict):
        raise ValueError("tool call must be a JSON object with name and arguments")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("tool call has no name (a non-empty string)")
    return name, _arguments(call.get("arguments", {}))


def _arguments(value: object) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError("tool call arguments must be a JSON object") from exc
    if not isinstance(value, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {type(value).__name__}")
    return value
