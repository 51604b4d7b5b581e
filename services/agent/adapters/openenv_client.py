"""OpenEnv clients (``openenv-core``) as text environments: a server's episodes, unchanged.

The convention (openenv-core 0.3): an environment runs as a server (``create_app`` over an
``Environment``); its client, an ``EnvClient[Action, Observation, State]`` subclass (async,
one WebSocket session per client) or its ``.sync()`` wrapper, has ``reset(**kwargs)`` and
``step(action)``, each returning a ``StepResult(observation, reward, done)``.

Here: one client per episode (``agent.env`` names the client class, built with
``agent.env_kwargs`` such as ``base_url``; or a factory returning a client). ``reset`` sends
the task row less its prompt (the server passes on what its ``reset`` accepts); the opening
messages are the row's prompt, if any, then the observation's text as a user message. Each
assistant turn becomes an action through ``action_from_text`` (default: the client's Action
class, read from its generic parameters, built with the text in its one string field, or in
``action_field``); each observation becomes a user message through ``observation_text``
(default: its one string field, else its fields as JSON). The client is closed, and its
server session freed, when the environment says done or the episode ends otherwise (the env
worker calls ``close()`` after every episode). Adapter options ride in
``agent.env_kwargs`` under the names below (import paths for the callables).
"""

from __future__ import annotations

import json
import sys
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from rlfleet.agent.adapters.text import assistant_text, call
from rlfleet.agent.environment import EnvError, Message, StepResult, task_prompt
from rlfleet.agent.tools import load_object

OPTIONS = ("action_from_text", "action_field", "observation_text")
NOT_TEXT = frozenset({"metadata", "reward", "done"})


def is_openenv_client(cls: type) -> bool:
    """An ``EnvClient`` or ``SyncEnvClient`` subclass (only when the user's code imported them)."""
    bases = [
        getattr(sys.modules.get(f"openenv.core.{m}"), n, None)
        for m, n in (("env_client", "EnvClient"), ("sync_client", "SyncEnvClient"))
    ]
    kinds = tuple(base for base in bases if isinstance(base, type))
    return bool(kinds) and isinstance(cls, type) and issubclass(cls, kinds)


class OpenEnvTextEnv:
    """One episode of an OpenEnv client (see the module doc for the defaults)."""

    def __init__(
        self,
        client: Any,
        *,
        action_from_text: Callable[[str], Any] | None = None,
        action_field: str | None = None,
        observation_text: Callable[[Any], str] | None = None,
    ) -> None:
        self.client, self.closed = client, False
        if action_from_text is None:
            wrapped = getattr(client, "async_client", client)  # what a SyncEnvClient wraps
            action_from_text = text_action(action_class(type(wrapped)), action_field)
        self.action_from_text = action_from_text
        self.observation_text = observation_text or text_of_observation

    async def reset(self, **task: Any) -> list[Message]:
        kwargs = {k: v for k, v in task.items() if k not in ("prompt", "messages")}
        result = await call(self.client.reset, **kwargs)
        has_prompt = task.get("prompt", task.get("messages")) is not None
        return (task_prompt(task) if has_prompt else []) + self._messages(result)

    async def step(self, assistant_message: Message) -> StepResult:
        action = self.action_from_text(assistant_text(assistant_message))
        result = await call(self.client.step, action)
        messages, reward, done = self._messages(result), result.reward, result.done
        if done is True:
            await self.close()
        return messages, 0.0 if reward is None else reward, done, {}

    async def close(self) -> None:
        """Closes the client once (at done, and the env worker closes every episode's env)."""
        close = getattr(self.client, "close", None)
        if close is not None and not self.closed:
            self.closed = True
            await call(close)

    def _messages(self, result: Any) -> list[Message]:
        if not hasattr(result, "observation"):
            raise EnvError(f"the client returned a {type(result).__name__}, not a StepResult")
        text = self.observation_text(result.observation)
        if not isinstance(text, str):
            raise EnvError(f"observation_text returned a {type(text).__name__}, not a string")
        return [{"role": "user", "content": text}] if text else []


def action_class(client_class: type) -> type[BaseModel] | None:
    """The Action class (a pydantic model) of a client class's ``EnvClient[Action, ...]`` base,
    if it names one."""
    for klass in client_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                return args[0]
    return None


def text_action(cls: type[BaseModel] | None, field: str | None) -> Callable[[str], Any]:
    """Text -> action: ``cls(**{field: text})``, the field defaulting to the class's one string
    field; a plain dict when the client takes dicts (``GenericEnvClient``)."""
    if cls is None:
        if field is None:
            raise ValueError(
                "this OpenEnv client has no typed Action: set action_field or "
                "action_from_text in agent.env_kwargs"
            )
        return lambda text: {field: text}
    if field is None:
        names = [
            n for n, f in cls.model_fields.items() if f.annotation is str and n not in NOT_TEXT
        ]
        if len(names) != 1:
            raise ValueError(
                f"{cls.__name__} has string fields {names}, not one: set "
                "action_field or action_from_text in agent.env_kwargs"
            )
        field = names[0]
    return lambda text: cls(**{field: text})


def text_of_observation(observation: Any) -> str:
    """An observation's text: its one string field, else its fields (less reward, done,
    metadata) as JSON; "" when it has none."""
    values = observation.model_dump() if hasattr(observation, "model_dump") else observation
    if not isinstance(values, dict):
        return str(values)
    values = {k: v for k, v in values.items() if k not in NOT_TEXT}
    strings = [v for v in values.values() if isinstance(v, str)]
    if len(strings) == 1:
        return strings[0]
    return json.dumps(values, ensure_ascii=False, default=str) if values else ""


def from_class(cls: type, kwargs: dict[str, Any]) -> Callable[[], OpenEnvTextEnv]:
    """A client per episode, ``cls(**kwargs)``, with the adapter options taken out of
    ``kwargs``; the default action is resolved here, so a bad one fails the worker's start."""
    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in OPTIONS if name in kwargs}
    field = options.pop("action_field", None)
    options = {k: load_object(v) if isinstance(v, str) else v for k, v in options.items()}
    if "action_from_text" not in options:
        options["action_from_text"] = text_action(action_class(cls), field)
    return lambda: OpenEnvTextEnv(cls(**kwargs), **options)
