"""A Gymnasium-shaped text environment: ``reset(**task) -> messages`` and
``step(assistant_message) -> (messages, reward, done, info)``.

    rlfleet up --config configs/agent_calc.yaml agent.env=examples.agents.text_env:SumByParts

The policy is asked for the sum one pair at a time: each turn the environment replies with the
next partial sum to compute, and the episode ends after the last number (reward: the share of
partial sums answered right). Any class with these two methods (sync or async) works unchanged.
"""

from __future__ import annotations

from typing import Any


class SumByParts:
    def reset(self, **task: Any) -> list[dict]:
        self.numbers = list(task["extra_info"]["numbers"])
        self.total, self.right, self.turns = self.numbers.pop(0), 0, 0
        return [{"role": "user", "content": f"{self.total}+{self.numbers[0]}="}]

    def step(self, assistant_message: dict) -> tuple[list[dict], float, bool, dict]:
        self.total += self.numbers.pop(0)
        self.turns += 1
        self.right += assistant_message.get("content", "").strip() == str(self.total)
        reward = self.right / self.turns
        if not self.numbers:
            return [], reward, True, {"reward_parts": {"partial_sums": reward}}
        return [{"role": "user", "content": f"{self.total}+{self.numbers[0]}="}], 0.0, False, {}
