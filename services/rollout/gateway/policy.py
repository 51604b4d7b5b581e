"""The model the fleet serves, as the OpenAI front names it and tokenizes chat with it.

Why loaded here and not by the router: only the front needs a tokenizer (chat templates, the
text of tool calls, per-token texts of log-probs); the router's placement never does. It is
read once when the front starts, from ``model.path``; the import of the tokenizer library
waits until then, so a router without the front never pays for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlfleet.common.config import RlfleetConfig
from rlfleet.rollout.limits import PromptLimits

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """What the HTTP front needs of a Hugging Face tokenizer."""

    chat_template: str | None

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


@dataclass
class Policy:
    """The model the fleet serves, as the HTTP front names and tokenizes it."""

    name: str
    path: str
    tokenizer: Tokenizer | None
    max_model_len: int
    limits: PromptLimits | None = None  # chat text bounded before the template runs


def load_policy(config: RlfleetConfig) -> Policy:
    """The served model's name and tokenizer (None, with a warning, if it cannot be read:
    completions still work on text, chat answers that there is no chat template)."""
    from rlfleet.model.model_io import load_tokenizer

    path = config.model.path
    try:
        tokenizer = load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - the API still serves completions without it
        log.warning("no tokenizer from model.path %s (%s): chat completions are off", path, exc)
        tokenizer = None
    name = Path(path).name or path
    limits = PromptLimits.of(config.rollout)
    return Policy(name, path, tokenizer, config.rollout.max_model_len, limits)
