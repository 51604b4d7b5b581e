"""How big a prompt a router or replica takes: text bytes and tokens (``rollout.*`` limits).

Why at both doors: the router refuses what it can judge without a tokenizer (text bytes,
token-id prompts) before anything is queued, so an oversized request is answered at once and
never reaches, let alone bounces between, replicas; the replica checks again (a direct call, or
a router with other limits) and bounds the text *before* tokenizing it, then the tokens after.
Every refusal is ``InvalidField`` (INVALID_ARGUMENT, HTTP 400) naming the field, its size and
the limit's config name, so a caller knows what to change. Pure checks, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rlfleet.common.config import RolloutConfig
from rlfleet.rollout.types import GenerateRequest, InvalidField, SamplingParams


@dataclass(frozen=True)
class PromptLimits:
    max_bytes: int  # prompt_text, UTF-8 bytes
    max_tokens: int  # prompt tokens
    max_model_len: int  # prompt + new tokens

    @classmethod
    def of(cls, rollout: RolloutConfig) -> PromptLimits:
        tokens = rollout.max_prompt_tokens or max(1, rollout.max_model_len - 1)
        return cls(rollout.max_prompt_bytes, tokens, rollout.max_model_len)

    def check(self, request: GenerateRequest) -> None:
        """Everything judged without a tokenizer: text bytes, or the token ids' count. The
        message names the request (one member of a batch may be at fault)."""
        try:
            if isinstance(request.prompt_token_ids, list) and request.prompt_token_ids:
                self.check_tokens(len(request.prompt_token_ids), _max_tokens(request))
            elif isinstance(request.prompt_text, str):
                self.check_text(request.prompt_text)
        except InvalidField as exc:
            raise InvalidField(
                exc.field, f"{_problem(exc)} (request {request.request_id!r})"
            ) from None

    def check_all(self, requests: Iterable[GenerateRequest]) -> None:
        for request in requests:
            self.check(request)

    def check_text(self, text: str, field: str = "prompt_text") -> None:
        """Cheap first: a string's UTF-8 size is at most 4 bytes a character."""
        if len(text) * 4 <= self.max_bytes:
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise InvalidField(
                field, f"is {size} bytes > rollout.max_prompt_bytes {self.max_bytes}"
            )

    def check_messages(self, contents: Sequence[str], field: str = "messages") -> None:
        """Chat messages count together (they become one prompt)."""
        size = sum(len(c.encode("utf-8", "surrogatepass")) for c in contents)
        if size > self.max_bytes:
            raise InvalidField(
                field, f"hold {size} bytes of text > rollout.max_prompt_bytes {self.max_bytes}"
            )

    def check_tokens(self, count: int, max_tokens: int, field: str = "prompt_token_ids") -> None:
        if count > self.max_tokens:
            raise InvalidField(
                field, f"has {count} tokens > rollout.max_prompt_tokens {self.max_tokens}"
            )
        if count + max_tokens > self.max_model_len:
            raise InvalidField(
                field,
                f"has {count} tokens + sampling.max_tokens {max_tokens} "
                f"> rollout.max_model_len {self.max_model_len}",
            )


def _problem(error: InvalidField) -> str:
    """The message without its leading field name."""
    return str(error)[len(error.field) + 1 :]


def _max_tokens(request: GenerateRequest) -> int:
    """The new tokens asked for; 0 when malformed (``validate`` then says why)."""
    asked = (
        getattr(request.sampling, "max_tokens", 0)
        if isinstance(request.sampling, SamplingParams)
        else 0
    )
    return asked if isinstance(asked, int) and not isinstance(asked, bool) else 0
