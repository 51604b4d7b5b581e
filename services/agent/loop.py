"""One episode: generate a turn, let the environment answer, append its tokens, repeat.

Why token-native: each turn's input is the previous input plus the sampled ids untouched plus
the renderer's ``environment_ids`` for the observation, so nothing sampled is decoded and
re-encoded (decoding happens only to show the environment the assistant's text). Every turn
goes to the generator with ``session_id`` = the episode id, so a router keeps the episode on one
replica and its prefix cache.

How it ends (``EndReason``): the environment says done; ``max_turns`` assistant turns; the
token budget (``max_episode_tokens`` counts prompt + response; a turn's ``max_tokens`` shrinks
to what is left, and an observation that would not leave room for one more token is not
appended); or an error of the environment (it raised, timed out, returned a non-message or an
observation over ``max_observation_chars``), which ends the episode with its text in ``error``
as a counted failed episode, never an exception. A failure of generation itself (router
unreachable) does raise: the caller's retry policy decides, as for a single completion.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from rlfleet.agent.environment import EnvError, Message, check_messages, check_step
from rlfleet.agent.episode import EndReason, Episode
from rlfleet.agent.invoke import invoke
from rlfleet.agent.render import ChatRenderer
from rlfleet.agent.tool_calls import parse_tool_calls
from rlfleet.common.trajectory import token_versions
from rlfleet.rollout.types import GenerateRequest, GenerateResult, SamplingParams

MAX_OBSERVATION_CHARS = 64 * 1024
STEP_TIMEOUT_S = 300.0
LENGTH = "length"


@dataclass
class SampledTurn:
    """One generation: the sampled ids, their log-probs, and the weight version that sampled
    them (``token_versions``, one per token, when the engine reports them)."""

    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str = "stop"
    token_versions: list[int] = field(default_factory=list)

    def versions(self) -> list[int]:
        """The weight version of every sampled token (the turn's when it has none per token)."""
        return token_versions(self.token_versions, len(self.token_ids), self.weight_version)


class TurnGenerator(Protocol):
    """Samples one turn; ``session_id`` is the episode id on every turn."""

    async def __call__(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str
    ) -> SampledTurn: ...


class Router(Protocol):
    """What a turn generator needs of the router (``rlfleet.rollout.client.RolloutClient``)."""

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...


class RouterTurnGenerator:
    """Turns through a router (``RolloutClient.generate``), prompt as token ids."""

    def __init__(
        self, client: Router, *, timeout_s: float = 0.0, min_weight_version: int = 0
    ) -> None:
        self.client, self.timeout_s, self.min_weight_version = client, timeout_s, min_weight_version

    async def __call__(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str
    ) -> SampledTurn:
        request = GenerateRequest(
            request_id=f"{session_id[:200]}-{uuid.uuid4().hex[:12]}",
            sampling=replace(sampling, n=1, logprobs=1),
            prompt_token_ids=list(prompt_ids),
            session_id=session_id,
            min_weight_version=self.min_weight_version,
            timeout_s=self.timeout_s,
        )
        return turn_of(await self.client.generate(request))


def turn_of(result: GenerateResult) -> SampledTurn:
    """The first completion of a result as a turn, each token's weight version with it."""
    completion = result.completions[0]
    return SampledTurn(
        list(completion.token_ids),
        list(completion.logprobs),
        result.weight_version,
        completion.finish_reason,
        completion.versions(result.weight_version),
    )


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_episode_tokens: int
    step_timeout_s: float = STEP_TIMEOUT_S
    max_observation_chars: int = MAX_OBSERVATION_CHARS


async def run_episode(
    env: Any,
    task: dict[str, Any],
    generate: TurnGenerator,
    renderer: ChatRenderer,
    *,
    max_turns: int,
    max_episode_tokens: int,
    sampling: SamplingParams,
    episode_id: str,
    step_timeout_s: float = STEP_TIMEOUT_S,
    max_observation_chars: int = MAX_OBSERVATION_CHARS,
) -> Episode:
    """Play one episode of ``env`` on ``task`` (a dataset row, passed to ``reset``)."""
    limits = Limits(max_turns, max_episode_tokens, step_timeout_s, max_observation_chars)
    run = _EpisodeRun(
        env, generate, renderer, limits, sampling, Episode(episode_id=episode_id, prompt_ids=[])
    )
    try:
        await run.start(task)
        await run.play()
    except (_EnvFailure, EnvError) as exc:
        run.episode.end_reason, run.episode.error = EndReason.ERROR, str(exc)
    return run.episode


class _EnvFailure(Exception):
    """The environment's fault: ends the episode as ``error``."""


@dataclass
class _EpisodeRun:
    env: Any
    generate: TurnGenerator
    renderer: ChatRenderer
    limits: Limits
    sampling: SamplingParams
    episode: Episode

    async def start(self, task: dict[str, Any]) -> None:
        messages = check_messages(await self._env_call("reset", **task), "reset")
        self.episode.messages.extend(messages)
        tools = await self._env_part(lambda: getattr(self.env, "tools", None))
        ids = await self._env_part(lambda: self.renderer.initial_prompt_ids(messages, tools))
        self.episode.prompt_ids = ids

    async def play(self) -> None:
        for turn_number in range(1, self.limits.max_turns + 1):
            left = self.limits.max_episode_tokens - self.episode.total_tokens
            if left <= 0:
                return self._end(EndReason.TOKEN_BUDGET)
            turn = await self._sample(left)
            if turn.finish_reason == LENGTH and turn.token_ids and len(turn.token_ids) >= left:
                return self._end(EndReason.TOKEN_BUDGET)
            observation, done = await self._step(self._assistant_message(turn))
            if done:
                return self._end(EndReason.DONE)
            if turn_number == self.limits.max_turns:
                break
            if not await self._append_environment(turn, observation):
                return self._end(EndReason.TOKEN_BUDGET)
        self._end(EndReason.MAX_TURNS)

    async def _sample(self, left: int) -> SampledTurn:
        sampling = replace(
            self.sampling, n=1, logprobs=1, max_tokens=min(self.sampling.max_tokens, left)
        )
        started = time.perf_counter()
        prompt = self.episode.prompt_ids + self.episode.response_ids
        turn = await self.generate(prompt, sampling, self.episode.episode_id)
        self.episode.generate_s += time.perf_counter() - started
        self.episode.extend_sampled(list(turn.token_ids), list(turn.logprobs), turn.versions())
        self.episode.num_turns += 1
        return turn

    def _assistant_message(self, turn: SampledTurn) -> Message:
        text = self.renderer.decode_turn(turn.token_ids)
        parsed = parse_tool_calls(text, first_index=self.episode.tool_calls)
        self.episode.tool_calls += parsed.attempted
        message = parsed.message()
        self.episode.messages.append(message)
        return message

    async def _step(self, message: Message) -> tuple[list[Message], bool]:
        observation, reward, done, info = check_step(await self._env_call("step", message))
        self._check_size(observation)
        self.episode.messages.extend(observation)
        self.episode.reward += reward
        self._add_info(info)
        return observation, done

    async def _append_environment(self, turn: SampledTurn, observation: list[Message]) -> bool:
        """Append the tokens up to the next generation prompt; False when they would not leave
        room for one more sampled token."""
        rendered = await self._env_part(lambda: self.renderer.environment_ids(observation))
        ids = self.renderer.closing_ids(turn.token_ids) + rendered
        if self.episode.total_tokens + len(ids) >= self.limits.max_episode_tokens:
            return False
        self.episode.extend_environment(ids)
        return True

    def _check_size(self, observation: list[Message]) -> None:
        chars = sum(len(m["content"]) for m in observation)
        if chars > self.limits.max_observation_chars:
            limit = self.limits.max_observation_chars
            raise _EnvFailure(f"step: observation of {chars} characters is over the limit {limit}")

    def _add_info(self, info: dict[str, Any]) -> None:
        errors = info.get("tool_errors", 0)
        if isinstance(errors, bool) or not isinstance(errors, int) or errors < 0:
            raise _EnvFailure(f"step: info tool_errors must be a count, got {errors!r}")
        self.episode.tool_errors += errors
        parts = info.get("reward_parts") or {}
        if not isinstance(parts, dict):
            raise _EnvFailure("step: info reward_parts must be a dict of name to number")
        for name, value in parts.items():
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or not math.isfinite(value):
                raise _EnvFailure(f"step: reward part {name!r} is not a finite number: {value!r}")
            key = str(name)
            self.episode.reward_parts[key] = self.episode.reward_parts.get(key, 0.0) + value

    async def _env_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``env.<method>(...)``, timed into ``env_s``; any failure is the environment's."""
        return await self._env_part(
            lambda: invoke(
                getattr(self.env, method), *args, timeout_s=self.limits.step_timeout_s, **kwargs
            ),
            what=method,
        )

    async def _env_part(self, work: Any, what: str = "environment") -> Any:
        started = time.perf_counter()
        try:
            value = work()
            return await value if hasattr(value, "__await__") else value
        except (EnvError, _EnvFailure) as exc:
            raise _EnvFailure(str(exc)) from exc
        except TimeoutError as exc:
            raise _EnvFailure(f"{what} timed out after {self.limits.step_timeout_s:g}s") from exc
        except Exception as exc:  # noqa: BLE001 - user code: its failure ends only its episode
            raise _EnvFailure(f"{what} raised {type(exc).__name__}: {exc}") from exc
        finally:
            self.episode.env_s += time.perf_counter() - started

    def _end(self, reason: EndReason) -> None:
        self.episode.end_reason = reason
