"""The agent gateway's extensions of the chat API: tool calls and token ids (pure mapping).

Why: a black-box agent written with the ``openai`` client sends ``tools`` and expects
``tool_calls`` back, and a trainer behind it needs the exact tokens. Rules:

- ``tools`` (unless ``tool_choice`` is ``"none"``) go to the chat template, and each choice's
  sampled text is parsed for Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks with
  ``rlfleet.model.tool_calls`` (the parser the episode loop uses). The text is decoded from
  the token ids with special tokens kept (the tags may be special tokens, which the engine's
  text drops) and without the closing end-of-turn token. Good calls become ``tool_calls``
  (ids ``call_<8 hex>_<n>``, unique across a conversation) and ``finish_reason`` is
  ``tool_calls``; ``content`` is the text before the first call (null if empty). A call that
  does not parse is listed under ``tool_call_errors``; when no call parsed, ``content`` is
  the whole text, as vLLM's parsers answer, so the agent still sees what the model wrote.
- ``return_token_ids: true`` (a body field, or inside an ``extra_body`` object for clients
  that send it nested) adds vLLM's names: ``prompt_token_ids`` on the response, ``token_ids``
  on each choice, with each choice's per-token ``logprobs`` (chat's ``logprobs.content``) and
  the ``weight_version`` that sampled it (also on the response: the newest of the call).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.model.tool_calls import ParsedTurn, parse_tool_calls
from rlfleet.rollout.gateway.openai_api import Body, ChatBody, chat_logprobs
from rlfleet.rollout.gateway.policy import Tokenizer
from rlfleet.rollout.gateway.trajectory import CallRecord
from rlfleet.rollout.types import Completion, GenerateResult
from rlfleet.rollout.types import InvalidField as BadField


@dataclass
class Choice:
    """One sampled answer: the engine's result and the assistant message made of it."""

    result: GenerateResult
    completion: Completion
    message: dict[str, Any]
    finish_reason: str
    tool_calls: int = 0
    tool_errors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def record(self) -> CallRecord:
        """The session record of this choice (``trajectory.CallRecord``)."""
        return CallRecord.of(
            self.result,
            self.completion,
            finish_reason=self.finish_reason,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            message=self.message,
        )


def wants_token_ids(body: Body) -> bool:
    """``return_token_ids`` in the body, or in an ``extra_body`` object."""
    if body.return_token_ids is not None:
        return bool(body.return_token_ids)
    return bool((body.extra_body or {}).get("return_token_ids"))


def tools_of(body: ChatBody) -> list[dict[str, Any]] | None:
    """The tools the template renders and the answer is parsed for; None when off."""
    if not body.tools or body.tool_choice == "none":
        return None
    for i, tool in enumerate(body.tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadField(
                f"tools[{i}]",
                'must be {"type": "function", "function": {"name": ..., "parameters": {...}}}',
            )
    return list(body.tools)


def choices_of(
    results: Sequence[GenerateResult], tokenizer: Tokenizer | None, tools_on: bool
) -> list[Choice]:
    """Every completion in OpenAI order, as an assistant message (tool calls parsed if on)."""
    return [_choice(r, c, tokenizer, tools_on) for r in results for c in r.completions]


def _choice(
    result: GenerateResult, completion: Completion, tokenizer: Tokenizer | None, tools_on: bool
) -> Choice:
    if not tools_on or tokenizer is None:
        return Choice(
            result,
            completion,
            {"role": "assistant", "content": completion.text},
            completion.finish_reason,
        )
    turn = parse_tool_calls(_raw_text(completion.token_ids, tokenizer))
    if not turn.attempted:
        return _choice(result, completion, tokenizer, tools_on=False)
    message = _tool_message(turn)
    finish = "tool_calls" if turn.tool_calls else completion.finish_reason
    return Choice(result, completion, message, finish, turn.attempted, len(turn.errors))


def _raw_text(token_ids: list[int], tokenizer: Tokenizer) -> str:
    ids = list(token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if ids and ids[-1] == eos:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def _tool_message(turn: ParsedTurn) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    calls = [{**call, "id": f"call_{tag}_{i}"} for i, call in enumerate(turn.tool_calls)]
    parsed = turn.message()
    content = parsed["content"] if calls or not turn.errors else _whole_text(turn)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    if turn.errors:
        message["tool_call_errors"] = [error.to_dict() for error in turn.errors]
    return message


def _whole_text(turn: ParsedTurn) -> str:
    """The text as written when no call parsed: content, then each broken call in its tags."""
    blocks = "".join(
        f"<tool_call>{error.raw}"
        + ("" if error.reason.startswith("no closing") else "</tool_call>")
        for error in turn.errors
    )
    return turn.content + blocks


def chat_choice_bodies(
    choices: Sequence[Choice], tokenizer: Tokenizer | None, logprobs: bool, token_ids: bool
) -> list[dict[str, Any]]:
    """The ``choices`` of a chat response."""
    return [
        {
            "index": i,
            "message": choice.message,
            "finish_reason": choice.finish_reason,
            "logprobs": chat_logprobs(choice.completion, tokenizer)
            if logprobs or token_ids
            else None,
            **(_token_fields(choice) if token_ids else {}),
        }
        for i, choice in enumerate(choices)
    ]


def _token_fields(choice: Choice) -> dict[str, Any]:
    return {
        "token_ids": list(choice.completion.token_ids),
        "weight_version": choice.result.weight_version,
        "token_weight_versions": choice.completion.versions(choice.result.weight_version),
    }


def response_token_fields(results: Sequence[GenerateResult]) -> dict[str, Any]:
    """``prompt_token_ids`` (the chat prompt, one per call) and the call's weight version."""
    return {
        "prompt_token_ids": list(results[0].prompt_token_ids) if results else [],
        "weight_version": max((r.weight_version for r in results), default=-1),
    }


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """The messages (and tools) through the chat template, as the generation prompt's ids; the
    tokenizer adds its special tokens unless the template already starts with BOS."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer(text, add_special_tokens=not (bos and text.startswith(bos))).input_ids)
