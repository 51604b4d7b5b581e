"""Token-native chat rendering: the chat template's tokens between two assistant turns.

Why: re-rendering the whole conversation each turn and re-tokenizing it would decode and
re-encode what the policy sampled, and a tokenizer does not round-trip (a BPE model may sample
``"1","2"`` where encoding gives ``"12"``; special tokens written as text come back as
something else), so the trained tokens would drift from the sampled ones. Here each turn's
input is the previous ids, plus the sampled ids untouched, plus ``environment_ids``: exactly
the tokens the template puts after the end of the assistant's turn (its end-of-turn token,
``<|im_end|>`` for ChatML, included in the sampled ids) and up to the next generation prompt.

They are computed by rendering a fixed base conversation, ending with an assistant turn, with
and without the new messages (and the generation prompt) and taking the difference in token
ids after the base's last end-of-turn token. That holds only for a template that is
prefix-stable (what comes later never changes how earlier turns render, as ChatML, Qwen2.5
and SmolLM2 are); the renderer checks it on every call and at construction, and raises
``TemplateError`` instead of producing tokens that would not match a full render.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]
BASE_USER: Message = {"role": "user", "content": "1"}
PROBES: tuple[list[Message], ...] = (
    [{"role": "tool", "tool_call_id": "call_0", "name": "probe", "content": "1"}],
    [{"role": "user", "content": "1"}],
)


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be rendered turn by turn without drift."""


class ChatRenderer:
    """Chat rendering for one tokenizer (a Hugging Face tokenizer with a chat template).

    ``end_of_turn_id`` is the token that ends an assistant turn (default: the tokenizer's
    eos); ``template_kwargs`` go to every ``apply_chat_template`` call (e.g.
    ``enable_thinking``)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        end_of_turn_id: int | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn_id = tokenizer.eos_token_id if end_of_turn_id is None else end_of_turn_id
        if self.end_of_turn_id is None:
            raise TemplateError("the tokenizer has no eos token: pass end_of_turn_id")
        self.template_kwargs = dict(template_kwargs or {})
        self._check_generation_prompt()
        for probe in PROBES:
            self.environment_ids(probe)

    def render_ids(
        self,
        messages: Sequence[Message],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
    ) -> list[int]:
        """The template's text for ``messages``, tokenized (no special tokens added)."""
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def initial_prompt_ids(
        self, messages: Sequence[Message], tools: list[dict] | None = None
    ) -> list[int]:
        """The first turn's input: the opening messages and the generation prompt."""
        return self.render_ids(messages, tools=tools, add_generation_prompt=True)

    def environment_ids(self, new_messages: Sequence[Message]) -> list[int]:
        """The tokens after an assistant turn's end-of-turn token, through ``new_messages`` and
        the next generation prompt; TemplateError where the template is not prefix-stable."""
        base = [BASE_USER, base_assistant(new_messages)]
        base_ids = self.render_ids(base)
        cut = self._end_of_last_turn(base_ids)
        full = self.render_ids([*base, *new_messages], add_generation_prompt=True)
        if full[:cut] != base_ids[:cut]:
            raise TemplateError(
                "the chat template is not prefix-stable: rendering messages after an assistant "
                "turn changes the tokens of that turn, so turns cannot be appended token-wise"
            )
        return full[cut:]

    def closing_ids(self, sampled_ids: Sequence[int]) -> list[int]:
        """The end-of-turn token when a turn stopped without it (max_tokens, a stop string):
        the template's token, not sampled, so the next turn still sees a closed turn."""
        ends = bool(sampled_ids) and sampled_ids[-1] == self.end_of_turn_id
        return [] if ends else [self.end_of_turn_id]

    def decode_turn(self, sampled_ids: Sequence[int]) -> str:
        """The text of a sampled turn, for the environment (special tokens kept, since tool-call
        tags may be special; the closing end-of-turn token dropped). Never re-encoded."""
        ids = list(sampled_ids)
        if ids and ids[-1] == self.end_of_turn_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _end_of_last_turn(self, base_ids: list[int]) -> int:
        if self.end_of_turn_id not in base_ids:
            token = self.tokenizer.convert_ids_to_tokens(self.end_of_turn_id)
            raise TemplateError(f"the chat template does not end an assistant turn with {token!r}")
        return len(base_ids) - base_ids[::-1].index(self.end_of_turn_id)

    def _check_generation_prompt(self) -> None:
        """The generation prompt must be how the template starts an assistant turn."""
        prompt = self.render_ids([BASE_USER], add_generation_prompt=True)
        answered = self.render_ids([BASE_USER, {"role": "assistant", "content": "1"}])
        if answered[: len(prompt)] != prompt:
            raise TemplateError(
                "the chat template's generation prompt is not a prefix of its assistant turn"
            )


def base_assistant(new_messages: Sequence[Message]) -> Message:
    """The base conversation's assistant turn: it calls the tools that ``new_messages`` answer,
    so templates that match tool replies to calls render them."""
    calls = [
        {
            "id": m.get("tool_call_id", f"call_{i}"),
            "type": "function",
            "function": {"name": m.get("name") or "tool", "arguments": json.dumps({})},
        }
        for i, m in enumerate(new_messages)
        if m.get("role") == "tool"
    ]
    message: Message = {"role": "assistant", "content": "1"}
    if calls:
        message["tool_calls"] = calls
    return message
