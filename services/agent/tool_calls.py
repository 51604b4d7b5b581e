"""Moved to ``rlfleet.model.tool_calls`` (the router's OpenAI front parses the same format);
this name stays so the agent's modules and tests keep importing it from here unchanged."""

from rlfleet.model.tool_calls import (  # noqa: F401 - re-exported
    CLOSE,
    ERRORS_KEY,
    OPEN,
    ParsedTurn,
    ToolCallError,
    errors_of,
    parse_tool_calls,
)
