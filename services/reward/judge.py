"""The ``judge`` scorer: an LLM grades each response through an OpenAI-compatible endpoint.

Why in the reward service: a generative reward model (verl's GenRM, an "LLM as a judge") is
one more scorer, so a recipe selects it by ``data_source`` or by name like any other, and the
service's fairness, per-item errors and ``reward.default_score`` apply to it unchanged. The
endpoint is the fleet's own router HTTP front (``/v1/chat/completions``, ``/v1/completions``)
or any vLLM / OpenAI-compatible server (``reward.judge``).

One item is: fill ``template`` from the request, send it, take the text of the first choice,
find the score with ``score_regex`` (the last match), check it lies in ``[min_score,
max_score]`` and map it onto [0, 1] (``normalize``). A batch runs its items concurrently, at
most ``max_concurrency`` requests in flight from one reward process (all its workers share one
client and one semaphore). Each attempt has ``timeout_s`` for the whole exchange; a failed
attempt (connection refused, timeout, HTTP 408/429/5xx, an answer with no score in range) is
retried ``retries`` times after ``backoff_s * 2**(k-1)``; a 4xx or a template the item cannot
fill is not retried. An item that still fails has an ``error`` saying why and after how many
attempts (the service then gives it ``reward.default_score``); every item, scored or not, has
a ``judge_attempts`` metric. Each item runs under a hard deadline of its own budget, so an
endpoint that accepts and never answers costs bounded time, never a stuck worker.

verl's GenRM shape also works as a user function (``reward.custom``): a ``compute_score``
that posts to the router's address itself. It needs ``reward.sandbox: false`` (the sandbox
has no network); ``Judge.compute_score`` is the same call in that shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rlfleet.common import tls
from rlfleet.common.config import JudgeConfig
from rlfleet.reward.scorers.base import Scorer, error_result
from rlfleet.reward.types import ScoreRequest, ScoreResult

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per judge call otherwise

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
PLACEHOLDER = re.compile(r"\{(prompt|response|ground_truth|data_source|extra_info\.[\w-]+)\}")
DEADLINE_SLACK_S = 1.0  # on top of an item's budget, before its hard deadline cancels it
MAX_SHOWN_CHARS = 200  # of a garbage answer, in the item's error


class JudgeError(Exception):
    """One attempt failed; ``retryable`` says whether another attempt may succeed."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


def fill_template(template: str, request: ScoreRequest) -> str:
    """The template with the item's values; JudgeError (not retryable) naming a placeholder
    the item cannot fill. Braces that are not placeholders stay as they are."""

    def value(match: re.Match) -> str:
        name = match.group(1)
        if name.startswith("extra_info."):
            key = name.removeprefix("extra_info.")
            if key not in request.extra_info:
                raise JudgeError(f"template needs extra_info[{key!r}], which the item lacks", False)
            return _text(request.extra_info[key])
        return _text(_fields(request)[name])

    return PLACEHOLDER.sub(value, template)


def _fields(request: ScoreRequest) -> dict[str, Any]:
    extra = request.extra_info
    prompt = request.prompt or extra.get("question") or extra.get("prompt") or ""
    return {
        "prompt": prompt,
        "response": request.solution_str,
        "ground_truth": request.ground_truth,
        "data_source": request.data_source,
    }


def _text(value: Any) -> str:
    """Strings as they are; anything else (lists of answers, chat messages) as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def request_body(config: JudgeConfig, text: str) -> tuple[str, dict[str, Any]]:
    """The path under ``base_url`` and the JSON body of one judge request."""
    body: dict[str, Any] = {"max_tokens": config.max_tokens, "temperature": config.temperature}
    if config.model:
        body["model"] = config.model
    if config.api == "completions":
        return "/completions", {**body, "prompt": text}
    messages = [{"role": "system", "content": config.system}] if config.system else []
    messages.append({"role": "user", "content": text})
    return "/chat/completions", {**body, "messages": messages}


def answer_text(api: str, payload: Any) -> str:
    """The first choice's text; JudgeError when the reply is not an OpenAI-shaped answer."""
    try:
        choice = payload["choices"][0]
        text = choice["message"]["content"] if api == "chat" else choice["text"]
    except (KeyError, IndexError, TypeError) as exc:
        raise JudgeError(f"reply is not a {api} completion: {_shown(payload)}") from exc
    if not isinstance(text, str):
        raise JudgeError(f"reply's text is {type(text).__name__}, not a string")
    return text


def parse_score(config: JudgeConfig, pattern: re.Pattern, text: str) -> tuple[float, float]:
    """(score, raw score): the last match of ``score_regex``, range-checked, normalised."""
    matches = list(pattern.finditer(text))
    if not matches:
        raise JudgeError(f"no score in the judge's answer: {_shown(text)}")
    last = matches[-1]
    found = last.group(1) if pattern.groups else last.group(0)
    try:
        raw = float(found)
    except (TypeError, ValueError) as exc:
        raise JudgeError(f"judge's score {found!r} is not a number") from exc
    if not math.isfinite(raw) or not config.min_score <= raw <= config.max_score:
        raise JudgeError(
            f"judge's score {raw:g} is outside [{config.min_score:g}, "
            f"{config.max_score:g}]: {_shown(text)}"
        )
    if not config.normalize:
        return raw, raw
    return (raw - config.min_score) / (config.max_score - config.min_score), raw


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:MAX_SHOWN_CHARS] + ("..." if len(text) > MAX_SHOWN_CHARS else ""))


@dataclass
class _Session:
    """What one event loop's calls share: the HTTP client and the in-flight bound."""

    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient
    slots: asyncio.Semaphore


class Judge:
    """Grades items through ``config``'s endpoint; ``transport`` replaces the network (tests).

    Counters (this process): ``attempts`` (HTTP requests sent), ``retried`` (attempts after a
    failed one), ``failed`` (items that got an error)."""

    def __init__(
        self, config: JudgeConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        if config.max_score <= config.min_score:
            raise ValueError(
                f"reward.judge: max_score ({config.max_score:g}) must be above "
                f"min_score ({config.min_score:g})"
            )
        self.config, self.transport = config, transport
        self.pattern = re.compile(config.score_regex)
        self.attempts = self.retried = self.failed = 0
        self._session: _Session | None = None

    def item_budget_s(self) -> float:
        """The longest one item may take once it holds a slot: every attempt and back-off."""
        c = self.config
        return (c.retries + 1) * c.timeout_s + sum(c.backoff_s * 2**k for k in range(c.retries))

    async def score_items(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Every item's result, in order, concurrently; never raises (but may be cancelled).
        Failures are logged once per call, not once per item (a judge that is down would
        otherwise write a line for every item of every batch)."""
        results = list(await asyncio.gather(*(self.score_item(r) for r in requests)))
        failed = [r for r in results if r.error]
        if failed:
            log.warning(
                "judge: %d of %d items failed (first: %s: %s)",
                len(failed),
                len(results),
                failed[0].id,
                failed[0].error,
            )
        return results

    async def score_item(self, request: ScoreRequest) -> ScoreResult:
        attempts = [0]
        try:
            score, raw = await self._graded(request, attempts)
        except TimeoutError:
            return self._failure(request, attempts[0], "judge took longer than its budget")
        except JudgeError as exc:
            return self._failure(request, attempts[0], str(exc))
        metrics = {"judge_attempts": float(attempts[0]), "judge_raw_score": raw}
        return ScoreResult(id=request.id, score=score, metrics=metrics)

    def _failure(self, request: ScoreRequest, attempts: int, why: str) -> ScoreResult:
        self.failed += 1
        result = error_result(request.id, f"judge failed after {attempts} attempt(s): {why}")
        result.metrics = {"judge_attempts": float(attempts)}
        return result

    async def compute_score(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any = "",
        extra_info: dict | None = None,
        prompt: str = "",
        **_: Any,
    ) -> float:
        """verl's ``compute_score`` shape: the normalised score, or JudgeError."""
        request = ScoreRequest(
            "judge", data_source, solution_str, ground_truth, dict(extra_info or {}), prompt=prompt
        )
        result = await self.score_item(request)
        if result.error:
            raise JudgeError(result.error, retryable=False)
        return result.score

    async def _graded(self, request: ScoreRequest, attempts: list[int]) -> tuple[float, float]:
        """Wait for a slot, then ask within the item's budget (a hard deadline from when the
        slot is taken: waiting behind other items is not the judge failing)."""
        path, body = request_body(self.config, fill_template(self.config.template, request))
        session = self._current()
        async with session.slots, asyncio.timeout(self.item_budget_s() + DEADLINE_SLACK_S):
            return await self._attempts(session.client, path, body, attempts)

    async def _attempts(
        self, client: httpx.AsyncClient, path: str, body: dict, attempts: list[int]
    ) -> tuple[float, float]:
        """Ask until an answer parses or the retries are spent; the last failure raises."""
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.retried += 1
                await asyncio.sleep(self.config.backoff_s * 2 ** (attempt - 1))
            attempts[0] += 1
            try:
                return parse_score(self.config, self.pattern, await self._ask(client, path, body))
            except JudgeError as exc:
                if not exc.retryable or attempt == self.config.retries:
                    raise
                log.debug("judge attempt %d failed: %s", attempt + 1, exc)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _ask(self, client: httpx.AsyncClient, path: str, body: dict) -> str:
        """One HTTP exchange within ``timeout_s``; JudgeError for every way it can fail."""
        self.attempts += 1
        try:
            async with asyncio.timeout(self.config.timeout_s):
                reply = await client.post(path, json=body)
        except TimeoutError as exc:
            raise JudgeError(f"no answer within {self.config.timeout_s:g}s") from exc
        except httpx.HTTPError as exc:
            raise JudgeError(f"{type(exc).__name__}: {exc or 'no detail'}") from exc
        if reply.status_code != 200:
            retryable = reply.status_code in RETRY_STATUS
            raise JudgeError(f"HTTP {reply.status_code}: {_shown(reply.text)}", retryable)
        try:
            payload = reply.json()
        except ValueError as exc:
            raise JudgeError(f"reply is not JSON: {_shown(reply.text)}") from exc
        return answer_text(self.config.api, payload)

    def _current(self) -> _Session:
        """This loop's session (a client and a semaphore belong to the loop that made them)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.loop is not loop:
            self._session = _Session(
                loop, self._client(), asyncio.Semaphore(self.config.max_concurrency)
            )
        return self._session

    def _client(self) -> httpx.AsyncClient:
        c = self.config
        key = os.environ.get(c.api_key_env, "") if c.api_key_env else ""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=c.max_concurrency)
        return httpx.AsyncClient(
            base_url=c.base_url.rstrip("/"),
            headers=headers,
            timeout=c.timeout_s,
            limits=limits,
            transport=self.transport,
            # The fleet's CA besides the system's roots: the judge may be the fleet's own router
            # (mutual TLS: this role's certificate) or a server outside it.
            verify=tls.client_ssl_context(system_roots=True) or True,
        )

    async def aclose(self) -> None:
        """Close this loop's client (a process that exits needs not)."""
        if self._session is not None and self._session.loop is asyncio.get_running_loop():
            await self._session.client.aclose()
        self._session = None


@dataclass
class JudgeScorer(Scorer):
    """The ``judge`` as a scorer: concurrent items, each its own result or error."""

    judge: Judge | None = None

    async def ascore_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        assert self.judge is not None
        return await self.judge.score_items(requests)


def judge_scorer(config: JudgeConfig, transport: httpx.AsyncBaseTransport | None = None) -> Scorer:
    judge = Judge(config, transport)
    return JudgeScorer(
        name="judge",
        kind="model",
        fn=judge.compute_score,
        judge=judge,
        is_async=True,
        blocking=False,
        self_timed=True,
        takes_prompt=True,
        data_sources=list(config.data_sources),
        description=f"an LLM at {config.base_url} grades the response ({config.api} API)",
    )
