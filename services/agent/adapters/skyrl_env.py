"""skyrl-gym's ``BaseTextEnv`` subclasses as text environments, unchanged.

The convention (skyrl-gym 0.4): the trainer builds one environment per trajectory as
``EnvClass(env_config=..., extras=row)``, where ``extras`` is the dataset row (its
``reward_spec``, ``extra_info``, ...) and ``env_config`` an OmegaConf ``DictConfig`` that
environments read as attributes; ``init(prompt)`` returns ``(prompt, metadata)``; each
``step(action)`` gets the model's raw text and returns a ``BaseTextEnvStepOutput`` (a dict of
``observations``, ``reward``, ``done``, ``metadata``); ``close()`` frees it.

Here a class is built in ``reset``, since the row is known only then: ``env_config`` is
``agent.env_kwargs``, ``extras`` the row less ``prompt`` (a verl row's
``reward_model.ground_truth`` also becomes ``reward_spec``, skyrl's name for it). A per-step
reward is summed into the episode's, as skyrl-gym's turn-level rewards are meant. ``close`` is
called once, when the environment says done or the episode ends (the env worker's ``close()``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from rlfleet.agent.adapters.text import assistant_text, call
from rlfleet.agent.environment import (
    EnvError,
    Message,
    StepResult,
    check_step,
    task_prompt,
    task_truth,
)

STEP_KEYS = ("observations", "reward", "done")


def is_skyrl_env(cls: type) -> bool:
    """A subclass of skyrl-gym's ``Env`` (only when the user's code imported skyrl-gym)."""
    core = sys.modules.get("skyrl_gym.core")
    return core is not None and isinstance(cls, type) and issubclass(cls, core.Env)


class SkyRLTextEnv:
    """One episode of a skyrl-gym environment: a class (built in ``reset`` with the row) or an
    instance a factory made."""

    def __init__(self, env: Any, env_config: dict[str, Any] | None = None) -> None:
        self.env_class = env if isinstance(env, type) else None
        self.env: Any = None if isinstance(env, type) else env
        self.env_config, self.closed = dict(env_config or {}), False

    async def reset(self, **task: Any) -> list[Message]:
        if self.env_class is not None:
            config = as_config(self.env_config)
            self.env = await call(self.env_class, env_config=config, extras=extras_of(task))
        opened = await call(self.env.init, task_prompt(task))
        if not isinstance(opened, tuple | list) or len(opened) != 2:
            raise EnvError("init must return (prompt messages, metadata)")
        return opened[0]

    async def step(self, assistant_message: Message) -> StepResult:
        output = await call(self.env.step, assistant_text(assistant_message))
        if not isinstance(output, Mapping) or any(key not in output for key in STEP_KEYS):
            raise EnvError("step must return a BaseTextEnvStepOutput: observations, reward, done")
        info = {"metadata": output.get("metadata")}
        result = check_step((output["observations"], output["reward"], output["done"], info))
        if result[2]:
            await self.close()
        return result

    async def close(self) -> None:
        """Closes the environment once (at done, and the env worker closes every episode's)."""
        if self.env is not None and not self.closed:
            self.closed = True
            await call(self.env.close)


def extras_of(task: dict[str, Any]) -> dict[str, Any]:
    """The row as skyrl-gym's ``extras``: everything but the prompt, with a ``reward_spec``."""
    extras = {key: value for key, value in task.items() if key not in ("prompt", "messages")}
    truth = task_truth(task)
    if "reward_spec" not in extras and truth is not None:
        extras["reward_spec"] = {"method": "rule", "ground_truth": truth}
    return extras


def as_config(values: dict[str, Any]) -> Any:
    """``env_config`` as skyrl-gym environments read it: an OmegaConf DictConfig."""
    from omegaconf import OmegaConf

    return OmegaConf.create(values)


def from_class(cls: type, kwargs: dict[str, Any]) -> Callable[[], SkyRLTextEnv]:
    return lambda: SkyRLTextEnv(cls, kwargs)
