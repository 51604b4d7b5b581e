"""Sums of three or four two-digit numbers, solved by calling an `add(a, b)` tool: the agent task.

Why this module exists: the agent job must show RL improving a multi-turn, tool-using policy on
a CPU in minutes, so its task needs a tool, several turns and an exact check, and nothing to
download. The policy never has to add: it has to call `add` with the right operands turn after
turn and then repeat the last tool reply, so a tiny model can learn it. One definition of the
prompt, the tool, the ideal episode and the check is shared by the data script, the model build
script, the environment and the tests; everything here is pure Python (no torch).

Pinned format: the user message is `12+34+56=`; the ideal episode is the assistant calling
`add(12, 34)`, the tool replying `46`, the assistant calling `add(46, 56)`, the tool replying
`102` and the assistant answering `102` (3 numbers: 3 assistant turns, 4 numbers: 4).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

DATA_SOURCE = "calc"
LOW, HIGH = 10, 99
"""Every number of a problem is drawn from LOW..HIGH (two digits)."""
COUNTS = (3, 4)
"""How many numbers a problem sums."""

_INT = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class Problem:
    """One sum of `numbers`; the prompt is the user message, the answer the final reply."""

    numbers: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return "+".join(str(n) for n in self.numbers) + "="

    @property
    def answer(self) -> str:
        return str(sum(self.numbers))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum of a and b.
    """
    return a + b


TOOLS = [add]
"""The tools of the task, as typed functions (schemas via `transformers.utils.get_json_schema`)."""


def random_problem(rng: random.Random) -> Problem:
    """A problem with 3 or 4 numbers in LOW..HIGH, drawn from `rng`."""
    count = rng.choice(COUNTS)
    return Problem(tuple(rng.randint(LOW, HIGH) for _ in range(count)))


def split_problems(seed: int, n_train: int, n_test: int) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and test problems without repeats, the same for the same arguments.

    Why disjoint: held-out success must measure the learnt procedure, not memorised sums.
    """
    if n_train < 0 or n_test < 0:
        raise ValueError(f"need n_train >= 0 and n_test >= 0, got {n_train}, {n_test}")
    rng, seen = random.Random(seed), set()
    problems: list[Problem] = []
    while len(problems) < n_train + n_test:
        problem = random_problem(rng)
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)
    return problems[n_test:], problems[:n_test]


def prompt_messages(problem: Problem, system: str | None = None) -> list[dict]:
    """The episode's opening messages in OpenAI chat format (no system message by default)."""
    user = [{"role": "user", "content": problem.prompt}]
    return ([{"role": "system", "content": system}] if system else []) + user


def ground_truth(problem: Problem) -> str:
    """The final answer the checker expects, as text (verl's `reward_model.ground_truth`)."""
    return problem.answer


def check_answer(text: str, truth: str) -> float:
    """1.0 when the last integer in the final answer `text` equals `truth`, else 0.0.

    The last integer, not the whole text, so an instruct model's "The sum is 102." counts; a
    reply that still holds a tool call is not a final answer and scores 0.0.
    """
    if "<tool_call>" in text:
        return 0.0
    found = _INT.findall(text)
    try:
        return 1.0 if found and int(found[-1]) == int(str(truth).strip()) else 0.0
    except ValueError:
        return 0.0


def tool_call(index: int, a: int, b: int) -> dict:
    """One OpenAI-format call of `add` (arguments as a compact JSON string, as OpenAI sends)."""
    arguments = json.dumps({"a": a, "b": b}, separators=(",", ":"))
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": "add", "arguments": arguments},
    }


def ideal_messages(problem: Problem, system: str | None = None) -> list[dict]:
    """The ideal whole episode in OpenAI chat format: the SFT target of the tiny policy.

    Each assistant turn calls `add` on the running total and the next number; each tool reply
    is the new total; the last assistant turn answers with the total and calls nothing.
    """
    messages = prompt_messages(problem, system)
    total = problem.numbers[0]
    for index, number in enumerate(problem.numbers[1:]):
        call = tool_call(index, total, number)
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        total = add(total, number)
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(total)})
    messages.append({"role": "assistant", "content": str(total)})
    return messages


def to_verl_record(problem: Problem, split: str, index: int) -> dict:
    """One row in verl's dataset schema; `extra_info.numbers` keeps the problem recoverable."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": prompt_messages(problem),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth(problem)},
        "extra_info": {"split": split, "index": index, "numbers": list(problem.numbers)},
    }


def from_verl_record(record: dict) -> Problem:
    """The Problem of a record written by `to_verl_record` (or of a bare `12+34+56=` prompt)."""
    numbers = (record.get("extra_info") or {}).get("numbers")
    if numbers:
        return Problem(tuple(int(n) for n in numbers))
    prompt = record["prompt"]
    content = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    return Problem(tuple(int(n) for n in content.strip().rstrip("=").split("+")))
