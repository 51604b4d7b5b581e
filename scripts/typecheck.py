"""Type-check ``services/`` (the package ``rlfleet``) and the test doubles, against a baseline
that may only shrink.

Why: the trainer talks to its services through small Protocols (``trainer/fleet.py``,
``trainer/episodes.py``), and the unit tests hand it in-process fakes. Without a checker the
two drift apart silently, and production code grows a ``getattr`` to fit a fake. mypy holds
both to the Protocols: the fakes subclass them (``FAKES`` below are checked with the package).

The errors that were there when the check came in are listed in ``typecheck_baseline.txt``
(``path: [code] message`` per error, no line numbers, so editing a file elsewhere does not move
them). The check fails when an error appears that the baseline does not list (fix it), and
also when a listed one no longer occurs (``--shrink`` drops it from the baseline), so the
baseline only ever gets smaller. mypy follows only the few third-party packages whose types
the seams use (pydantic, redis, protobuf, httpx, yaml); torch, transformers, vLLM, Ray and the
rest are ``Any`` to it, which keeps a cold run (a fresh clone, as in CI) around 10 to 20 s.

Usage: ``python scripts/typecheck.py [--shrink]`` (``make typecheck``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "scripts" / "typecheck_baseline.txt"
WORK = ROOT / ".venv" / "typecheck"
"""mypy's search path (``rlfleet`` -> ``services/``, as the installed package maps it) and
its cache; inside the ignored ``.venv``."""

FAKES = (
    "tests/unit/trainer_fakes.py",
    "tests/unit/test_val_metrics.py",
    "tests/unit/test_step_retry.py",
    "tests/unit/test_critic_checkpoint.py",
    "tests/unit/test_trainer_step.py",
    "tests/unit/test_async_training.py",
    "tests/unit/test_trainer_episodes.py",
    "tests/unit/test_agent_loop.py",
    "tests/unit/test_difficulty_filter.py",
    "tests/unit/default_job_inprocess.py",
    "tests/integration/test_ddp_actor.py",
    "tests/integration/test_weight_updates.py",
    "tests/integration/replica_weights.py",
    "tests/unit/test_weights_shm.py",
    "tests/unit/test_weight_check.py",
    "tests/unit/test_weight_check_pushes.py",
)
"""Test modules whose doubles stand in for a Protocol of the package (the trainer's services,
its step writer, a turn generator, a replica directory, a progress bar): each subclasses the
one it replaces, and they are checked together with the package."""


def run_mypy() -> list[str]:
    """mypy's error lines, paths as in the repository (``services/...``, ``tests/...``)."""
    WORK.mkdir(parents=True, exist_ok=True)
    link = WORK / "rlfleet"
    if link.is_symlink() and link.resolve() != (ROOT / "services").resolve():
        link.unlink()  # a venv copied from another checkout
    if not link.is_symlink():
        link.symlink_to(ROOT / "services", target_is_directory=True)
    paths = [WORK, *{ROOT / Path(fake).parent for fake in FAKES}, ROOT / "tests"]
    env = {**os.environ, "MYPYPATH": os.pathsep.join(map(str, paths))}
    fakes = [arg for fake in FAKES for arg in ("-m", Path(fake).stem)]  # tests import them so
    argv = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(WORK / "cache"),
        "--no-error-summary",
        "--no-pretty",
        "--hide-error-context",
        "-p",
        "rlfleet",
        *fakes,
    ]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1) or done.stderr.strip():
        raise SystemExit(
            f"mypy failed to run (exit {done.returncode}):\n{done.stderr}{done.stdout}"
        )
    prefix = os.path.relpath(link, ROOT) + os.sep
    lines = [
        line.replace(prefix, "services/", 1) if line.startswith(prefix) else line
        for line in done.stdout.splitlines()
    ]
    return [line for line in lines if ": error: " in line]


def key(line: str) -> str:
    """``path: [code] message`` of ``path:line: error: message  [code]``."""
    where, message = line.split(": error: ", 1)
    path = where.split(":", 1)[0]
    text, _, code = message.rpartition("  [")
    return f"{path}: [{code.rstrip(']')}] {text}" if text else f"{path}: {message}"


def read_baseline() -> Counter[str]:
    if not BASELINE.exists():
        return Counter()
    lines = BASELINE.read_text().splitlines()
    return Counter(line for line in lines if line and not line.startswith("#"))


def write_baseline(keys: Counter[str]) -> None:
    header = (
        "# mypy errors allowed in services/ and the test doubles (scripts/typecheck.py).\n"
        "# One line per error, no line numbers. Only ever remove lines: fix new errors.\n"
    )
    BASELINE.write_text(header + "".join(f"{k}\n" for k in sorted(keys.elements())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shrink",
        action="store_true",
        help="drop the baseline's lines that no longer occur (never adds one)",
    )
    args = parser.parse_args(argv)
    errors = run_mypy()
    found, allowed = Counter(map(key, errors)), read_baseline()
    new, gone = found - allowed, allowed - found
    if args.shrink and gone:
        write_baseline(allowed - gone)
        print(
            f"typecheck: baseline shrunk by {sum(gone.values())} to "
            f"{sum((allowed - gone).values())} errors"
        )
        gone = Counter()
    for line in errors:
        if new[key(line)] > 0:
            print(line)
    if new:
        print(
            f"typecheck: {sum(new.values())} new error(s) beyond the baseline "
            f"({os.path.relpath(BASELINE, ROOT)}): fix them"
        )
    if gone:
        for line in sorted(gone.elements()):
            print(f"fixed: {line}")
        print(
            f"typecheck: {sum(gone.values())} baseline error(s) no longer occur: run "
            "`python scripts/typecheck.py --shrink` to drop them from the baseline"
        )
    if new or gone:
        return 1
    print(f"typecheck: ok ({sum(found.values())} baseline errors left)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
