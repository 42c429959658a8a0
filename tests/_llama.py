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


def check_from_pretrained(out: object, expected: dict[str, torch.Tensor], tie: bool) -> Any:
    """``from_pretrained(out)`` loads a Llama with no missing, unexpected or mismatched key,
    tied as ``tie`` says, every tensor equal to ``expected``'s (its dtype too); the model."""
    import transformers

    loaded, info = transformers.LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert {key: sorted(value) for key, value in info.items()} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    got = loaded.state_dict()
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    return loaded
