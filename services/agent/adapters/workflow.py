"""Agent workflows: a black-box agent that talks to the gateway, trained from what it recorded.

The convention (AReaL's agent workflow, pinned in the architecture)::

    async def run(data, *, base_url, api_key, session_id) -> float | dict

``agent.env = "module:run"`` names it; it is recognised by its signature (a coroutine function
with keyword-only ``base_url`` and ``session_id``). ``data`` is the task row; ``base_url`` the
router's OpenAI base (``agent.gateway_url``, ending in ``/v1``) and ``api_key`` the fleet's key
(or ``"unused"``), ready for ``openai.AsyncOpenAI(base_url=..., api_key=...)``; the agent puts
``session_id`` on its calls (header ``X-Session-ID``, or ``user=``) so they are recorded.

Per episode the worker starts a gateway session, awaits the workflow, ends the session (always:
also when the workflow raised or ran past ``agent.episode_timeout_s``) and makes the Episode of
what the gateway recorded (``episode_of``): its tokens are the sampled ones, the reward is the
workflow's return (a number, or a dict with ``reward`` and the reward parts: a
``reward_parts`` mapping, or the other numeric items), else what the agent set with
``/rl/set_reward``. A workflow that raises, returns something else, sets no reward or calls
nothing through its session is a counted failed episode. Every call is trained: the gateway
answers the session's calls as ``Trajectory`` branches (``agent.multi_call``: exact prefixes
merged, or every call its own record), the last is the episode's main line and the others its
``earlier`` branches, each trained with the episode's reward. ``num_turns`` counts the calls.
The episode's ``generate_s`` is the router's time for its calls, ``env_s`` the rest of its
wall time (the agent's own work and its tools).

Session calls and dropped connections: 5.5% of a 256-episode step's episodes once failed
at ``/rl/end_session`` with ``httpx.ReadError``: the end went out on the connection the start
had opened, idle for the whole episode, and the router (uvicorn, idle connections closed
after 5 s) closed it just as the client (httpx, idle connections reused for up to 5 s) sent
on it. Now the router keeps idle connections 75 s (``common.http_server.KEEP_ALIVE_S``), the
session calls do not keep theirs, and a dropped answer is asked again where that is safe:
ending a session is idempotent (the gateway answers a second end with the same episode), so
``end`` is retried; starting one is not (a second start is a second session), so ``start`` is
retried only when the request never left (the connection could not be made).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from rlfleet.agent.episode import EndReason, Episode
from rlfleet.common import tls
from rlfleet.common.config.agent import MultiCall
from rlfleet.common.trajectory import Trajectory, TrajectoryError
from rlfleet.rollout.types import SamplingParams

log = logging.getLogger(__name__)
for _chatty in ("httpx", "httpx2"):  # a line per agent call at INFO would drown the worker's log
    logging.getLogger(_chatty).setLevel(logging.WARNING)

SESSION_CALL_TIMEOUT_S = 30.0
SESSION_CALL_TRIES = 4
RETRY_BASE_S = 0.25
Workflow = Callable[..., Awaitable[Any]]


class WorkflowError(RuntimeError):
    """The workflow broke the convention (its episode fails, with this message)."""


@dataclass(frozen=True)
class GatewayRun:
    """What an episode that drives the gateway needs from its worker."""

    base_url: str  # the gateway's OpenAI base, ending in /v1
    api_key: str | None
    episode_id: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_turns: int = 8
    multi_call: MultiCall = "merge_prefixes"  # how the session's calls become branches

    @property
    def key(self) -> str:
        return self.api_key or "unused"


def is_workflow(target: object) -> bool:
    """A coroutine function taking ``base_url`` and ``session_id`` as keyword-only arguments."""
    if not inspect.iscoroutinefunction(target):
        return False
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    keyword_only = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return {"base_url", "session_id"} <= keyword_only


def from_workflow(run: Workflow, kwargs: dict[str, Any]) -> Callable[[], WorkflowEnv]:
    """Per-episode makers of a workflow (``env_kwargs`` are passed to every call of it)."""
    return lambda: WorkflowEnv(run, kwargs)


class GatewaySessions:
    """The gateway's ``/rl/*`` routes, for one episode's worker."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout_s: float = SESSION_CALL_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        root = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A connection per call: the episode runs between start and end, longer than a server
        # keeps an idle connection, so reusing start's connection for end raced its close.
        self._http = httpx.AsyncClient(
            base_url=root,
            headers=headers,
            timeout=timeout_s,
            limits=httpx.Limits(max_keepalive_connections=0),
            transport=transport,
            verify=tls.client_ssl_context() or True,  # the fleet's CA and this role's certificate
        )

    async def start(self) -> str:
        answer = await self._post("/rl/start_session", {}, retry_on=httpx.ConnectError)
        return answer["session_id"]

    async def end(self, session_id: str, multi_call: MultiCall = "merge_prefixes") -> dict:
        body = {"session_id": session_id, "multi_call": multi_call}
        return await self._post("/rl/end_session", body, retry_on=httpx.TransportError)

    async def close(self) -> None:
        await self._http.aclose()

    async def _post(
        self, path: str, body: dict[str, Any], retry_on: type[Exception]
    ) -> dict[str, Any]:
        """POST ``body``; a ``retry_on`` failure is tried again (``SESSION_CALL_TRIES`` in all,
        backing off), what else fails raises."""
        for attempt in range(SESSION_CALL_TRIES):
            try:
                answer = await self._http.post(path, json=body)
                break
            except retry_on as exc:
                if attempt + 1 == SESSION_CALL_TRIES:
                    raise
                log.info("gateway %s: %s: %s; trying again", path, type(exc).__name__, exc)
                await asyncio.sleep(RETRY_BASE_S * 2**attempt)
        if answer.status_code != 200:
            raise WorkflowError(
                f"gateway {path} answered {answer.status_code}: {answer.text[:300]}"
            )
        return answer.json()


class WorkflowEnv:
    """One episode of a workflow (``play``); the env worker calls it instead of the loop."""

    def __init__(self, run: Workflow, kwargs: dict[str, Any]) -> None:
        self.run, self.kwargs = run, kwargs

    async def play(self, task: dict[str, Any], run: GatewayRun) -> Episode:
        async def drive(session_id: str) -> Any:
            return await self.run(
                task, base_url=run.base_url, api_key=run.key, session_id=session_id, **self.kwargs
            )

        return await play_in_session(run, drive, "workflow")


async def play_in_session(
    run: GatewayRun, drive: Callable[[str], Awaitable[Any]], what: str
) -> Episode:
    """Start a session, ``drive`` it, end it whatever happened, and the episode it recorded
    (a failed one when ``drive`` raised or broke the convention)."""
    sessions, started = GatewaySessions(run.base_url, run.api_key), time.perf_counter()
    try:
        session_id = await sessions.start()
        outcome, error = None, ""
        try:
            outcome = await drive(session_id)
        except Exception as exc:  # noqa: BLE001 - user code: its failure ends only its episode
            error = f"{what} raised {type(exc).__name__}: {exc}"
        finally:
            record = await _end_quietly(sessions, session_id, run.multi_call)
        episode = _episode(run.episode_id, record, outcome, error)
        episode.generate_s = float((record or {}).get("generate_s") or 0.0)
        episode.env_s = max(0.0, time.perf_counter() - started - episode.generate_s)
        return episode
    finally:
        await sessions.close()


async def _end_quietly(
    sessions: GatewaySessions, session_id: str, multi_call: MultiCall
) -> dict[str, Any] | None:
    """The ended session's record; None (logged) when the gateway could not end it, so that a
    timeout's cancellation still reaches the worker as a timeout."""
    try:
        return await sessions.end(session_id, multi_call)
    except Exception as exc:  # noqa: BLE001 - the episode fails either way
        log.warning("could not end gateway session %s: %s: %s", session_id, type(exc).__name__, exc)
        return None


def _episode(episode_id: str, record: dict | None, outcome: Any, error: str) -> Episode:
    if not error and record is None:
        error = "the gateway session could not be ended (see the worker's log)"
    if not error and record is not None:
        try:
            return episode_of(episode_id, record, outcome)
        except WorkflowError as exc:
            error = str(exc)
    return Episode(episode_id=episode_id, prompt_ids=[], end_reason=EndReason.ERROR, error=error)


def episode_of(episode_id: str, record: dict[str, Any], outcome: Any) -> Episode:
    """The Episode of an ended session's record (``/rl/end_session``'s answer) and the
    workflow's return: the last branch its main line, the others ``earlier``; WorkflowError
    when they do not make one."""
    if not record.get("branches"):
        raise WorkflowError("the workflow made no generation call through its session")
    try:
        *earlier, last = [Trajectory.from_dict(raw) for raw in record["branches"]]
    except TrajectoryError as exc:
        raise WorkflowError(f"the gateway's session record is not an episode: {exc}") from exc
    reward, parts = reward_of(outcome, record.get("reward"))
    episode = Episode(
        episode_id=episode_id,
        **vars(last),
        earlier=earlier,
        reward=reward,
        reward_parts=parts,
        num_turns=int(record.get("num_calls") or 0),
        tool_calls=int(record.get("tool_calls") or 0),
        tool_errors=int(record.get("tool_errors") or 0),
        messages=list(record.get("messages") or []),
    )
    episode.validate()
    return episode


def reward_of(outcome: Any, recorded: float | None) -> tuple[float, dict[str, float]]:
    """The reward and its parts from a workflow's return (or the session's set reward)."""
    if outcome is None:
        if recorded is None:
            raise WorkflowError("the workflow returned None and set no reward (/rl/set_reward)")
        return _number(recorded, "reward"), {}
    if isinstance(outcome, dict):
        if "reward" not in outcome:
            raise WorkflowError("a workflow's dict must hold 'reward'")
        parts = outcome.get("reward_parts")
        if parts is None:
            parts = {k: v for k, v in outcome.items() if k != "reward"}
        if not isinstance(parts, dict):
            raise WorkflowError("a workflow's reward_parts must be a dict of name to number")
        return _number(outcome["reward"], "reward"), {
            str(k): _number(v, f"reward part {k!r}") for k, v in parts.items()
        }
    return _number(outcome, "reward"), {}


def _number(value: Any, what: str) -> float:
    real = isinstance(value, int | float) and not isinstance(value, bool)
    if not real or not math.isfinite(value):
        raise WorkflowError(f"the workflow's {what} must be a finite number, got {value!r:.80}")
    return float(value)
