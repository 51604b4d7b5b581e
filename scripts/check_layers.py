"""Check that imports inside ``rlfleet`` keep the layers of docs/architecture.md.

Why a script, and why the AST: the rules ("arrows point down", "roles meet only through
clients and protos", "common never loads torch") decay one convenient import at a time, and
nobody sees it until a cycle breaks start-up or the router pulls in torch. Reading every file's
``import`` statements (also those inside functions) takes well under a second and runs none of
the code, so ``make test`` runs it first and names the file, the line and the rule broken.

The rules, checked on the packages under ``services/`` (installed as ``rlfleet``):

1. A package imports only its own layer's packages or lower ones (``LAYERS``, bottom first);
   within a layer only the pairs in ``PEER_IMPORTS`` (roles: rule 2).
2. A role imports another role only through its public modules (``ROLE_PUBLIC``: the client,
   the plain types, the proto conversions), save the ``ROLE_EXCEPTIONS`` listed with a reason.
3. No cycle: none between packages (counting every import), none between modules among the
   imports that run at import time (module level, not in a function, not under
   ``if TYPE_CHECKING``), the ones that break start-up, and none among the imports that run
   at all (lazy ones inside functions too; only ``if TYPE_CHECKING`` ones never run), save
   the ``LAZY_CYCLES`` listed with a reason: a lazy import that closes a circle hides two
   modules that need each other, where what both need belongs in a third below them. Nor
   among all imports, ``if TYPE_CHECKING`` ones included: a type-only circle breaks nothing
   at run time, but it is the same two modules needing each other, read by the type checker.
4. ``FORBIDDEN`` third-party imports, anywhere in a package (``common``: no torch, transformers,
   safetensors or vLLM, so every process can import it cheaply).
5. ``ONE_WAY``: inside a package, parts that one part may use but never the other way round
   (the router hosts the OpenAI front and the agent gateway; they never import the router).

Usage: ``python scripts/check_layers.py [--root services]``; exit code 1 on any violation.
Adding a role (or any package) is one name in ``LAYERS``; a package missing from it is an error.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "rlfleet"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("proto", "common")),
    ("libraries", ("model", "rl", "tasks")),
    ("roles", ("rollout", "reward", "refcritic", "trainer", "agent", "env")),
    ("launch", ("launch", "cli", "status_cli", "dashboard")),
]
"""Bottom first. A package may import its own layer's packages only as rules 1 and 2 allow."""

ROLES = dict(LAYERS)["roles"]

PEER_IMPORTS: dict[tuple[str, str], str] = {
    ("tasks", "model"): "tasks.arith_eval scores a local model's greedy completions",
    ("status_cli", "dashboard"): "rlfleet status prints the dashboard's fleet look as a table",
}
"""Imports allowed between two packages of the same layer (importer, imported): reason."""

ROLE_PUBLIC = ("client", "types", "convert")
"""What a role offers other roles: its client, the plain dataclasses its client speaks, and
the conversions between those and its protos (docs/architecture.md: roles meet only through
clients and protos)."""

ROLE_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("rlfleet.env", "rlfleet.agent"): "the env role plays its episodes with rlfleet.agent "
    "(episode record, loop, tools): agent is that role's engine, a package of its own so the "
    "episode bookkeeping stays apart from the queue and server around it",
}
"""Role-internal imports allowed anyway, (importer, imported) as module prefixes: reason. One
that no import uses any more is reported, so the list only holds what is still true."""

LAZY_CYCLES: dict[tuple[str, ...], str] = {}
"""Module cycles through lazy imports allowed anyway (the modules, sorted): reason. One that
is no cycle any more is reported, so the list only holds what is still true."""

ONE_WAY: dict[tuple[str, str], str] = {
    ("rlfleet.rollout.gateway", "rlfleet.rollout.router"): "the router process hosts the "
    "OpenAI front and the agent gateway (rollout.router.http builds their app), and they reach "
    "the router only through gateway.app.Fleet: placement and the HTTP front are one job each",
}
"""Imports forbidden anyway, even type-only ones, (importer, imported) as module prefixes:
reason."""

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "common": ("torch", "transformers", "safetensors", "vllm"),
}
"""Third-party top-level modules a package must not import, not even inside a function."""


@dataclass(frozen=True)
class Import:
    """One imported module, as written in ``path`` at ``line``."""

    path: Path
    line: int
    importer: str
    """The importing module's dotted name (``rlfleet.trainer.ddp``)."""
    target: str
    """The imported module's dotted name, resolved (``rlfleet.common.ray_cluster``)."""
    at_import: bool
    """Runs when the importer is imported (not inside a function, not for type checkers)."""
    for_types: bool = False
    """Only type checkers read it (under ``if TYPE_CHECKING``): it never runs."""


def module_name(root: Path, path: Path) -> str:
    """``services/trainer/ddp.py`` -> ``rlfleet.trainer.ddp``; a package's ``__init__`` is
    the package itself."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def source_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(
    node: ast.AST, at_import: bool, for_types: bool = False
) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Every import statement under ``node``, with whether it runs at import time and whether
    only type checkers read it."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, at_import, for_types
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _walk(child, False, for_types)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), False, True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), at_import, for_types)
        else:
            yield from _walk(child, at_import, for_types)


def _resolve_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The module ``from X import ...`` names, relative imports made absolute."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(root: Path, path: Path, modules: set[str]) -> Iterator[Import]:
    """Every module ``path`` imports. ``from pkg import name`` counts as importing
    ``pkg.name`` when that is one of our modules, else ``pkg``."""
    importer = module_name(root, path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node, at_import, for_types in _walk(tree, True):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, importer, alias.name, at_import, for_types)
            continue
        base = _resolve_from(node, importer, path.name == "__init__.py")
        for alias in node.names:
            target = f"{base}.{alias.name}"
            yield Import(
                path,
                node.lineno,
                importer,
                target if target in modules else base,
                at_import,
                for_types,
            )


def package_of(module: str) -> str | None:
    """``rlfleet.trainer.ddp`` -> ``trainer``; None for ``rlfleet`` itself and third parties."""
    parts = module.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 else None


def layer_of(package: str) -> int | None:
    return next((i for i, (_, names) in enumerate(LAYERS) if package in names), None)


def _where(imp: Import, root: Path) -> str:
    return (
        f"{root.name}/{imp.path.relative_to(root)}:{imp.line}: {imp.importer} imports {imp.target}"
    )


def layer_violation(imp: Import, root: Path) -> str | None:
    """Rules 1 and 2 for one import between two of our packages."""
    src, dst = package_of(imp.importer), package_of(imp.target)
    if src is None or dst is None or src == dst:
        return None
    src_layer, dst_layer = layer_of(src), layer_of(dst)
    if src_layer is None:
        return None  # reported once for its file by ``check``
    if dst_layer is None:
        return f"{_where(imp, root)}: package {dst!r} is in no layer (add it to LAYERS)"
    if src_layer < dst_layer:
        return (
            f"{_where(imp, root)}: layer '{LAYERS[src_layer][0]}' ({src}) may not import "
            f"the higher layer '{LAYERS[dst_layer][0]}' ({dst}); arrows point down"
        )
    if src_layer > dst_layer or (src, dst) in PEER_IMPORTS:
        return None
    if src in ROLES and dst in ROLES:
        return role_violation(imp, root, dst)
    return (
        f"{_where(imp, root)}: {src} and {dst} share the layer '{LAYERS[src_layer][0]}'"
        f" and this import is not in PEER_IMPORTS"
    )


def role_violation(imp: Import, root: Path, dst: str) -> str | None:
    """Rule 2: another role only through ``ROLE_PUBLIC`` (or a listed exception)."""
    inner = imp.target.split(".")[2:3]
    if inner and inner[0] in ROLE_PUBLIC or _excepted(imp):
        return None
    return (
        f"{_where(imp, root)}: a role reaches into another role's internals ({dst}); "
        f"roles meet only through clients and protos (allowed: "
        f"{', '.join(f'{dst}.{m}' for m in ROLE_PUBLIC)})"
    )


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _matches(pair: tuple[str, str], imp: Import) -> bool:
    return _within(imp.importer, pair[0]) and _within(imp.target, pair[1])


def _excepted(imp: Import) -> bool:
    return any(_matches(pair, imp) for pair in ROLE_EXCEPTIONS)


def forbidden_violation(imp: Import, root: Path) -> str | None:
    """Rule 4."""
    src = package_of(imp.importer)
    top = imp.target.split(".")[0]
    if src in FORBIDDEN and top in FORBIDDEN[src]:
        return f"{_where(imp, root)}: {src} must not import {top} (not even lazily)"
    return None


def one_way_violation(imp: Import, root: Path) -> str | None:
    """Rule 5."""
    for (src, dst), reason in ONE_WAY.items():
        if _matches((src, dst), imp):
            return f"{_where(imp, root)}: {src} may not import {dst} ({reason})"
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself
    (Tarjan's algorithm, iterative: the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def stale_exceptions(imports: list[Import], modules: set[str]) -> list[str]:
    """``ROLE_EXCEPTIONS`` entries whose importer exists but no longer makes that import."""
    used = {pair for imp in imports for pair in ROLE_EXCEPTIONS if _matches(pair, imp)}
    present = {pair for pair in ROLE_EXCEPTIONS if any(_within(m, pair[0]) for m in modules)}
    return [
        f"scripts/check_layers.py: ROLE_EXCEPTIONS entry {pair} matches no import; remove it"
        for pair in sorted(present - used)
    ]


def lazy_cycle_problems(
    root: Path, runs: dict[str, set[str]], start_up: list[list[str]]
) -> list[str]:
    """Rule 3 for the imports that run at all: cycles beyond the start-up ones reported
    already, save ``LAZY_CYCLES``, and entries of ``LAZY_CYCLES`` that are no cycle."""
    found = [tuple(c) for c in cycles(runs) if c not in start_up]
    problems = [
        f"{root.name}/: import cycle through lazy imports among {', '.join(c)}; move "
        "what both need below both"
        for c in found
        if c not in LAZY_CYCLES
    ]
    present = {pair for pair in LAZY_CYCLES if all(m in runs for m in pair)}
    return problems + [
        f"scripts/check_layers.py: LAZY_CYCLES entry {pair} is no cycle; remove it"
        for pair in sorted(present - set(found))
    ]


def type_cycle_problems(
    root: Path, typed: dict[str, set[str]], runs: dict[str, set[str]]
) -> list[str]:
    """Rule 3 for all imports: cycles that only ``if TYPE_CHECKING`` imports close (those
    that run are reported already, or listed in ``LAZY_CYCLES``)."""
    running = cycles(runs)
    return [
        f"{root.name}/: import cycle through type-only imports among {', '.join(c)}; move "
        "the types both need below both"
        for c in cycles(typed)
        if c not in running
    ]


def check(root: Path) -> list[str]:
    """Every violation under ``root`` (the folder installed as ``rlfleet``), one line each."""
    files = list(source_files(root))
    modules = {module_name(root, path) for path in files}
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    runs: dict[str, set[str]] = {m: set() for m in modules}
    typed: dict[str, set[str]] = {m: set() for m in modules}
    packages: dict[str, set[str]] = {}
    all_imports: list[Import] = []
    for path in files:
        package = package_of(module_name(root, path))
        if package is not None and layer_of(package) is None:
            problems.append(
                f"{root.name}/{path.relative_to(root)}: package {package!r} is in no "
                "layer (add it to LAYERS in scripts/check_layers.py)"
            )
        for imp in imports_of(root, path, modules):
            all_imports.append(imp)
            problems += filter(
                None,
                [
                    layer_violation(imp, root),
                    forbidden_violation(imp, root),
                    one_way_violation(imp, root),
                ],
            )
            if imp.target in modules and imp.target != imp.importer:
                typed[imp.importer].add(imp.target)
            if not imp.for_types and imp.target in modules and imp.target != imp.importer:
                runs[imp.importer].add(imp.target)
                if imp.at_import:
                    graph[imp.importer].add(imp.target)
            src, dst = package_of(imp.importer), package_of(imp.target)
            if src and dst and src != dst:
                packages.setdefault(src, set()).add(dst)
    problems += stale_exceptions(all_imports, modules)
    start_up = cycles(graph)
    for component in start_up:
        problems.append(f"{root.name}/: import cycle at import time among {', '.join(component)}")
    problems += lazy_cycle_problems(root, runs, start_up)
    problems += type_cycle_problems(root, typed, runs)
    for component in cycles(packages):
        problems.append(f"{root.name}/: packages import each other: {', '.join(component)}")
    return sorted(set(problems))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[1] / "services"
    parser.add_argument("--root", type=Path, default=default, help="the folder named rlfleet")
    args = parser.parse_args(argv)
    problems = check(args.root.resolve())
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(
            f"check_layers: {len(problems)} violation(s); see docs/architecture.md", file=sys.stderr
        )
        return 1
    print("check_layers: the layers hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
