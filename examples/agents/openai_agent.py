"""An agent workflow: a plain ``openai``-client agent, trained through the router's gateway.

    rlfleet up --config configs/agent_calc.yaml agent.env=examples.agents.openai_agent:run

The convention is ``async def run(data, *, base_url, api_key, session_id) -> float | dict``:
the env worker starts a gateway session, calls ``run`` with the gateway's OpenAI base URL, ends
the session and trains the tokens the gateway sampled and recorded. The agent only has to send
``session_id`` with its calls (here the ``X-Session-ID`` header). This one solves the calc task
with the ``add`` tool: it answers each ``tool_calls`` with the tool's result, asks a turn cut by
``max_tokens`` to continue, and the reward is whether its final answer is the sum. (A cut turn
is re-rendered by the chat template, so the next call's prompt may not extend it token for
token: the gateway then trains it as a branch of its own, ``agent.multi_call``.)
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}  # fmt: skip


async def run(data: dict[str, Any], *, base_url: str, api_key: str, session_id: str,
              max_turns: int = 5, max_tokens: int = 48) -> dict[str, float]:  # fmt: skip
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                         default_headers={"X-Session-ID": session_id})  # fmt: skip
    messages: list[dict[str, Any]] = list(data["prompt"])
    try:
        for _ in range(max_turns):
            answer = await client.chat.completions.create(
                model="policy", messages=messages, tools=[ADD], max_tokens=max_tokens
            )
            message = answer.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if answer.choices[0].finish_reason == "length":  # cut by max_tokens: ask for the rest
                messages.append({"role": "user", "content": "Continue."})
                continue
            if not message.tool_calls:
                return score(message.content or "", data)
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": str(add(call.function.arguments))})  # fmt: skip
        return {"reward": 0.0, "finished": 0.0}
    finally:
        await client.close()


def add(arguments: str) -> int | str:
    try:
        args = json.loads(arguments)
        return int(args["a"]) + int(args["b"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def score(text: str, data: dict[str, Any]) -> dict[str, float]:
    right = float(text.strip() == str(data["reward_model"]["ground_truth"]))
    return {"reward": right, "finished": 1.0}
