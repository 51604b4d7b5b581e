"""Typed tool functions for ``agent.tools`` (schemas from their signatures and docstrings via
``transformers.utils.get_json_schema``); given to an environment named by import path as
``tools=`` (a ToolBox that runs each call with ``agent.tool_timeout_s``).

    agent.tools='[examples.agents.tools:add,examples.agents.tools:multiply]'
"""

from __future__ import annotations


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b
