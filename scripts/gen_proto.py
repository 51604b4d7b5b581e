"""Generate the Python gRPC stubs for protos/rlfleet/v1 into services/proto (``rlfleet.proto``).

protoc writes imports as ``from rlfleet.v1 import common_pb2``; we rewrite them to the
package the stubs live in (``rlfleet.proto``) so no ``sys.path`` tricks are needed. ``--check``
regenerates into a temporary directory and fails when the committed stubs differ.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
OUT_PACKAGE = "rlfleet.proto"
OUT_DIR = ROOT / "services" / "proto"
INIT_TEXT = '"""Generated gRPC stubs for the rlfleet.v1 protos (scripts/gen_proto.py)."""\n'
IMPORT_RE = re.compile(r"^from rlfleet\.v1 import", re.MULTILINE)


def generate(out_dir: Path) -> None:
    """Run protoc (python, grpc, mypy stubs) into ``out_dir`` (flat) and fix the imports."""
    import os

    from grpc_tools import protoc

    # protoc finds the mypy plugins on PATH; they live next to this interpreter.
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    nested = out_dir / "rlfleet" / "v1"
    for path in sorted(nested.glob("*.py*")):
        text = IMPORT_RE.sub(f"from {OUT_PACKAGE} import", path.read_text())
        (out_dir / path.name).write_text(text)
    shutil.rmtree(out_dir / "rlfleet")
    (out_dir / "__init__.py").write_text(INIT_TEXT)


def stale_files(fresh: Path, committed: Path) -> list[str]:
    """Names of generated files that differ between two trees."""
    fresh_files = {p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()}
    old_files = {
        p.relative_to(committed)
        for p in committed.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    diff = sorted(str(p) for p in fresh_files ^ old_files)
    for rel in fresh_files & old_files:
        if not filecmp.cmp(fresh / rel, committed / rel, shallow=False):
            diff.append(str(rel))
    return diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        if args.check:
            diff = stale_files(fresh, OUT_DIR)
            if diff:
                print("stale generated proto code (run `make proto`):", *diff, sep="\n  ")
                return 1
            print("proto stubs are up to date")
            return 0
        shutil.rmtree(OUT_DIR, ignore_errors=True)
        shutil.copytree(fresh, OUT_DIR)
    print(f"wrote stubs to {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
