"""Check that rlfleet's verl-named scorers score exactly as verl's own code does.

Why a script and not a test: verl is not a dependency (it pulls Ray, vLLM pins and more), so
its wheel is downloaded ``--no-deps`` into the rlfleet cache and only its two pure-Python
reward files (``verl/utils/reward_score/gsm8k.py``, ``math_reward.py``) are loaded from it.
It checks the ``verl`` column of ``tests/data/verl_parity_cases.jsonl`` (``--write`` rewrites
that column from verl), then compares both implementations on random strings made of the
tokens that matter and on GSM8K answer forms, and exits non-zero on any difference.

    python scripts/check_verl_parity.py [--verl 0.9.1] [--fuzz 40000] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import random
import subprocess
import sys
import zipfile
from pathlib import Path

from rlfleet.model.local_models import rlfleet_cache_dir
from rlfleet.reward.scorers.verl_parity import (
    GSM8K_SOURCES,
    MATH_SOURCES,
    verl_gsm8k_score,
    verl_math_score,
)

CASES = Path(__file__).resolve().parents[1] / "tests" / "data" / "verl_parity_cases.jsonl"
TOKENS = [
    "\\boxed{",
    "\\boxed ",
    "\\fbox{",
    "{",
    "}",
    "\\frac",
    "\\dfrac",
    "\\sqrt",
    "\\text{ ",
    "\\text{",
    "=",
    "x",
    "k",
    " ",
    ".",
    "0.5",
    "0",
    "1",
    "2",
    "3",
    "/",
    "$",
    "\\$",
    "\\%",
    "\\!",
    "\\left(",
    "\\right)",
    "^\\circ",
    "^{\\circ}",
    "\n",
    "\\\\",
    "####",
    "#### ",
    ",",
    "-",
    "42",
    "1,000",
    "tfrac",
]


def verl_wheel(version: str) -> Path:
    """verl's wheel in the rlfleet cache, downloaded ``--no-deps`` the first time."""
    folder = rlfleet_cache_dir() / "wheels" / f"verl-{version}"
    wheel = next(folder.glob("verl-*.whl"), None)
    if wheel is None:
        folder.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q"]
        subprocess.run([*pip, "--no-deps", f"verl=={version}", "-d", str(folder)], check=True)
        wheel = next(folder.glob("verl-*.whl"))
    return wheel


def verl_modules(version: str):
    """verl's gsm8k and math_reward modules, from its wheel (downloaded once)."""
    with zipfile.ZipFile(verl_wheel(version)) as archive:
        return [_module(archive, name) for name in ("gsm8k", "math_reward")]


def _module(archive: zipfile.ZipFile, name: str):
    spec = importlib.util.spec_from_loader(f"verl_{name}", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(archive.read(f"verl/utils/reward_score/{name}.py"), module.__dict__)  # noqa: S102
    return module


def verl_score(modules, source: str, response: str, truth) -> float:
    gsm8k, math_reward = modules
    with contextlib.redirect_stdout(io.StringIO()):  # math_reward prints its exceptions
        if source in GSM8K_SOURCES:
            return float(gsm8k.compute_score(response, truth))
        if source in MATH_SOURCES:
            return float(math_reward.compute_score(response, truth))
    raise ValueError(f"verl's default has no reward here for {source!r}")


def ours(source: str, response: str, truth) -> float:
    fn = verl_gsm8k_score if source in GSM8K_SOURCES else verl_math_score
    return fn(response, truth)["score"]


def check_cases(modules, write: bool) -> int:
    rows = [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]
    wrong = 0
    for row in rows:
        truth = verl_score(modules, row["data_source"], row["response"], row["ground_truth"])
        if (
            truth != row["verl"]
            or ours(row["data_source"], row["response"], row["ground_truth"]) != truth
        ):
            wrong += 1
            print(f"case differs: {row['why']!r}: verl {truth}, file {row['verl']}")
        row["verl"] = truth
    if write:
        CASES.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} cases, {wrong} differ")
    return wrong


def random_pair(rng: random.Random) -> tuple[str, str]:
    response = "".join(rng.choice(TOKENS) for _ in range(rng.randint(0, 14)))
    if rng.random() < 0.1:  # past verl's 300-character window
        response += "a" * rng.randint(250, 320) + "".join(rng.choice(TOKENS) for _ in range(5))
    truth = "".join(rng.choice(TOKENS[5:]) for _ in range(rng.randint(0, 5)))
    if response and rng.random() < 0.5:  # make matches likely: the truth from the tail
        truth = response[-rng.randint(1, 8) :]
    return response, truth


def check_fuzz(modules, count: int) -> int:
    rng, wrong = random.Random(0), 0
    for _ in range(count):
        response, truth = random_pair(rng)
        for source in (GSM8K_SOURCES[0], MATH_SOURCES[0]):
            if verl_score(modules, source, response, truth) != ours(source, response, truth):
                wrong += 1
                print(f"differs: {source} {response!r} {truth!r}")
    print(f"{2 * count} random items, {wrong} differ")
    return wrong


def check_gsm8k_forms(modules) -> int:
    numbers = ["42", "42.0", "1,250", "1250", "-3", "$5", "5.", ".5", "0,5", "7,", "327"]
    prefixes = [
        "#### ",
        "####",
        "#### $",
        "##### ",
        "# ",
        "x #### ",
        "x" * 299 + "#### ",
        "#### 1 #### ",
    ]
    items = [
        (p + a + "y" * tail, truth)
        for p in prefixes
        for a in numbers
        for tail in (0, 1, 290, 300)
        for truth in numbers
    ]
    wrong = sum(
        verl_score(modules, "openai/gsm8k", r, t) != ours("openai/gsm8k", r, t) for r, t in items
    )
    print(f"{len(items)} GSM8K answer forms, {wrong} differ")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", default="0.9.1", help="the verl release to compare with")
    parser.add_argument("--fuzz", type=int, default=40000, help="random items per source")
    parser.add_argument("--write", action="store_true", help="rewrite the case file's verl column")
    args = parser.parse_args(argv)
    modules = verl_modules(args.verl)
    wrong = (
        check_cases(modules, args.write)
        + check_fuzz(modules, args.fuzz)
        + check_gsm8k_forms(modules)
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
