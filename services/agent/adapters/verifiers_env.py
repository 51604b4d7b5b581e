"""verifiers environments (``verifiers==0.3.1``, ``import verifiers as vf``) run unchanged.

A verifiers environment (``vf.SingleTurnEnv``, ``vf.ToolEnv``, a ``vf.MultiTurnEnv`` subclass
with ``env_response`` and its stop conditions, scored by its ``vf.Rubric``) drives its own
rollout: ``env.run_rollout(input, client, model, sampling_args)`` asks an OpenAI-compatible
client for each assistant turn (``vf.OpenAIChatCompletionsClient`` over an
``openai.AsyncOpenAI``), runs its tools or ``env_response`` between turns, and scores the
finished rollout with its rubric. Here that client points at the router's gateway, with the
episode's gateway session as ``X-Session-ID``, so every turn is sampled by the fleet and
recorded there token by token (``workflow.play_in_session``): the trained tokens are the
sampled ones, never the environment's re-rendering of them. Reward: the rubric's ``reward``;
its ``metrics`` are the reward parts. A rollout that ends in an error (the environment's
``state["error"]``) is a failed episode with that error.

``agent.env`` names either the module's ``load_environment`` (called once per worker with
``agent.env_kwargs``; recognised by its name while ``verifiers`` is imported) or an
``Environment`` subclass (built once with ``env_kwargs``). The environment object is shared by
the worker's episodes, as verifiers shares it across rollouts (its state is per rollout).
A task row is a rollout input: verl's ``prompt`` (messages, or a string) or verifiers'
``question`` (then the environment's ``system_prompt`` and ``few_shot`` go first, as its own
dataset formatting does), ``answer`` (else ``reward_model.ground_truth``) and ``info`` (else
``extra_info``). Nothing here imports verifiers unless the user's module did.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from rlfleet.agent.adapters.workflow import GatewayRun, WorkflowError, play_in_session
from rlfleet.agent.environment import task_truth
from rlfleet.agent.episode import Episode
from rlfleet.common import tls
from rlfleet.rollout.types import SamplingParams

ENVIRONMENT_MODULE = "verifiers.legacy.envs.environment"
MODEL_NAME = "policy"  # the gateway ignores the model name of a session's calls


def _environment_class() -> type | None:
    module = sys.modules.get(ENVIRONMENT_MODULE)
    return getattr(module, "Environment", None) if module is not None else None


def is_verifiers_env(cls: type) -> bool:
    """A subclass of verifiers' ``Environment`` (only once verifiers is imported)."""
    base = _environment_class()
    return base is not None and isinstance(cls, type) and issubclass(cls, base)


def is_load_environment(target: object) -> bool:
    """A module's ``load_environment`` function while verifiers is imported."""
    return (
        callable(target)
        and not isinstance(target, type)
        and "verifiers" in sys.modules
        and getattr(target, "__name__", "") == "load_environment"
    )


def from_class(cls: type, kwargs: dict[str, Any]) -> Callable[[], VerifiersEnv]:
    """One environment built now, shared by the episodes of this worker."""
    shared = VerifiersEnv(keeping_signals(lambda: cls(**kwargs)))
    return lambda: shared


def from_load_environment(load: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[[], Any]:
    """``load_environment(**env_kwargs)`` called once; ValueError when it is not verifiers'."""
    env = keeping_signals(lambda: load(**kwargs))
    if not is_verifiers_env(type(env)):
        raise ValueError(
            f"load_environment returned a {type(env).__name__}, not a verifiers "
            "Environment (vf.SingleTurnEnv, vf.ToolEnv, vf.MultiTurnEnv, ...)"
        )
    shared = VerifiersEnv(env)
    return lambda: shared


def keeping_signals(build: Callable[[], Any]) -> Any:
    """``build()`` with the process's SIGINT/SIGTERM handlers put back afterwards: a verifiers
    ``Environment`` installs its own (teardown, then exit 143), which would replace the env
    worker's graceful stop (finish or hand back the episodes in flight)."""
    if threading.current_thread() is not threading.main_thread():
        return build()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return build()
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


class VerifiersEnv:
    """Plays a verifiers environment's rollouts through the gateway (``play``)."""

    def __init__(self, env: Any) -> None:
        self.env = env

    async def play(self, task: dict[str, Any], run: GatewayRun) -> Episode:
        async def drive(session_id: str) -> dict[str, float]:
            output = await self._rollout(task, run, session_id)
            return outcome_of(output)

        return await play_in_session(run, drive, "verifiers environment")

    async def _rollout(self, task: dict[str, Any], run: GatewayRun, session_id: str) -> Any:
        import verifiers as vf
        from openai import AsyncOpenAI

        client = AsyncOpenAI(
            base_url=run.base_url,
            api_key=run.key,
            max_retries=0,
            default_headers={"X-Session-ID": session_id},
            http_client=fleet_http_client(),
        )
        try:
            return await self.env.run_rollout(
                rollout_input(self.env, task),
                vf.OpenAIChatCompletionsClient(client),
                MODEL_NAME,
                sampling_args(run.sampling),
            )
        finally:
            await client.close()


def rollout_input(env: Any, task: dict[str, Any]) -> dict[str, Any]:
    """A task row as verifiers' ``RolloutInput`` (see the module doc)."""
    truth = task.get("answer", task_truth(task))
    info = task.get("info", task.get("extra_info")) or {}
    return {
        "prompt": _prompt(env, task),
        "example_id": int(task.get("example_id", 0) or 0),
        "answer": "" if truth is None else str(truth),
        "info": info,
    }


def _prompt(env: Any, task: dict[str, Any]) -> list[dict[str, Any]]:
    system = getattr(env, "system_prompt", None)
    if "prompt" not in task and "messages" not in task and "question" in task:
        opening = [{"role": "system", "content": system}] if system else []
        few_shot = list(getattr(env, "few_shot", None) or [])
        return [*opening, *few_shot, {"role": "user", "content": str(task["question"])}]
    prompt = task.get("prompt", task.get("messages"))
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list):
        raise WorkflowError("the task row has no prompt (messages), messages or question")
    first = prompt[0].get("role") if prompt and isinstance(prompt[0], dict) else None
    return (
        [{"role": "system", "content": system}, *prompt]
        if system and first != "system"
        else list(prompt)
    )


def sampling_args(sampling: SamplingParams) -> dict[str, Any]:
    """The fleet's per-turn sampling as verifiers' ``sampling_args`` (OpenAI's names)."""
    args: dict[str, Any] = {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "extra_body": {"return_token_ids": True},
    }
    if sampling.seed is not None:
        args["seed"] = sampling.seed
    return args


def outcome_of(output: Any) -> dict[str, Any]:
    """The rubric's reward and metrics as the episode's reward and parts; WorkflowError for
    a rollout that ended in an error."""
    error = output.get("error")
    if error:
        raise WorkflowError(f"the verifiers rollout failed: {_error_text(error)}")
    metrics = output.get("metrics") or {}
    parts = {str(k): float(v) for k, v in metrics.items() if _finite(v)}
    return {"reward": output.get("reward") or 0.0, "reward_parts": parts}


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("error_chain_repr") or error.get("error") or error)[:500]
    return str(error)[:500]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def fleet_http_client() -> Any:
    """None (the ``openai`` client's own) unless this role dials TLS: then one that trusts the
    fleet's CA and presents this role's certificate (the gateway may require it)."""
    context = tls.client_ssl_context()
    if context is None:
        return None
    from openai import DefaultAsyncHttpxClient

    return DefaultAsyncHttpxClient(verify=context)
