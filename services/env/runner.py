"""Playing one queued episode on a worker: a fresh environment, every turn through the router.

Why a room of its own: the worker (``worker.py``) is about the queue (take, keep alive,
answer); this is about the episode. ``EpisodeRunner.play`` never raises for the episode's
sake: whatever goes wrong (the environment cannot be built, raises, hangs past
``agent.episode_timeout_s``, the router is unreachable) is a failed episode, an
``EpisodeOutcome`` with ``error`` set and an episode whose ``end_reason`` is ``error``, so a
bad environment never takes its worker down. The episode itself is
``rlfleet.agent.loop.run_episode``; turns go to the router with ``session_id`` = the episode
id (``RouterTurnGenerator``), and ``ReplicaLog`` notes which replica served each turn.

The worker needs only the tokenizer of ``model.path`` (for the chat template), never a torch
model; it and the environment are resolved once per process (``load_renderer``,
``env_maker``), when the worker starts, so a misnamed environment fails the start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from rlfleet.agent.adapters import is_gateway_env, load_env_factory
from rlfleet.agent.adapters.verl_tools import load_toolbox
from rlfleet.agent.adapters.workflow import GatewayRun
from rlfleet.agent.environment import BUILTIN_ENVS
from rlfleet.agent.episode import Episode
from rlfleet.agent.invoke import invoke
from rlfleet.agent.loop import RouterTurnGenerator, run_episode
from rlfleet.agent.render import ChatRenderer
from rlfleet.common.config.agent import AgentConfig
from rlfleet.env.types import EpisodeOutcome, QueuedEpisode, failed_episode
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import GenerateRequest, GenerateResult

log = logging.getLogger(__name__)


def load_renderer(model_path: str) -> ChatRenderer:
    """The chat renderer of ``model_path``'s tokenizer (transformers imported only here)."""
    from rlfleet.model.model_io import load_tokenizer

    return ChatRenderer(load_tokenizer(model_path))


def env_maker(agent: AgentConfig) -> Callable[[], Any]:
    """One environment per call, from ``agent.env``: a built-in gets ``tool_timeout_s`` for
    its tools (unless ``env_kwargs`` set one); an import path gets ``tools=`` a ToolBox of
    ``agent.tools`` when there are any. Raises ValueError for a name that resolves to nothing."""
    kwargs = dict(agent.env_kwargs)
    if agent.env in BUILTIN_ENVS:
        kwargs.setdefault("timeout_s", agent.tool_timeout_s)
    elif agent.tools:
        kwargs["tools"] = load_toolbox(agent.tools, timeout_s=agent.tool_timeout_s)
    return load_env_factory(agent.env, kwargs)


class ReplicaLog:
    """A RolloutClient stand-in for ``RouterTurnGenerator`` that notes the replica of each turn."""

    def __init__(self, client: RolloutClient) -> None:
        self.client = client
        self.replica_ids: list[str] = []

    async def generate(
        self, request: GenerateRequest, timeout_s: float | None = None
    ) -> GenerateResult:
        result = await self.client.generate(request, timeout_s)
        self.replica_ids.append(result.replica_id)
        return result


class EpisodeRunner:
    """Plays episodes for one worker: ``make_env`` per episode, turns through ``client``."""

    def __init__(
        self,
        make_env: Callable[[], Any],
        renderer: ChatRenderer,
        client: RolloutClient,
        agent: AgentConfig,
        api_key: str | None = None,
    ) -> None:
        self.make_env, self.renderer, self.client, self.agent = make_env, renderer, client, agent
        self.api_key = api_key  # what a gateway-driven environment sends the gateway
        self.played = self.failed = 0

    async def play(self, queued: QueuedEpisode, restarts: int = 0) -> EpisodeOutcome:
        """The episode's outcome; never raises for the episode's sake (see the module doc)."""
        replicas = ReplicaLog(self.client)
        episode = await self._episode(queued, replicas)
        self.played += 1
        if episode.failed:
            self.failed += 1
            log.warning("episode %s failed: %s", queued.job.episode_id, episode.error)
        error = (episode.error or "failed") if episode.failed else ""
        return EpisodeOutcome(
            queued.job.episode_id, episode.encode(), error, restarts, replicas.replica_ids
        )

    async def _episode(self, queued: QueuedEpisode, replicas: ReplicaLog) -> Episode:
        episode_id, limit = queued.job.episode_id, asyncio.timeout(self.agent.episode_timeout_s)
        try:
            async with limit:
                return await self._run(queued, replicas)
        except TimeoutError as exc:
            why = (
                f"episode timed out after {self.agent.episode_timeout_s:g}s"
                if limit.expired()
                else f"{type(exc).__name__}: {exc}"
            )
            return failed_episode(episode_id, why)
        except Exception as exc:  # noqa: BLE001 - one episode's failure, never the worker's
            return failed_episode(episode_id, f"{type(exc).__name__}: {exc}")

    async def _run(self, queued: QueuedEpisode, replicas: ReplicaLog) -> Episode:
        job, settings = queued.job, queued.settings
        env = await invoke(self.make_env, timeout_s=self.agent.step_timeout_s)
        if is_gateway_env(env):  # a workflow or verifiers env: it samples through the gateway
            return await env.play(job.task, self._gateway_run(queued))
        generate = RouterTurnGenerator(replicas, min_weight_version=job.min_weight_version)  # type: ignore[arg-type]
        try:
            return await run_episode(
                env,
                job.task,
                generate,
                self.renderer,
                max_turns=settings.max_turns,
                max_episode_tokens=settings.max_episode_tokens,
                sampling=settings.sampling,
                episode_id=job.episode_id,
                step_timeout_s=self.agent.step_timeout_s,
            )
        finally:
            await self._close(env)

    def _gateway_run(self, queued: QueuedEpisode) -> GatewayRun:
        if not self.agent.gateway_url:
            raise ValueError(
                f"agent.env {self.agent.env!r} samples through the router's OpenAI "
                "gateway: set agent.gateway_url (rlfleet up sets it)"
            )
        return GatewayRun(
            self.agent.gateway_url,
            self.api_key,
            queued.job.episode_id,
            queued.settings.sampling,
            queued.settings.max_turns,
            self.agent.multi_call,
        )

    async def _close(self, env: Any) -> None:
        """``env.close()`` when it has one (OpenEnv clients, sandboxes); its failure is logged."""
        close = getattr(env, "close", None)
        if not callable(close):
            return
        try:
            await invoke(close, timeout_s=self.agent.step_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the episode is over either way
            log.warning("environment close() failed: %s: %s", type(exc).__name__, exc)
