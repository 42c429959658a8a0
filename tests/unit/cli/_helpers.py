"""What the command-line tests share: a state dict with every kind of value (saved by the
``source`` fixture of ``conftest.py``), running ``shardwise`` in this process, and finding and
damaging the bytes of a chunk."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise import cli
from shardwise.checkpoint import MetadataIndex
from shardwise.local_shards import LocalShardsWrapper

OBJECT_KEYS = ["blob", "cfg.lr", "cfg.name", "raw", "step"]


def _column_shards(full: torch.Tensor) -> LocalShardsWrapper:
    """Two column shards of ``full`` on this process: a tensor saved as two chunks."""
    return LocalShardsWrapper(
        [full[:, :1].contiguous(), full[:, 1:].contiguous()], [(0, 0), (0, 1)]
    )


def _source() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A state dict with every kind of value, and the full tensor of every tensor key."""
    g = torch.Generator().manual_seed(0)
    sharded = torch.randn(6, 4, generator=g)
    tensors = {
        "cplx": torch.randn(3, dtype=torch.complex128, generator=g),
        "ids": torch.arange(10, dtype=torch.int64),
        "layer.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "layer.weight": torch.randn(8, 4, generator=g),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.25, dtype=torch.float64),
        "sharded": sharded,
    }
    state_dict: dict[str, Any] = {
        "layer": {"weight": tensors["layer.weight"].clone(), "bias": tensors["layer.bias"].clone()},
        "scale": tensors["scale"].clone(),
        "ids": tensors["ids"].clone(),
        "mask": tensors["mask"].clone(),
        "cplx": tensors["cplx"].clone(),
        "sharded": _column_shards(sharded),
        "step": 7,
        "cfg": {"lr": 0.1, "name": "run"},
        "blob": io.BytesIO(b"optimizer bytes"),
        "raw": b"\x00\x01raw",
    }
    return state_dict, tensors


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = cli.main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _chunk_info(path: Path, fqn: str, offsets: tuple[int, ...]) -> dict[str, Any]:
    metadata = ckpt.read_metadata(path)
    info: dict[str, Any] = metadata.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
    return info


def _flip_byte(path: Path, info: dict[str, Any], at: int) -> None:
    file = path / info["file"]
    data = bytearray(file.read_bytes())
    data[info["begin"] + at] ^= 0xFF
    file.write_bytes(bytes(data))


def _data_file(path: Path) -> Path:
    (file,) = (path / "data").iterdir()
    return file
