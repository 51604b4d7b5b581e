"""A TRL ``environment_factory`` class, as TRL's GRPOTrainer takes it: ``reset(**row)`` and
public methods that are the tools (typed, with docstrings), an optional ``get_reward()``.

    rlfleet up --config configs/agent_calc.yaml agent.env=examples.agents.trl_adder:AdderEnv
"""

from __future__ import annotations

from typing import Any


class AdderEnv:
    def reset(self, **row: Any) -> str | None:
        self.truth, self.last = int(row["reward_model"]["ground_truth"]), None
        return None  # nothing to add to the prompt

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.last = a + b
        return self.last

    def get_reward(self) -> float:
        return float(self.last == self.truth)
