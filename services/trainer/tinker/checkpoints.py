"""``tinker://`` paths and the folders behind them, under ``run_dir/tinker/``.

A training-state save (``save_state``) is ``tinker://<model_id>/weights/<name>``; a sampler save
(``save_weights_for_sampler``) is ``tinker://<model_id>/sampler_weights/<name>``: the SDK's own
layout, so its path parsing works unchanged. Both hold the adapter's tensors, its optimizer
state and a ``adapter.json`` (base model, rank, modules, ``ttl_seconds`` as asked: recorded,
not enforced; checkpoints live as long as the run directory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rlfleet.common.errors import InvalidArgument, NotFound

SCHEME = "tinker://"
KINDS = {"weights": "training state", "sampler_weights": "sampler weights"}
NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass(frozen=True)
class CheckpointPath:
    model_id: str
    kind: str
    """``weights`` or ``sampler_weights``."""
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"

    def folder(self, root: Path) -> Path:
        return root / self.model_id.replace(":", "_") / self.kind / self.name


def checkpoint_name(name: str) -> str:
    """``name`` when it is a usable folder name (letters, digits, ``._-``), else InvalidArgument."""
    if not NAME.match(name) or name in (".", ".."):
        raise InvalidArgument(f"checkpoint name {name!r}: use 1-128 letters, digits, '.', '_', '-'")
    return name


def parse(uri: str) -> CheckpointPath:
    """``tinker://<model_id>/<kind>/<name>`` -> its parts; InvalidArgument if malformed."""
    parts = uri.removeprefix(SCHEME).split("/") if uri.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in KINDS:
        raise InvalidArgument(
            f"not a checkpoint path of this server: {uri!r} (expected "
            f"{SCHEME}<model_id>/weights|sampler_weights/<name>)"
        )
    return CheckpointPath(parts[0], parts[1], checkpoint_name(parts[2]))


def existing(uri: str, root: Path) -> tuple[CheckpointPath, Path]:
    """The parsed path and its folder, which must exist (NotFound otherwise)."""
    path = parse(uri)
    folder = path.folder(root)
    if not folder.is_dir():
        raise NotFound(f"no checkpoint at {uri}")
    return path, folder
