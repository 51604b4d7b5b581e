"""An OpenEnv environment (``openenv-core``) for the calc task: a server, and its typed client.

    python -m examples.agents.openenv_guess --port 8011      # the server (uvicorn)
    rlfleet up --config configs/agent_calc.yaml agent.env=examples.agents.openenv_guess:GuessClient \
        agent.env_kwargs='{base_url: "http://127.0.0.1:8011"}'

The host knows the task's numbers and their sum (the row's ``extra_info.numbers`` and
``reward_model.ground_truth``, which rlfleet passes to ``reset`` with the rest of the row less
its prompt), and the policy must guess the sum. The host is also the calculator: a turn that
calls ``add`` in the Hermes/Qwen format (``<tool_call>{"name": "add", "arguments": {"a": 1,
"b": 2}}</tool_call>``) is answered with the result; any other turn is a guess: right, it ends
the episode with reward 1; wrong, the host asks the question again (``12+34+56=``: digits, ``+``
and ``=``, which even the tiny calc policy's vocabulary encodes). The turn limit is rlfleet's
(``agent.max_turns``). Nothing here knows rlfleet: it is an OpenEnv environment as openenv's
template writes one, reached by its own client.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class GuessAction(Action):
    text: str = Field(..., description="The policy's turn: a guess, or add tool calls")


class GuessObservation(Observation):
    message: str = Field(default="", description="What the host says")


class GuessEnvironment(Environment):
    """One episode per session: the host's secret is the task's sum."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state, self.secret, self.question = State(), 0, ""

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              reward_model: dict[str, Any] | None = None, **row: Any) -> GuessObservation:  # fmt: skip
        self._state = State(episode_id=episode_id)
        self.secret = int((reward_model or {}).get("ground_truth", 0))
        numbers = (row.get("extra_info") or {}).get("numbers") or [self.secret]
        self.question = "+".join(map(str, numbers)) + "="
        return GuessObservation(message="")  # the task's prompt is the opening message

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:  # fmt: skip
        self._state.step_count += 1
        calls = TOOL_CALL.findall(action.text)
        if calls:
            return GuessObservation(message="\n".join(map(add_result, calls)), reward=0.0)
        guess = action.text.strip()
        if guess.isdigit() and int(guess) == self.secret:
            return GuessObservation(message="", done=True, reward=1.0)
        return GuessObservation(message=self.question, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def add_result(call: str) -> str:
    """The result of one ``add`` call, or why it could not be made."""
    try:
        parsed = json.loads(call)
        if parsed.get("name") != "add":
            return f"error: no tool {parsed.get('name')!r}"
        args = parsed.get("arguments") or {}
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"error: {type(exc).__name__}: {exc}"


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    """The typed client (one WebSocket session per client, so one per episode)."""

    def _step_payload(self, action: GuessAction) -> dict[str, Any]:
        return {"text": action.text}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[GuessObservation]:
        observation = GuessObservation(**payload.get("observation", {}),
                                       done=payload.get("done", False),
                                       reward=payload.get("reward"))  # fmt: skip
        return StepResult(observation, payload.get("reward"), payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


def make_app() -> Any:
    """The server's ASGI app: a session per client, as many as episodes in flight."""
    return create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=256)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    args = parser.parse_args()
    uvicorn.run(make_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
