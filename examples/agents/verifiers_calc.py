"""A verifiers environments-hub module (``verifiers==0.3.1``, the classic ``vf`` API) for the
calc task, run unchanged through the router's gateway.

    rlfleet up --config configs/agent_calc.yaml agent.env=examples.agents.verifiers_calc:load_environment
    rlfleet up ... agent.env_kwargs='{kind: single}'     # or tool (default), multi

``load_environment(**kwargs)`` returns a ``vf.ToolEnv`` (the ``add`` tool, answered by
verifiers), a ``vf.SingleTurnEnv`` or a ``vf.MultiTurnEnv`` subclass (its ``env_response``
tells the model how far off it is; a ``vf.stop`` condition ends it on the right answer), each
scored by a ``vf.Rubric``. The environment samples through an OpenAI client that rlfleet points
at its gateway, so the tokens it trains are the ones the fleet sampled.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def exact_answer(completion, answer, **kwargs) -> float:
    """1.0 when the last assistant message is the answer."""
    replies = [m for m in completion if getattr(m, "role", None) == "assistant"]
    text = (replies[-1].content or "") if replies else ""
    return float(str(text).strip() == str(answer).strip())


class Retry(vf.MultiTurnEnv):
    """Tells the model whether its answer was right; stops on the right one."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "no, again: " + state["prompt"][-1].content}]

    @vf.stop
    async def answered(self, state) -> bool:
        trajectory = state["trajectory"]
        if not trajectory:
            return False
        text = trajectory[-1]["completion"][-1].content or ""
        return str(text).strip() == str(state["answer"]).strip()


def load_environment(kind: str = "tool", max_turns: int = 4) -> vf.Environment:
    dataset = Dataset.from_list([{"question": "12+34+56=", "answer": "102"}])
    rubric = vf.Rubric(funcs=[exact_answer])
    if kind == "single":
        return vf.SingleTurnEnv(dataset=dataset, rubric=rubric)
    if kind == "multi":
        return Retry(dataset=dataset, rubric=rubric, max_turns=max_turns)
    return vf.ToolEnv(dataset=dataset, rubric=rubric, tools=[add], max_turns=max_turns)
