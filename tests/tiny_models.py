"""Randomly initialised tiny Qwen2 models for fast tests (the committed, trained policy lives
in models/tiny-qwen2-arith). pytest puts this folder on sys.path (tests/conftest.py)."""

from __future__ import annotations


def random_qwen2(
    hidden: int, layers: int, heads: int, kv_heads: int, vocab: int = 16, seed: int = 0, **extra
):
    """A ``Qwen2ForCausalLM`` with tied embeddings, MLP width ``2 * hidden``, 32 positions."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        **extra,
    )
    return Qwen2ForCausalLM(config)
