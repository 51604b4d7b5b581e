"""The text-environment protocol, its checks, and the built-in ``ToolEnv`` (and ``calc``).

Why this shape: it is Gymnasium's, over chat messages, which is what users' text environments
already look like (OpenEnv, skyrl-gym and TRL adapters map onto it): ``reset(**task)`` returns
the opening messages, ``step(assistant_message)`` returns ``(messages, reward, done, info)``.
Either method may be sync or async. ``info`` may carry ``tool_errors`` (an int) and
``reward_parts`` (name -> number, logged as metrics); an environment may expose ``tools``
(OpenAI schemas) for the chat template. Environments are user code, so their outputs are
checked (``check_messages``, ``check_step``): a wrong shape is an ``EnvError``, which ends the
episode as a counted failure instead of corrupting it.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from rlfleet.agent.tools import ToolBox

Message = dict[str, Any]
StepResult = tuple[list[Message], float, bool, dict[str, Any]]
ROLES = frozenset({"system", "user", "assistant", "tool"})


class TextEnv(Protocol):
    """What ``run_episode`` drives; each method may also be a coroutine function."""

    def reset(self, **task: Any) -> list[Message] | Awaitable[list[Message]]: ...

    def step(self, assistant_message: Message) -> StepResult | Awaitable[StepResult]: ...


class EnvError(RuntimeError):
    """The environment broke the protocol (a non-message, a bad step tuple, ...)."""


def check_messages(value: object, where: str) -> list[Message]:
    """``value`` as a list of chat messages with a known role and text content."""
    if not isinstance(value, list | tuple):
        raise EnvError(f"{where} must return a list of messages, got {type(value).__name__}")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise EnvError(f"{where}: message {i} is a {type(message).__name__}, not a dict")
        if message.get("role") not in ROLES:
            raise EnvError(f"{where}: message {i} has role {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise EnvError(f"{where}: message {i} content must be a string")
    return list(value)


def check_step(value: object) -> StepResult:
    """``value`` as ``(messages, reward, done, info)``."""
    if not isinstance(value, tuple | list) or len(value) != 4:
        raise EnvError("step must return (messages, reward, done, info)")
    messages, reward, done, info = value
    reward, done = _plain(reward), _plain(done)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvError(f"step reward must be a finite number, got {reward!r}")
    if not isinstance(done, bool | int):
        raise EnvError(f"step done must be a bool, got {type(done).__name__}")
    if info is not None and not isinstance(info, dict):
        raise EnvError(f"step info must be a dict, got {type(info).__name__}")
    return check_messages(messages, "step"), float(reward), bool(done), dict(info or {})


def _plain(value: object) -> object:
    """A NumPy scalar (Gymnasium environments return them) as the Python number it holds."""
    item = getattr(value, "item", None)
    return item() if callable(item) and type(value).__module__ == "numpy" else value


def task_prompt(task: dict[str, Any]) -> list[Message]:
    """The opening messages of a task row: verl's ``prompt`` (messages, or a string for one
    user message), or ``messages``."""
    prompt = task.get("prompt", task.get("messages"))
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return check_messages(prompt, "the task's prompt")


def task_truth(task: dict[str, Any]) -> Any:
    """The task's answer: ``ground_truth``, or verl's ``reward_model.ground_truth``."""
    if "ground_truth" in task:
        return task["ground_truth"]
    return (task.get("reward_model") or {}).get("ground_truth")


class ToolEnv:
    """Answers tool calls with the ToolBox and ends when the assistant replies without one:
    reward = ``answer_checker(final_text, ground_truth)``. One instance per episode."""

    def __init__(
        self,
        tools: ToolBox | Sequence[Callable[..., Any] | str],
        answer_checker: Callable[[str, Any], float | bool],
    ) -> None:
        self.toolbox = tools if isinstance(tools, ToolBox) else ToolBox(tools)
        self.answer_checker = answer_checker
        self.truth: Any = None

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.toolbox.schemas

    async def reset(self, **task: Any) -> list[Message]:
        self.truth = task_truth(task)
        return task_prompt(task)

    async def step(self, assistant_message: Message) -> StepResult:
        if assistant_message.get("tool_calls") or assistant_message.get("tool_call_errors"):
            answers = await self.toolbox.answer(assistant_message)
            return answers.messages, 0.0, False, {"tool_errors": answers.errors}
        reward = float(self.answer_checker(assistant_message.get("content") or "", self.truth))
        return [], reward, True, {"reward_parts": {"answer": reward}}


def calc_env_factory(**toolbox_kwargs: Any) -> Callable[[], ToolEnv]:
    """The ``calc`` task: ToolEnv over ``rlfleet.tasks.calc``'s ``add`` and ``check_answer``
    (one ToolBox shared by the episodes)."""
    from rlfleet.tasks import calc

    toolbox = ToolBox(calc.TOOLS, **toolbox_kwargs)
    return lambda: ToolEnv(toolbox, calc.check_answer)


BUILTIN_ENVS: dict[str, Callable[..., Callable[[], Any]]] = {"calc": calc_env_factory}
"""Built-in environment names (``agent.env``) -> factory of per-episode environments."""
