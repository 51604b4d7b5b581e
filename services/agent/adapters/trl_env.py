"""TRL's ``environment_factory`` classes as text environments, unchanged.

The convention (TRL's ``GRPOTrainer(environment_factory=...)``, read from trl 1.16): one
instance per rollout; ``reset(**row)`` gets the dataset row and returns ``None`` or a string
(content parts too) that TRL appends to the last user message of the row's ``prompt``; every
public function of the class other than ``reset`` and ``get_reward`` is a tool (typed, with a
Google docstring: ``transformers.utils.get_json_schema`` gives its schema); an optional
``get_reward()`` (sync or async) scores the finished rollout from the instance's state.

Here: the tools answer through a ``ToolBox`` of the instance's bound methods, so a bad call is
an ``error:`` observation as for any tool; they run one at a time in the order the model wrote
them, as TRL runs sync tools, since they share the instance's state. The episode ends when the
assistant answers without a tool call; its reward is ``get_reward()``, or 0.0 for a class
without one (TRL then scores with ``reward_funcs``: here the reward service may score the
episode's answer later). An episode cut by ``max_turns`` never calls ``get_reward``. A class
with a public ``step`` is taken for a TextEnv, not a TRL class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from rlfleet.agent.adapters.text import call, calls_in_order, content_text
from rlfleet.agent.environment import EnvError, Message, StepResult, check_messages
from rlfleet.agent.tools import ToolBox

NOT_TOOLS = frozenset({"reset", "get_reward"})


def is_trl_environment(cls: type) -> bool:
    """A class with ``reset`` and no ``step``: TRL's convention, not the TextEnv protocol."""
    return callable(getattr(cls, "reset", None)) and not hasattr(cls, "step")


def tool_methods(environment: Any) -> list[Callable[..., Any]]:
    """The instance's tools as TRL finds them: public functions of its class (properties are not
    evaluated), less ``reset`` and ``get_reward``, bound to the instance."""
    names = [name for name, _ in inspect.getmembers(type(environment), inspect.isfunction)]
    return [getattr(environment, n) for n in names if n not in NOT_TOOLS and not n.startswith("_")]


class TRLEnv:
    """One episode of a TRL environment instance (``toolbox_kwargs`` go to its ToolBox)."""

    def __init__(self, environment: Any, **toolbox_kwargs: Any) -> None:
        self.environment = environment
        self.toolbox = ToolBox(tool_methods(environment), **toolbox_kwargs)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.toolbox.schemas

    async def reset(self, **task: Any) -> list[Message]:
        observation = await call(self.environment.reset, **task)
        return opening_messages(task, observation)

    async def step(self, assistant_message: Message) -> StepResult:
        if assistant_message.get("tool_calls") or assistant_message.get("tool_call_errors"):
            before = self.toolbox.errors
            messages = [await self.toolbox.run(c) for c in calls_in_order(assistant_message)]
            return messages, 0.0, False, {"tool_errors": self.toolbox.errors - before}
        get_reward = getattr(self.environment, "get_reward", None)
        if get_reward is None:
            return [], 0.0, True, {}
        reward = await call(get_reward)
        return [], reward, True, {"reward_parts": {type(self.environment).__name__: reward}}


def opening_messages(task: dict[str, Any], observation: object) -> list[Message]:
    """The row's prompt with ``reset``'s observation appended to its last user message (a new
    user message when there is none); a list of messages is appended after the prompt."""
    prompt = task.get("prompt", task.get("messages"))
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    messages = [dict(m) for m in check_messages(prompt or [], "the task's prompt")]
    if observation is None:
        return messages
    if isinstance(observation, list) and all(
        isinstance(m, dict) and "role" in m for m in observation
    ):
        return messages + check_messages(observation, "reset")
    if not isinstance(observation, str | list):
        raise EnvError(
            f"reset must return None, a string or messages, got {type(observation).__name__}"
        )
    text = content_text(observation, "reset's observation")
    if messages and messages[-1]["role"] == "user":
        messages[-1]["content"] += text
    else:
        messages.append({"role": "user", "content": text})
    return messages


def from_class(cls: type, kwargs: dict[str, Any]) -> Callable[[], TRLEnv]:
    """TRL calls the factory with no arguments; ``agent.env_kwargs``, when set, go to it."""
    return lambda: TRLEnv(cls(**kwargs))
