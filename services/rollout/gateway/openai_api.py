"""OpenAI request bodies -> GenerateRequests, and GenerateResults -> OpenAI response bodies.

Pure (no HTTP, no Redis), so the mapping can be read and tested on its own; ``app.py`` serves
it. Why the rules below:

- Absent fields take OpenAI's defaults (``n`` 1, ``temperature`` 1, ``top_p`` 1, completions'
  ``max_tokens`` 16; chat's ``max_tokens`` fills the context, ``rollout.max_model_len``). A
  field that is present is taken as sent and checked by ``GenerateRequest.validate``, the same
  check gRPC requests get, so ``n: 0``, ``max_tokens: 0`` and NaN are refused (HTTP 400) here
  exactly as gRPC refuses them (INVALID_ARGUMENT); see ``rlfleet.rollout.types``.
- Engines return the sampled token's log-prob only: ``logprobs`` 0 or 1 (completions) or
  ``true`` (chat, ``top_logprobs`` 0) give it; more alternatives are refused, not faked.
- Routing extensions: the session id (stickiness) is the ``X-Session-Id`` header or else the
  ``user`` field; ``min_weight_version`` (body) gates on the weight version as over gRPC.
- The router answers whole completions, so a stream (``stream: true``) carries one chunk per
  choice, then the usage chunk if asked, then ``[DONE]``.
- Agent gateway extensions (``extensions``): chat ``tools`` come back as ``tool_calls``;
  ``return_token_ids`` (in the body, or in an ``extra_body`` object) adds vLLM's
  ``prompt_token_ids`` / ``choices[i].token_ids``, the log-probs and the ``weight_version``
  (the oldest of the choice's tokens), plus ``token_weight_versions``: the version that
  sampled each token (several when a weight update crossed the request).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

from pydantic import BaseModel, ConfigDict

from rlfleet.rollout.gateway.policy import Tokenizer
from rlfleet.rollout.limits import PromptLimits
from rlfleet.rollout.types import Completion, GenerateRequest, GenerateResult, SamplingParams
from rlfleet.rollout.types import InvalidField as BadField

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TEMPLATE_KEYS = ("tool_calls", "tool_call_id", "name")  # message fields chat templates read


class Body(BaseModel):
    """Fields shared by both endpoints; unknown OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    min_weight_version: int = 0
    return_token_ids: bool | None = None
    extra_body: dict[str, Any] | None = None


class CompletionBody(Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(Body):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


def prompts_of(body: CompletionBody) -> list[str | list[int]]:
    """The prompts of a completion body: a string, token ids, or a list of either."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise BadField("prompt", "must not be empty")
    return cast(list[str | list[int]], list(prompt))  # strings, or lists of ids


def completion_sampling(body: CompletionBody, need_logprobs: bool = False) -> SamplingParams:
    if body.echo:
        raise BadField("echo", "is not supported (the router returns generated tokens only)")
    if body.best_of not in (None, 1) and body.best_of != body.n:
        raise BadField("best_of", "is not supported (use n)")
    if body.logprobs not in (None, 0, 1):
        raise BadField("logprobs", "must be 0 or 1: only the sampled token's log-prob exists")
    max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    return _sampling(body, max_tokens, body.logprobs is not None or need_logprobs)


def chat_sampling(
    body: ChatBody, prompt_len: int, max_model_len: int, need_logprobs: bool = False
) -> SamplingParams:
    if body.top_logprobs:
        raise BadField("top_logprobs", "must be 0: only the sampled token's log-prob exists")
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, max_model_len - prompt_len)
    return _sampling(body, max_tokens, body.logprobs or need_logprobs)


def _sampling(body: Body, max_tokens: int, logprobs: bool) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        n=1 if body.n is None else body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_tokens=max_tokens,
        stop=stop,
        seed=body.seed,
        logprobs=int(logprobs),
    )


def requests_for(
    prompts: Sequence[str | list[int]], sampling: SamplingParams, body: Body, session: str
) -> list[GenerateRequest]:
    """One validated GenerateRequest per prompt; field names as the OpenAI body has them."""
    base = f"oai-{uuid.uuid4().hex}"
    requests = [
        GenerateRequest(
            f"{base}-{i}",
            sampling,
            session_id=session,
            min_weight_version=body.min_weight_version,
            **({"prompt_text": p} if isinstance(p, str) else {"prompt_token_ids": p}),
        )
        for i, p in enumerate(prompts)
    ]
    for request in requests:
        request.validate()
    return requests


def session_of(body: Body, header: str | None) -> str:
    return header or body.user or ""


def usage(results: Sequence[GenerateResult]) -> dict[str, int]:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(c.token_ids) for r in results for c in r.completions)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_choices(
    results: Sequence[GenerateResult],
    tokenizer: Tokenizer | None,
    logprobs: bool,
    token_ids: bool = False,
) -> list[dict[str, Any]]:
    """Choices in OpenAI order: prompt by prompt, each prompt's ``n`` samples in turn; with
    ``token_ids`` (``return_token_ids``) each carries its prompt's and its own ids (vLLM)."""
    flat = [(r, c) for r in results for c in r.completions]
    return [
        {
            "index": i,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "logprobs": _text_logprobs(c, tokenizer) if logprobs else None,
            **(
                {
                    "prompt_token_ids": list(r.prompt_token_ids),
                    "token_ids": list(c.token_ids),
                    "weight_version": r.weight_version,
                    "token_weight_versions": c.versions(r.weight_version),
                }
                if token_ids
                else {}
            ),
        }
        for i, (r, c) in enumerate(flat)
    ]


def envelope(kind: str, model: str, results: Sequence[GenerateResult]) -> dict[str, Any]:
    """The fields around ``choices``; ``system_fingerprint`` names the weight version."""
    versions = sorted({r.weight_version for r in results})
    return {
        "id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "weights-v" + ",".join(map(str, versions)),
    }


def stream_chunks(
    response: dict[str, Any], chat: bool, include_usage: bool
) -> list[dict[str, Any]]:
    """A finished response as stream chunks: one per choice (chat ones as deltas), then
    the usage chunk when ``stream_options.include_usage`` asked for it."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {k: v for k, v in response.items() if k not in ("choices", "usage", "object")}
    chunks = [
        {**head, "object": kind, "choices": [_delta(choice) if chat else choice]}
        for choice in response["choices"]
    ]
    if include_usage:
        chunks.append({**head, "object": kind, "choices": [], "usage": response["usage"]})
    return chunks


def _delta(choice: dict[str, Any]) -> dict[str, Any]:
    """A choice as a stream chunk; tool calls carry their ``index``, as deltas do."""
    delta = {k: v for k, v in choice.items() if k != "message"}
    message = dict(choice["message"])
    if message.get("tool_calls"):
        message["tool_calls"] = [
            {"index": i, **call} for i, call in enumerate(message["tool_calls"])
        ]
    return {**delta, "delta": message}


def _token_texts(completion: Completion, tokenizer: Tokenizer | None) -> list[str]:
    if tokenizer is None:
        return [f"<{t}>" for t in completion.token_ids]
    return [tokenizer.decode([t]) for t in completion.token_ids]


def _text_logprobs(completion: Completion, tokenizer: Tokenizer | None) -> dict[str, Any]:
    tokens = _token_texts(completion, tokenizer)
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": list(completion.logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def chat_logprobs(completion: Completion, tokenizer: Tokenizer | None) -> dict[str, Any]:
    pairs = zip(_token_texts(completion, tokenizer), completion.logprobs, strict=False)
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in pairs
        ]
    }


def chat_messages(body: ChatBody, limits: PromptLimits | None = None) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (content parts joined into one string; an
    assistant's ``tool_calls`` and a tool reply's ``tool_call_id`` / ``name`` kept). With
    ``limits``, their text together must be within ``rollout.max_prompt_bytes`` (400
    otherwise), checked before any templating or tokenizing."""
    if not body.messages:
        raise BadField("messages", "must not be empty")
    messages = [_template_message(m) for m in body.messages]
    if limits is not None:
        limits.check_messages([m["content"] for m in messages])
    return messages


def _template_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": _content_text(message.content)}
    for key in TEMPLATE_KEYS:
        value = (message.model_extra or {}).get(key)
        if value is not None:
            rendered[key] = value
    return rendered


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.get("type") != "text" for part in content):
        raise BadField("messages", "content parts must be text (the policy reads text only)")
    return "".join(str(part.get("text", "")) for part in content)
