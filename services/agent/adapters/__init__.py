"""Users' environments in other frameworks' conventions, run unchanged as text environments.

Why adapters and not one more protocol: people already have environments written for TRL,
OpenEnv or skyrl-gym, and tools for verl; each adapter maps one convention onto the loop's
``TextEnv`` protocol (``reset(**task) -> messages``, ``step(message) -> (messages, reward,
done, info)``), so the loop's checks (bad shapes, exceptions, timeouts, size) hold for all.

``agent.env = "module:attr"`` is recognised by what it names (``ENV_ADAPTERS``, first match):
a skyrl-gym ``Env`` subclass (``skyrl_env``), an OpenEnv ``EnvClient``/``SyncEnvClient``
subclass (``openenv_client``), a verifiers ``Environment`` subclass (``verifiers_env``), a TRL
``environment_factory`` class (``reset`` and no ``step``, ``trl_env``); any other class is a
TextEnv. A function is first matched against ``FUNCTION_ADAPTERS`` (an agent workflow by its
signature, ``workflow``; a verifiers ``load_environment``, called once); any other function is
a factory: what it returns is recognised by its class the same way, each episode. Workflows
and verifiers environments drive the router's OpenAI gateway themselves: the env worker calls
their ``play(task, GatewayRun)`` instead of the loop (``is_gateway_env``). The checks look
only at modules already imported, so an optional package loads only when the user's code
imports it. verl's tools YAML (``verl_tools``) is for ``agent.tools``, not ``agent.env``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlfleet.agent.adapters import openenv_client, skyrl_env, trl_env, verifiers_env, workflow
from rlfleet.agent.environment import BUILTIN_ENVS
from rlfleet.agent.tools import load_object

Maker = Callable[[], Any]
Recognises = Callable[[type], bool]
FromClass = Callable[[type, dict[str, Any]], Maker]
Wrap = Callable[[Any], Any]
ENV_ADAPTERS: tuple[tuple[Recognises, FromClass, Wrap], ...] = (
    (skyrl_env.is_skyrl_env, skyrl_env.from_class, skyrl_env.SkyRLTextEnv),
    (openenv_client.is_openenv_client, openenv_client.from_class, openenv_client.OpenEnvTextEnv),
    (verifiers_env.is_verifiers_env, verifiers_env.from_class, verifiers_env.VerifiersEnv),
    (trl_env.is_trl_environment, trl_env.from_class, trl_env.TRLEnv),
)
"""(recognises a class, makes per-episode envs from the class and kwargs, wraps an instance)."""
FUNCTION_ADAPTERS: tuple[tuple[Callable[[Any], bool], Callable[..., Maker]], ...] = (
    (workflow.is_workflow, workflow.from_workflow),
    (verifiers_env.is_load_environment, verifiers_env.from_load_environment),
)
"""(recognises a function, makes per-episode envs from it and kwargs): before the factory rule."""


def is_gateway_env(env: Any) -> bool:
    """An episode that drives the gateway itself (a workflow, a verifiers environment)."""
    return isinstance(env, workflow.WorkflowEnv | verifiers_env.VerifiersEnv)


def env_factory(target: Callable[..., Any], kwargs: dict[str, Any]) -> Maker:
    """A maker of one TextEnv per episode from what ``agent.env`` names, called with
    ``kwargs`` (a class by its kind; a factory's result by its class, each episode)."""
    if not isinstance(target, type):
        for recognises_function, from_function in FUNCTION_ADAPTERS:
            if recognises_function(target):
                return from_function(target, kwargs)
        return lambda: adapt(target(**kwargs))
    for recognises, from_class, _ in ENV_ADAPTERS:
        if recognises(target):
            return from_class(target, kwargs)
    return lambda: target(**kwargs)


def adapt(made: Any) -> Any:
    """An object a factory made, wrapped for its convention (a TextEnv as it is)."""
    for recognises, _, wrap in ENV_ADAPTERS:
        if recognises(type(made)):
            return wrap(made)
    return made


def load_env_factory(spec: str, env_kwargs: dict[str, Any] | None = None) -> Maker:
    """A maker of one environment per episode from ``agent.env``: a built-in name
    (``rlfleet.agent.environment.BUILTIN_ENVS``), or ``module:attr`` naming a class or factory (called
    with ``env_kwargs``): a TextEnv, or one that an adapter recognises and wraps. Here, not
    beside the built-ins, because the adapters build on ``rlfleet.agent.environment``."""
    kwargs = dict(env_kwargs or {})
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec](**kwargs)
    target = load_object(spec)
    if not callable(target):
        raise ValueError(f"agent.env {spec!r} is not a class or a factory")
    return env_factory(target, kwargs)
