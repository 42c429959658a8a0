"""Hugging Face safetensors weights in and out of a sharded job, without a gather
(``docs/huggingface.md``): ``files`` (names, split, index; pure), ``headers`` (headers checked;
pure), ``keys`` (key mapping; pure), ``directory`` (the one writer of a model directory),
``load``, ``save`` (``save_safetensors``, from a sharded job) and ``consolidation``
(``consolidate``, from a saved checkpoint)."""

from shardwise.checkpoint.huggingface.consolidation import consolidate
from shardwise.checkpoint.huggingface.load import load_safetensors
from shardwise.checkpoint.huggingface.save import save_safetensors

__all__ = ["consolidate", "load_safetensors", "save_safetensors"]
