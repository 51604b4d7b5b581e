"""Hugging Face Hub model names for ``model.path``, resolved through huggingface_hub's cache.

Why offline-first: training hosts often have no route to huggingface.co, and a run must not
stall on (or silently depend on) the network. A name like ``Qwen/Qwen2.5-0.5B-Instruct`` is
looked up in the local cache first (the layout huggingface_hub writes:
``models--Qwen--Qwen2.5-0.5B-Instruct/{refs/main, snapshots/<commit>/...}``); only when it is
not cached, and ``HF_HUB_OFFLINE`` is not set, are the model's files downloaded. When neither
works the error names the cache that was searched and the ways out. Each role resolves the
name on its own host, against its own cache, so roles on different machines need no shared
filesystem. The environment (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``) is read at call time, not
at import, so a process that sets it after importing huggingface_hub is still obeyed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
"""What a download fetches: config, weights (safetensors only), tokenizer and chat template;
duplicate weight formats (``*.bin``, ``*.h5``, ``*.msgpack``, ONNX, GGUF) are skipped."""

_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps models: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else its
    default (``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``) is set to a true value."""
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in _TRUE


def is_repo_id(name: str) -> bool:
    """Whether ``name`` can be a Hub model id (``org/name`` or ``name``), not a file path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def cached_snapshot(repo_id: str, cache_dir: Path) -> Path | None:
    """The cached snapshot of ``repo_id`` at its ``main`` revision, or None when not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = snapshot_download(
            repo_id, cache_dir=cache_dir, local_files_only=True, allow_patterns=MODEL_FILES
        )
    except LocalEntryNotFoundError:
        return None
    return Path(found)


def download_snapshot(repo_id: str, cache_dir: Path) -> Path | None:
    """Download ``repo_id``'s model files into the cache; None when the Hub cannot be reached;
    FileNotFoundError when the Hub answers that there is no such (accessible) model."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    log.info("downloading %s from the Hugging Face Hub into %s", repo_id, cache_dir)
    try:
        found = snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=MODEL_FILES)
    except LocalEntryNotFoundError as exc:  # what huggingface_hub raises when unreachable
        log.warning("could not download %s: %s", repo_id, exc)
        return None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise FileNotFoundError(
            f"model path not found: {repo_id} is not a local directory, and the Hugging Face "
            f"Hub has no model by that name that this host may read (gated or private models "
            f"need HF_TOKEN): {exc}"
        ) from exc
    return Path(found)


def not_available(repo_id: str, cache_dir: Path, offline: bool) -> FileNotFoundError:
    """The error for a Hub name that is neither cached nor downloadable right now."""
    why = (
        "HF_HUB_OFFLINE is set, so it was not downloaded"
        if offline
        else "the Hugging Face Hub could not be reached to download it"
    )
    return FileNotFoundError(
        f"model path not found: {repo_id} is not a local directory, and as a Hugging Face Hub "
        f"model it is not in the cache {cache_dir} ({why}). Fix: point model.path at a local "
        f"model directory; or download it where there is network (`hf download {repo_id}`, with "
        f"HF_HUB_CACHE set to the cache this host reads) and copy the cache here; or unset "
        f"HF_HUB_OFFLINE on a host that can reach huggingface.co."
    )


def resolve_hub_model(repo_id: str) -> Path:
    """The local snapshot directory of Hub model ``repo_id``: cached, else downloaded unless
    offline; else FileNotFoundError saying what was tried and how to fix it. A short name of a
    model the project builds (``smollm2-135m-instruct``, ``rlfleet.model.local_models``) is
    its built directory in the rlfleet cache instead, or an error naming the build command."""
    from rlfleet.model.local_models import is_local_name, resolve_local_model

    if is_local_name(repo_id):  # built by `make smollm2`, never on the Hub under this name
        return resolve_local_model(repo_id)
    cache_dir, offline = hub_cache_dir(), hub_offline()
    found = cached_snapshot(repo_id, cache_dir)
    if found is None and not offline:
        found = download_snapshot(repo_id, cache_dir)
    if found is None:
        raise not_available(repo_id, cache_dir, offline)
    log.info("model %s resolved to %s", repo_id, found)
    return found
