"""The ``code`` scorer: run the response, a Python solution, against the ground truth's tests.

Ground truth (a dict, or its JSON text), in either of the two shapes code datasets use:

- ``{"tests": ["assert f(1) == 2", ...]}``: each assertion runs after the solution;
- ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``: the solution reads each input on
  stdin, and must print the output (compared line by line, trailing spaces ignored).

Either may add ``"prefix"``: code that runs before the solution (HumanEval's problem code: its
imports, helpers and the signature the solution completes; ``rlfleet.tasks.humaneval``).
``openai/openai_humaneval`` and ``humaneval`` select this scorer by data source.

Every test is its own run in the sandbox (``rlfleet.common.sandbox``), so one that hangs or
crashes fails only itself. A test passes when its run ends normally (for asserts: past a marker
the solution cannot print without reading the harness). The score is the fraction passed, or
1.0 only when all pass (``reward.code_scoring``); ``passed`` and ``tests`` are metrics. A
fenced ``python`` block in the response is taken as the solution, else the whole response.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from rlfleet.common.config import SandboxLimits
from rlfleet.common.sandbox import RunOutcome, run_program
from rlfleet.reward.scorers.base import Scorer
from rlfleet.tasks import humaneval

FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
MAX_TESTS = 256
Check = Callable[[], Awaitable[bool]]


def solution_of(response: str) -> str:
    """The last fenced code block, else the response as it is."""
    blocks = FENCED.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(ground_truth: Any) -> dict[str, list[str]]:
    """``tests`` or ``inputs``/``outputs`` lists of strings; ValueError otherwise."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(truth, dict):
        raise ValueError("code ground truth must be {'tests': [...]} or {'inputs', 'outputs'}")
    if not isinstance(truth.get("prefix", ""), str):
        raise ValueError("code ground truth: 'prefix' must be a string")
    if "tests" in truth:
        return {"tests": _strings(truth["tests"], "tests")}
    inputs, outputs = (
        _strings(truth.get("inputs"), "inputs"),
        _strings(truth.get("outputs"), "outputs"),
    )
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    return {"inputs": inputs, "outputs": outputs}


def _strings(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not value or len(value) > MAX_TESTS:
        raise ValueError(f"code ground truth: {name!r} must be a list of 1-{MAX_TESTS} items")
    return [v if isinstance(v, str) else json.dumps(v) for v in value]


def with_prefix(ground_truth: Any, response: str) -> str:
    """The program to run: the ground truth's ``prefix`` (if any), then the solution."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    prefix, solution = truth.get("prefix", ""), solution_of(response)
    return prefix.rstrip("\n") + "\n" + solution if prefix else solution


def same_output(said: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(said) == lines(expected)


class CodeRunner:
    """Runs tests with at most ``limits.workers`` sandboxed programs at a time."""

    def __init__(self, limits: SandboxLimits, mode: str = "fraction") -> None:
        self.limits, self.mode = limits, mode
        self._slots = asyncio.Semaphore(max(1, limits.workers))

    async def score(self, solution_str: str, ground_truth: Any, **_: Any) -> dict[str, float]:
        tests, solution = parse_tests(ground_truth), with_prefix(ground_truth, solution_str)
        if "tests" in tests:
            checks = [self._assertion(solution, test) for test in tests["tests"]]
        else:
            pairs = zip(tests["inputs"], tests["outputs"], strict=True)
            checks = [self._io(solution, given, wanted) for given, wanted in pairs]
        passed = sum(await asyncio.gather(*(check() for check in checks)))
        score = passed / len(checks) if self.mode == "fraction" else float(passed == len(checks))
        return {"score": score, "passed": float(passed), "tests": float(len(checks))}

    def _assertion(self, solution: str, test: str) -> Check:
        async def check() -> bool:
            marker = secrets.token_hex(8)
            source = f"{solution}\n\n{test}\nprint({marker!r})\n"
            outcome = await self._run(source, "")
            return outcome.ok and outcome.stdout.rstrip().endswith(marker)

        return check

    def _io(self, solution: str, given: str, wanted: str) -> Check:
        async def check() -> bool:
            outcome = await self._run(solution, given)
            return outcome.ok and same_output(outcome.stdout, wanted)

        return check

    async def _run(self, source: str, stdin: str) -> RunOutcome:
        async with self._slots:
            return await run_program(source, stdin, self.limits)


def code_scorer(limits: SandboxLimits, mode: str = "fraction") -> Scorer:
    runner = CodeRunner(limits, mode)
    return Scorer(
        name="code",
        kind="builtin",
        fn=runner.score,
        is_async=True,
        sandboxed=True,
        data_sources=[humaneval.DATA_SOURCE, "humaneval"],
        description="fraction of the ground truth's tests the solution passes (sandboxed)",
    )
