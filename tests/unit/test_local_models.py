"""``model.path: smollm2-135m-instruct``: the short name of the model ``make smollm2`` builds
(scripts/build_smollm2.py) into the rlfleet cache. Unbuilt or half-built, it is an error naming
``make smollm2``; a corrupt or truncated GGUF is refused before anything is written; built,
the name loads a real instruct model that answers through its chat template.

Nothing here converts the real model (``make test`` must not download or convert 93 MB): the
test of the built model runs only where ``make smollm2`` has been run, and says so otherwise.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from rlfleet.model.local_models import (
    MANIFEST,
    SMOLLM2,
    is_built,
    model_dir,
    read_manifest,
    rlfleet_cache_dir,
)
from rlfleet.model.model_io import local_model_dir

ROOT = Path(__file__).resolve().parents[2]
BUILT = model_dir(SMOLLM2)  # the real cache, read before any test moves RLFLEET_CACHE


def load_script():
    spec = importlib.util.spec_from_file_location(
        "build_smollm2", ROOT / "scripts" / "build_smollm2.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build_smollm2 = load_script()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local folder named like the model
    return tmp_path / "cache"


def test_the_cache_follows_rlfleet_cache(cache, monkeypatch):
    assert rlfleet_cache_dir() == cache and model_dir(SMOLLM2) == cache / "models" / SMOLLM2
    monkeypatch.delenv("RLFLEET_CACHE")
    assert rlfleet_cache_dir() == Path("~/.cache/rlfleet").expanduser()


@pytest.mark.parametrize("name", [SMOLLM2, f"{SMOLLM2}-fp32"])
def test_not_built_names_the_command(cache, name):
    with pytest.raises(FileNotFoundError, match=r"does not exist.*run `make smollm2`"):
        local_model_dir(name)


def test_a_half_written_directory_is_not_taken_for_a_model(cache):
    folder = model_dir(SMOLLM2)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # a build stopped before its manifest
    with pytest.raises(FileNotFoundError, match=r"incomplete.*`make smollm2`"):
        local_model_dir(SMOLLM2)
    (folder / MANIFEST).write_text('{"name": "smollm2-135m-instruct"}')
    assert local_model_dir(SMOLLM2) == folder and read_manifest(folder)["name"] == SMOLLM2


def small_gguf(path: Path) -> Path:
    gguf = pytest.importorskip("gguf", reason="the `smollm2` extra (make smollm2) is not installed")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_whole_gguf_passes_the_check(tmp_path):
    build_smollm2.check_gguf(small_gguf(tmp_path / "whole.gguf"))


@pytest.mark.parametrize("keep", [3, 100, 11544, 16543])
def test_corrupt_or_truncated_gguf_is_refused_and_nothing_is_written(cache, tmp_path, keep):
    data = small_gguf(tmp_path / "whole.gguf").read_bytes()
    (cut := tmp_path / "cut.gguf").write_bytes(data[:keep])
    with pytest.raises(build_smollm2.BadGGUF, match="not a GGUF file|corrupt or truncated"):
        build_smollm2.build(cut, ["bf16", "fp32"])
    assert not (cache / "models").exists()
    assert build_smollm2.main(["--gguf", str(cut)]) == 2  # the command line: an error, exit 2


def test_garbage_is_not_a_gguf(cache, tmp_path):
    (bad := tmp_path / "bad.gguf").write_bytes(b"<html>not found</html>" * 10)
    with pytest.raises(build_smollm2.BadGGUF, match="not a GGUF file"):
        build_smollm2.check_gguf(bad)


def test_what_is_built_is_not_rebuilt(cache, tmp_path):
    for kind in ("bf16", "fp32"):
        folder = model_dir(build_smollm2.NAMES[kind])
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / MANIFEST).write_text("{}")
    missing = tmp_path / "never-read.gguf"  # a rebuild would have to read it
    assert build_smollm2.build(missing, ["bf16", "fp32"]) == [
        model_dir(SMOLLM2),
        model_dir(f"{SMOLLM2}-fp32"),
    ]


@pytest.mark.slow
@pytest.mark.skipif(not is_built(BUILT), reason=f"{BUILT} not built: run `make smollm2`")
def test_the_built_model_answers_through_its_chat_template(monkeypatch):
    import torch

    from rlfleet.model.model_io import encode_prompt, load_causal_lm, load_tokenizer

    monkeypatch.setenv("RLFLEET_CACHE", str(BUILT.parents[1]))
    tokenizer, model = load_tokenizer(SMOLLM2), load_causal_lm(SMOLLM2, "float32")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.num_parameters() == read_manifest(BUILT)["parameters"] == 134_515_008
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49_152
    assert next(model.parameters()).dtype == torch.float32  # bf16 on disk, fp32 as asked
    ids = encode_prompt(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}])
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, len(ids) :])
    assert "5" in answer and tokenizer.eos_token == "<|im_end|>", answer


def test_a_context_longer_than_the_models_is_refused(tmp_path):
    from rlfleet.model.local_models import check_context, context_window

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    assert context_window(str(tmp_path)) == 2048
    check_context(str(tmp_path), 2048)
    with pytest.raises(ValueError, match=r"max_model_len 4096 .* context of model .*: 2048 tok"):
        check_context(str(tmp_path), 4096)
    assert context_window("Qwen/Qwen2.5-0.5B-Instruct") is None  # a Hub id: checked on load
    check_context(str(tmp_path / "missing"), 10**6)
