"""A rank's data file does not depend on how it is written: gathered small writes, pieces of
large entries and their sizes (the tunables) change the system calls, never the bytes."""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint import data_writer


def _data_file(path: Path) -> bytes:
    (only,) = (path / "data").iterdir()
    return only.read_bytes()


def test_the_write_tunables_change_no_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(secrets, "token_hex", lambda n: "00000000000000aa")
    generator = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(3 << 18, generator=generator),  # 3 MiB: written in pieces
        "small": [torch.randn(n, generator=generator) for n in (1, 100, 5000)],
        "blob": b"x" * 3000,
    }
    ckpt.save(state, tmp_path / "default")
    tuning = data_writer.TUNING
    monkeypatch.setattr(
        data_writer,
        "TUNING",
        dataclasses.replace(
            tuning, small_write_bytes=1, write_buffer_bytes=1, write_piece_bytes=1 << 20
        ),
    )
    ckpt.save(state, tmp_path / "unbuffered")
    assert _data_file(tmp_path / "unbuffered") == _data_file(tmp_path / "default")
    target: dict[str, Any] = {
        "big": torch.zeros(3 << 18),
        "small": [torch.zeros(n) for n in (1, 100, 5000)],
        "blob": None,
    }
    ckpt.load(target, tmp_path / "unbuffered")
    assert torch.equal(target["big"], state["big"]) and target["blob"] == state["blob"]
