"""The GPT-like decoder the training-state benchmark checkpoints, and the values it checks.

A torchtitan-style Llama block without its rotary embedding: RMSNorm, attention with separate
q/k/v/o projections, SwiGLU feed-forward, no biases; token embeddings and the output projection
are separate (untied) parameters. The benchmark never cares about what the model computes, only
about its parameters and the AdamW state they carry, but it runs real forward/backward/optimizer
steps under FSDP2 so the state is what a training job checkpoints.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes of one model."""

    vocab: int
    dim: int
    layers: int
    heads: int
    hidden: int
    """Width of the SwiGLU feed-forward."""

    def num_params(self) -> int:
        """Number of parameters."""
        per_layer = 4 * self.dim * self.dim + 3 * self.dim * self.hidden + 2 * self.dim
        return 2 * self.vocab * self.dim + self.layers * per_layer + self.dim

    def num_tensors(self) -> int:
        """Tensors in ``get_state_dict`` of the model and its AdamW: each parameter, its
        ``exp_avg``, ``exp_avg_sq`` and ``step``."""
        return 4 * (3 + 9 * self.layers)


# About 106M parameters, 300 tensors (1.28 GB with AdamW's two moments).
BIG = ModelShape(vocab=32000, dim=768, layers=8, heads=12, hidden=2048)
# About 8,000 tensors of 0.25-128 KiB: many thin layers.
MANY_SMALL = ModelShape(vocab=512, dim=64, layers=222, heads=4, hidden=128)
# Smaller stand-ins for --quick.
QUICK_BIG = ModelShape(vocab=8000, dim=256, layers=4, heads=4, hidden=640)
QUICK_SMALL = ModelShape(vocab=512, dim=64, layers=56, heads=4, hidden=128)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, eps=1e-6)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.wq = nn.Linear(shape.dim, shape.dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.dim, bias=False)
        self.wo = nn.Linear(shape.dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            split(self.wq(x)), split(self.wk(x)), split(self.wv(x)), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, dim))


class FeedForward(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.hidden, bias=False)
        self.w2 = nn.Linear(shape.hidden, shape.dim, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(shape.dim)
        self.attention = Attention(shape)
        self.ffn_norm = RMSNorm(shape.dim)
        self.feed_forward = FeedForward(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.dim)
        self.layers = nn.ModuleDict({str(i): Block(shape) for i in range(shape.layers)})
        self.norm = RMSNorm(shape.dim)
        self.output = nn.Linear(shape.dim, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))


# -- the values every checkpointed tensor holds ----------------------------------------------

PATTERN_MODULUS = 1021


def key_salt(key: str) -> int:
    """A small number derived from a state-dict key, so tensors differ from one another."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") % 997


def pattern(first: int, count: int, salt: int) -> torch.Tensor:
    """Elements ``first .. first+count`` (row-major) of the pattern of a tensor with ``salt``:
    element ``i`` is ``(7 i + salt) mod 1021`` (exact in float32), as a flat float32 tensor."""
    index = torch.arange(first, first + count, dtype=torch.int64)
    return ((index * 7 + salt) % PATTERN_MODULUS).to(torch.float32)
