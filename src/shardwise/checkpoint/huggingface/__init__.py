"""Hugging Face safetensors weights in and out of a sharded job, without a gather
(``docs/huggingface.md``): ``files`` (names, split, index; pure), ``headers`` (headers checked;
pure), ``keys`` (key mapping; pure), ``load`` and ``save``."""

from shardwise.checkpoint.huggingface.load import load_safetensors
from shardwise.checkpoint.huggingface.save import save_safetensors

__all__ = ["load_safetensors", "save_safetensors"]
