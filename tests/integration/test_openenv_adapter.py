"""OpenEnv environments through ``agent.env``, against a real OpenEnv server: openenv-core's
``create_app`` over a guess-the-number ``Environment`` written here, served by uvicorn in a
child process on a free port, and reached by the real clients (a typed ``EnvClient`` subclass,
its ``.sync()`` wrapper, and ``GenericEnvClient``) over their WebSocket sessions.

Checked: the row (less its prompt) reaches the server's ``reset``, each assistant turn is an
action, each observation a user message, step rewards add up, concurrent episodes keep their
own server sessions, and a server-side exception is a counted failed episode. The server is
stopped by its own PID.
"""

from __future__ import annotations

import asyncio
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.env_server")
from openenv.core import EnvClient  # noqa: E402
from openenv.core.client_types import StepResult  # noqa: E402
from openenv.core.env_server import Action, Environment, Observation, State, create_app  # noqa: E402
from pydantic import Field  # noqa: E402

from rlfleet.agent.adapters import load_env_factory  # noqa: E402
from rlfleet.agent.adapters.openenv_client import OpenEnvTextEnv  # noqa: E402
from rlfleet.agent.episode import EndReason, Episode  # noqa: E402

pytestmark = pytest.mark.slow


class GuessAction(Action):
    guess: str = Field(..., description="The guessed number, as text")


class GuessObservation(Observation):
    message: str = Field(default="", description="What the host says")


class GuessEnvironment(Environment):
    """The host thinks of ``secret`` (1-9) and answers higher/lower; a guess of 0 raises."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state, self.secret = State(), 5

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, secret: int = 5, **kwargs: Any
    ) -> GuessObservation:
        self._state, self.secret = State(episode_id=episode_id), int(secret)
        return GuessObservation(message="Guess a number from 1 to 9.")

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        guess = int(action.guess) if action.guess.strip().isdigit() else -1
        if guess == 0:
            raise RuntimeError("the host fell over")
        self._state.step_count += 1
        if guess == self.secret:
            return GuessObservation(message="correct", done=True, reward=1.0)
        return GuessObservation(message="higher" if guess < self.secret else "lower", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    """The typed client, as openenv's template writes one."""

    def _step_payload(self, action: GuessAction) -> dict[str, Any]:
        return {"guess": action.guess}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[GuessObservation]:
        observation = GuessObservation(
            **payload.get("observation", {}),
            done=payload.get("done", False),
            reward=payload.get("reward"),
        )
        return StepResult(observation, payload.get("reward"), payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


def make_app() -> Any:
    """The server's app (uvicorn ``--factory``)."""
    return create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=8)


def make_sync_client(base_url: str) -> Any:
    """A factory returning the sync wrapper, as a user's factory may."""
    return GuessClient(base_url=base_url).sync()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from procs import ServiceProcess

    from rlfleet.common.redis_server import free_port

    port, here = free_port(), Path(__file__).parent
    log = tmp_path_factory.mktemp("openenv") / "server.log"
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "test_openenv_adapter:make_app",
        "--app-dir",
        str(here),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = ServiceProcess.start(argv, log, "openenv-server")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_until(lambda: _healthy(url), 120, "serving /health")
        yield url
    finally:
        proc.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


async def play(env: Any, turns: list[str], secret: int, episode_id: str = "ep-oe") -> Episode:
    from unit.agent_fixtures import ScriptedGenerator, agent_tokenizer

    from rlfleet.agent.loop import run_episode
    from rlfleet.agent.render import ChatRenderer
    from rlfleet.rollout.types import SamplingParams

    task = {"prompt": "Find the number.", "secret": secret}
    return await run_episode(
        env,
        task,
        ScriptedGenerator(turns),
        ChatRenderer(agent_tokenizer()),
        max_turns=6,
        max_episode_tokens=512,
        step_timeout_s=30.0,
        sampling=SamplingParams(max_tokens=16),
        episode_id=episode_id,
    )


async def test_an_episode_against_a_real_openenv_server(server: str) -> None:
    env = load_env_factory("test_openenv_adapter:GuessClient", {"base_url": server})()
    assert isinstance(env, OpenEnvTextEnv) and isinstance(env.client, GuessClient)
    episode = await play(env, ["5", "3", "4"], secret=4)
    assert (episode.end_reason, episode.reward, episode.num_turns) == (EndReason.DONE, 1.0, 3)
    assert [(m["role"], m["content"]) for m in episode.messages] == [
        ("user", "Find the number."),
        ("user", "Guess a number from 1 to 9."),
        ("assistant", "5"),
        ("user", "lower"),
        ("assistant", "3"),
        ("user", "higher"),
        ("assistant", "4"),
        ("user", "correct"),
    ]
    assert env.client._ws is None  # closed at done: the server session is freed


async def test_concurrent_episodes_keep_their_own_sessions(server: str) -> None:
    make = load_env_factory("test_openenv_adapter:GuessClient", {"base_url": server})
    secrets = [2, 7, 9]
    episodes = await asyncio.gather(*(play(make(), [str(s)], s, f"ep-{s}") for s in secrets))
    assert [(e.end_reason, e.reward) for e in episodes] == [(EndReason.DONE, 1.0)] * 3


async def test_a_sync_client_factory_and_the_generic_client(server: str) -> None:
    sync_env = load_env_factory("test_openenv_adapter:make_sync_client", {"base_url": server})()
    episode = await play(sync_env, ["1", "2"], secret=2)
    assert (episode.end_reason, episode.reward, episode.num_turns) == (EndReason.DONE, 1.0, 2)
    generic = load_env_factory(
        "openenv.core.generic_client:GenericEnvClient",
        {"base_url": server, "action_field": "guess"},
    )()
    episode = await play(generic, ["8", "6"], secret=6)
    assert (episode.end_reason, episode.reward) == (EndReason.DONE, 1.0)
    assert episode.messages[3] == {"role": "user", "content": "lower"}
    with pytest.raises(ValueError, match="set action_field or action_from_text"):
        load_env_factory("openenv.core.generic_client:GenericEnvClient", {"base_url": server})


async def test_a_server_side_exception_is_a_failed_episode(server: str) -> None:
    env = load_env_factory("test_openenv_adapter:GuessClient", {"base_url": server})()
    episode = await play(env, ["0"], secret=3)
    assert episode.failed and "step raised RuntimeError: Server error" in episode.error
    assert "the host fell over" in episode.error
    await env.close()  # what the env worker does after every episode
    assert env.client._ws is None and env.closed
