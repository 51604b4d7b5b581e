"""Where checkpoints live, which one a run resumes from, how many are kept, and the RNG state
that makes a resumed run continue exactly as an uninterrupted one would.

Layout (verl's names): ``<run_dir>/checkpoints/global_step_<N>/`` holds the Hugging Face
weights and tokenizer plus ``trainer_state.pt`` (optimizer, schedule, step, weight version,
data position, RNG states, the in-reward KL coefficient) and, in GAE runs, ``critic/`` (the
critic's weights, optimizer and step, written by the refcritic); with LoRA
(``model.lora_rank``) the HF weights are the merged export and ``adapter/`` holds the peft
adapter, which is what a resume loads (over the base in ``model.path``);
``checkpoints/final`` is written at the end of a run and is not a resume point.
``trainer.resume_mode``: ``auto`` resumes from the newest ``global_step_N`` in ``run_dir`` when
there is one (else starts fresh), ``disable`` always starts fresh, and any other value is the
checkpoint directory to resume from.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
from pathlib import Path

import torch

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import InvalidArgument

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^global_step_(\d+)$")
STATE_FILE = "trainer_state.pt"
CRITIC_DIR = "critic"
"""Sub-directory of a checkpoint the refcritic writes the critic into (GAE runs). The path
is handed to the refcritic as an absolute path: it must reach the same directory (a local
fleet, or a volume shared between the trainer and the refcritic)."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"global_step_{step}"


def step_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete ``global_step_N`` checkpoints (with a state file), oldest first."""
    root = checkpoint_root(run_dir)
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        match = STEP_DIR.match(path.name)
        if match and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def resume_path(config: RlfleetConfig) -> Path | None:
    """The checkpoint this run continues from, or None for a fresh start."""
    cfg = config.trainer
    if cfg.resume_from:  # the explicit path wins (older configs use this key)
        return Path(cfg.resume_from)
    if cfg.resume_mode == "disable":
        return None
    if cfg.resume_mode == "auto":
        found = step_checkpoints(config.run_dir)
        return found[-1][1] if found else None
    path = Path(cfg.resume_mode)
    if not (path / STATE_FILE).is_file():
        raise InvalidArgument(f"trainer.resume_mode: {path} is not a checkpoint (no {STATE_FILE})")
    return path


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` step checkpoints (0 = keep all); returns the deleted."""
    found = step_checkpoints(run_dir)
    doomed = [path for _, path in found[:-keep]] if keep and len(found) > keep else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed old checkpoint %s (trainer.max_ckpt_to_keep=%d)", path, keep)
    return doomed


def rng_state() -> dict:
    """Every random generator the trainer draws from (torch CPU and CUDA, Python)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
