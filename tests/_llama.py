"""The tiny Llama that the Hugging Face tests build from a config (no download)."""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama(tie: bool) -> Any:
    """A 2-layer Llama of width 32 over 64 tokens, seeded; ``tie``: lm_head is the embedding."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config)
