"""Config section ``agent``: multi-turn episodes and the env role (``rlfleet env``) that runs them.

Why one section for both: what an episode is (its environment, tools and limits) and where it
runs (the env service and its workers) are read by the same processes, the env workers, and
the trainer needs only ``address`` and the limits. ``env`` empty means no agent mode: the
trainer samples single completions as before. Names are checked here for their form only
(``module:attr``); they are imported when a worker starts, so a config loads without them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlfleet.common.config.base import Section

BUILTIN_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
MultiCall = Literal["merge_prefixes", "every_call"]


class AgentConfig(Section):
    env: str = ""
    """The environment of an episode: a built-in name (``calc``), or an import path
    ``module:attr`` naming a text-env class or factory (``reset(**task)`` /
    ``step(message)``), called with ``env_kwargs`` once per episode; empty = no agent mode."""
    env_kwargs: dict[str, Any] = {}
    """Keyword arguments for the environment's class or factory (for a built-in: its options)."""
    tools: list[str] = []
    """Import paths (``module:attr``) of typed Python tool functions with docstrings, or a
    verl tools YAML (``multi_turn.tool_config_path``'s format: ``BaseTool``-shaped classes);
    given to the environment as ``tools=`` (a ToolBox), whose calls run with ``tool_timeout_s``."""
    max_turns: int = Field(8, ge=1, le=1024)
    """Assistant turns per episode before it ends as ``max_turns``."""
    max_episode_tokens: int = Field(512, ge=2)
    """Prompt + response tokens per episode (model and environment tokens); a turn's
    ``max_tokens`` shrinks to what is left, and the episode ends as ``token_budget``."""
    workers: int = Field(1, ge=0)
    """Episode workers in each env process (``--worker-only`` processes add more); 0 in the
    service process = only its front door, the episodes run in worker-only processes."""
    concurrency: int = Field(8, ge=1)
    """Episodes one worker plays at once (asyncio; each turn waits on the router)."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Longest one episode may take; past it the episode is a failed one (``error``)."""
    step_timeout_s: float = Field(60.0, gt=0)
    """Longest one call into the environment (``reset``, ``step``, building it) may take."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Longest one tool call may take; past it the model reads an error observation."""
    request_timeout_s: float = Field(3600.0, gt=0)
    """How long a RunEpisodes call waits for every episode of its batch."""
    reclaim_idle_s: float = Field(10.0, gt=0)
    """An episode pending this long on a silent (dead) worker is restarted by another."""
    host: str = "127.0.0.1"
    """Interface the env service's gRPC server binds to."""
    port: int = Field(50091, ge=0, le=65535)
    """Env service gRPC port (0 = any free one)."""
    address: str = "127.0.0.1:50091"
    """Where clients (the trainer) reach the env service."""
    gateway_url: str = ""
    """The router's OpenAI base URL (``http://host:port/v1``) for environments that drive the
    gateway themselves (agent workflows, verifiers environments); ``rlfleet up`` sets it."""
    gateway_session_ttl_s: float = Field(3600.0, gt=0)
    """Read by the router: a gateway session (``/rl/start_session``) not touched for this long
    expires, is counted (``/rl/stats``) and its calls are dropped."""
    multi_call: MultiCall = "merge_prefixes"
    """How the calls of a gateway session (an agent workflow, a verifiers environment) become
    trained records. ``merge_prefixes``: a call whose prompt starts with the previous record's
    tokens extends it (the tokens in between masked 0), any other call (history rewritten, a
    ``max_tokens`` cut re-rendered) starts a new record, a branch. ``every_call``: each call is
    a record of its own (its prompt, then what it sampled). Either way every sampled token is
    trained once and every branch gets the episode's reward and advantage (its GRPO group
    counts episodes, not branches); ``merge_prefixes`` trains the same tokens in fewer rows,
    so a token-native session is one row as in the loop."""

    @field_validator("env")
    @classmethod
    def _env_named(cls, value: str) -> str:
        if value and not (BUILTIN_ENV_NAME.match(value) or IMPORT_PATH.match(value)):
            raise ValueError(f"agent.env {value!r} must be a built-in name or module:attr")
        return value

    @field_validator("tools")
    @classmethod
    def _tools_are_import_paths(cls, value: list[str]) -> list[str]:
        bad = [p for p in value if not (IMPORT_PATH.match(p) or p.endswith((".yaml", ".yml")))]
        if bad:
            raise ValueError(
                f"agent.tools must be import paths module:attr or a verl tools YAML, got {bad}"
            )
        return value

    @model_validator(mode="after")
    def _timeouts_nest(self) -> AgentConfig:
        """A tool runs inside a step, a step inside an episode: each limit fits in the next."""
        if not self.tool_timeout_s <= self.step_timeout_s <= self.episode_timeout_s:
            raise ValueError(
                "agent timeouts must nest: tool_timeout_s <= step_timeout_s <= episode_timeout_s"
            )
        if self.episode_timeout_s > self.request_timeout_s:
            raise ValueError("agent.episode_timeout_s must not exceed agent.request_timeout_s")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        """Tools go to an environment named by import path; a built-in brings its own."""
        if self.tools and not self.env:
            raise ValueError("agent.tools needs agent.env (the environment that answers calls)")
        if self.tools and ":" not in self.env:
            raise ValueError(
                f"agent.tools: the built-in environment {self.env!r} brings its "
                "own tools; name an environment module:attr to give it these"
            )

    def check_model_len(self, max_model_len: int) -> None:
        """In agent mode an episode's whole context goes to a replica as one prompt."""
        if self.env and self.max_episode_tokens > max_model_len:
            raise ValueError(
                f"agent.max_episode_tokens={self.max_episode_tokens} > "
                f"rollout.max_model_len={max_model_len}: replicas could not take the last turns"
            )
