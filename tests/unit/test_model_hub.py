"""Hugging Face Hub names in ``model.path``: resolved from huggingface_hub's cache, never from
the network when cached, and a clear error when neither a directory nor cached.

The cache is built by hand in ``tmp_path`` in huggingface_hub's own layout (content-addressed
blobs, ``refs/main`` naming the commit, ``snapshots/<commit>/`` linking to the blobs) from the
tiny model in ``models/``; huggingface_hub's cache scanner must read it back, so the layout is
the real one. No test here reaches the network.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from rlfleet.model.hub import is_repo_id
from rlfleet.model.model_io import load_causal_lm, load_tokenizer, local_model_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-qwen2-arith"
REPO = "rlfleet-test/tiny-qwen2-arith"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_hub_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """``source``'s files cached as Hub model ``repo_id`` at ``commit``; returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local folder shadows the name
    return cache


def test_the_hand_built_cache_is_huggingface_hubs_layout(hub_cache):
    from huggingface_hub import scan_cache_dir

    build_hub_cache(hub_cache, REPO, TINY)
    [repo] = scan_cache_dir(hub_cache).repos
    assert (repo.repo_id, repo.repo_type, set(repo.refs)) == (REPO, "model", {"main"})
    [revision] = repo.revisions
    assert revision.commit_hash == COMMIT and len(revision.files) == len(list(TINY.iterdir()))
    assert repo.refs["main"] == revision


def test_hub_name_loads_from_the_cache(hub_cache):
    snapshot = build_hub_cache(hub_cache, REPO, TINY)
    assert local_model_dir(REPO) == snapshot
    tokenizer = load_tokenizer(REPO)
    assert tokenizer("12+34=").input_ids == load_tokenizer(TINY)("12+34=").input_ids
    model = load_causal_lm(REPO)
    assert model.num_parameters() == load_causal_lm(TINY).num_parameters()


def test_cached_name_is_used_without_trying_the_network(hub_cache, monkeypatch):
    """Offline-first: with HF_HUB_OFFLINE unset and the Hub unreachable, a cached model
    still resolves (the cache is read before any request)."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    snapshot = build_hub_cache(hub_cache, REPO, TINY)
    assert local_model_dir(REPO) == snapshot


def test_uncached_name_offline_says_so_and_how_to_fix_it(hub_cache):
    with pytest.raises(FileNotFoundError) as error:
        local_model_dir("rlfleet-test/not-cached")
    message = str(error.value)
    assert "model path not found: rlfleet-test/not-cached" in message
    assert str(hub_cache) in message and "HF_HUB_OFFLINE is set" in message
    assert "hf download rlfleet-test/not-cached" in message


def test_uncached_name_with_the_hub_unreachable_says_so(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # connection refused
    with pytest.raises(FileNotFoundError, match="Hub could not be reached") as error:
        local_model_dir("rlfleet-test/not-cached")
    assert str(hub_cache) in str(error.value)


@pytest.mark.parametrize(
    ("name", "hub"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("gpt2", True),
        ("/abs/path/model", False),
        ("./model", False),
        ("a/b/c", False),
    ],
)
def test_which_names_are_hub_ids(name, hub):
    assert is_repo_id(name) is hub


def test_a_missing_path_that_cannot_be_a_hub_id_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path not found: .*Hub model id like"):
        local_model_dir(tmp_path / "no" / "such" / "model")
