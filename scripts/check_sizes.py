"""Check that the code under ``services/`` keeps its size limits: no file over 400 lines, no
entry point over 60.

Why a script: the limits were kept once by memory and four files regrew past 400 lines after
the pass that cut them. Counting lines takes well under a second and runs none of the code,
so ``make test`` runs it beside ``check_layers.py`` and names every file past its limit.

The limits, on every ``.py`` file under ``services/`` (installed as ``rlfleet``):

1. A file has at most ``MAX_FILE_LINES`` lines. Generated protobuf and gRPC stubs
   (``services/proto/*_pb2.py``, ``*_pb2_grpc.py``) are exempt: nobody edits them.
2. An entry point is short (``MAX_MAIN_LINES``): every ``main.py`` module, and every function
   named ``main``, assemble the process elsewhere and start it (docs/architecture.md).

``ALLOWED`` lists files let past a limit anyway, each with its reason; an entry whose file is
back within its limit (or gone) is reported, so the list only holds what is still true.

Usage: ``python scripts/check_sizes.py [--root services]``; exit code 1 on any violation.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_FILE_LINES = 400
MAX_MAIN_LINES = 60

ALLOWED: dict[str, str] = {}
"""Paths relative to the root (``trainer/actor.py``): why the file may be past its limit for
now. Keep it empty; a file that grew past a limit is split by job, not listed here."""


def is_generated(path: Path) -> bool:
    """Protobuf and gRPC stubs that ``scripts/gen_proto.py`` writes."""
    return path.stem.endswith(("_pb2", "_pb2_grpc"))


def source_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" not in path.parts and not is_generated(path):
            yield path


def long_mains(path: Path, text: str) -> Iterator[tuple[int, int]]:
    """(line, length) of every function named ``main`` in ``text`` over ``MAX_MAIN_LINES``."""
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "main":
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_MAIN_LINES:
                yield node.lineno, length


def problems_of(root: Path, path: Path) -> list[str]:
    """This file's violations, one line each."""
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    where = f"{root.name}/{path.relative_to(root)}"
    found = []
    if lines > MAX_FILE_LINES:
        found.append(f"{where}: {lines} lines (at most {MAX_FILE_LINES}); split it by job")
    if path.name == "main.py" and lines > MAX_MAIN_LINES:
        found.append(
            f"{where}: an entry point of {lines} lines (at most {MAX_MAIN_LINES}); "
            "assemble the process elsewhere"
        )
    for line, length in long_mains(path, text):
        found.append(
            f"{where}:{line}: main() is {length} lines (at most {MAX_MAIN_LINES}); "
            "move its steps into named functions"
        )
    return found


def check(root: Path) -> list[str]:
    """Every violation under ``root`` (the folder installed as ``rlfleet``), one line each."""
    problems: list[str] = []
    over: set[str] = set()
    for path in source_files(root):
        found = problems_of(root, path)
        relative = path.relative_to(root).as_posix()
        if found:
            over.add(relative)
        if relative not in ALLOWED:
            problems += found
    for relative in sorted(set(ALLOWED) - over):
        problems.append(
            f"scripts/check_sizes.py: ALLOWED entry {relative!r} is within its "
            "limits (or gone); remove it"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[1] / "services"
    parser.add_argument("--root", type=Path, default=default, help="the folder named rlfleet")
    args = parser.parse_args(argv)
    problems = check(args.root.resolve())
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"check_sizes: {len(problems)} violation(s)", file=sys.stderr)
        return 1
    print("check_sizes: every file and entry point within its limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
