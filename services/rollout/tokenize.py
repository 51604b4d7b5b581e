"""Tokenizing text prompts off the event loop, one at a time, after a size check.

Why: a replica's event loop also reads its stream, stores answers and watches for cancelled
jobs; a long prompt tokenized on it (seconds for megabytes of text) stalls all of that. The
work goes to one worker thread per process instead: the fast tokenizers release the GIL
while they run, one thread at a time keeps a tokenizer from being used by two threads at
once, and it bounds the CPU a burst of long prompts can take. The text is bounded first
(``rollout.max_prompt_bytes``), so a prompt that cannot fit is refused before any work.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from rlfleet.rollout.engines.base import Engine
from rlfleet.rollout.limits import PromptLimits

_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlfleet-tokenize")


async def encode(engine: Engine, text: str, limits: PromptLimits) -> list[int]:
    """``engine.encode(text)`` in the tokenizer thread, once the text is within the byte
    limit; the tokens it gives must be within the token limit (InvalidField otherwise)."""
    limits.check_text(text)
    tokens = await asyncio.get_running_loop().run_in_executor(_WORKER, engine.encode, text)
    if len(tokens) > limits.max_tokens:
        limits.check_tokens(len(tokens), 0, field="prompt_text")
    return tokens
