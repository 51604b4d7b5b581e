"""The agent gateway's session routes and the recording of a session's calls.

Why on the router's HTTP front: a black-box agent written with the ``openai`` client trains
unchanged when it is pointed at the router (``base_url`` = the router's ``/v1``) and its calls
carry a session id; the router samples them as any other call (sticky on the session, so the
conversation keeps its replica's prefix cache) and records what it sampled. Routes, in
AReaL's shape (behind the API key like the rest of the front)::

    POST /rl/start_session  {}                        -> {"session_id": "rls-..."}
    POST /rl/set_reward     {"session_id", "reward"}  -> {"session_id", "reward"}
    POST /rl/end_session    {"session_id", "reward"?, "multi_call"?}
                            -> the episode (trajectory.session_episode); asked again, the same
    GET  /rl/stats                                    -> started, ended, expired, segmented, ...

A chat or completion call whose session id (``X-Session-ID`` header, else ``user``) is a
minted ``rls-`` id is checked before sampling (404 unknown/foreign/expired, 409 ended, each
naming the field that carried it) and recorded after it, one choice only (``n`` 1). Any other
session id is a plain sticky-routing id, recorded nowhere, as before the gateway.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from rlfleet.common.config.agent import MultiCall
from rlfleet.rollout.gateway.sessions import (
    BadSessionField,
    SessionStore,
    check_reward,
    check_session_id,
    is_session_id,
)
from rlfleet.rollout.gateway.trajectory import CallRecord

log = logging.getLogger(__name__)


class StartBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # AReaL sends task metadata; kept nowhere


class RewardBody(BaseModel):
    session_id: str
    reward: float


class EndBody(BaseModel):
    session_id: str
    reward: float | None = None
    multi_call: MultiCall = "merge_prefixes"  # how the calls become branches (trajectory.py)


class Recorder:
    """Checks and records the calls that carry a gateway session id."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    async def before(self, session: str, from_header: bool, samples: int) -> str | None:
        """The field that carried a gateway session id (None: not a session call); raises
        for a session that cannot take the call (``samples``: answers the call asks for)."""
        if not is_session_id(session):
            return None
        param = "X-Session-ID" if from_header else "user"
        if samples != 1:
            raise BadSessionField(
                f"n must be 1 in a recorded session, with one prompt (the "
                f"call asks for {samples} answers): a session is one "
                "conversation",
                "n",
            )
        await self.store.check_open(session, param)
        return param

    async def after(self, session: str, param: str | None, records: Sequence[CallRecord]) -> None:
        if param is not None:
            await self.store.record(session, list(records), param)


def add_session_routes(app: FastAPI, store: SessionStore, auth: list[Any]) -> None:
    """``/rl/start_session``, ``/rl/set_reward``, ``/rl/end_session``, ``/rl/stats``."""

    @app.post("/rl/start_session", dependencies=auth)
    async def start_session(body: StartBody | None = None) -> dict[str, str]:
        session_id = await store.start()
        log.debug("session %s started", session_id)
        return {"session_id": session_id}

    @app.post("/rl/set_reward", dependencies=auth)
    async def set_reward(body: RewardBody) -> dict[str, Any]:
        reward = check_reward(body.reward)
        await store.set_reward(check_session_id(body.session_id), reward)
        return {"session_id": body.session_id, "reward": reward}

    @app.post("/rl/end_session", dependencies=auth)
    async def end_session(body: EndBody) -> dict[str, Any]:
        reward = None if body.reward is None else check_reward(body.reward)
        episode = await store.end(check_session_id(body.session_id), reward, body.multi_call)
        if not episode["token_native"]:
            log.debug(
                "session %s: %d calls in %d branches (a prompt did not extend the one before)",
                body.session_id,
                episode["num_calls"],
                episode["num_branches"],
            )
        return episode

    @app.get("/rl/stats", dependencies=auth)
    async def stats() -> dict[str, int]:
        return await store.stats()
