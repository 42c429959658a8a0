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
from shardwise.checkpoint import tuning as tuning_module


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
    tuning = tuning_module.TUNING
    monkeypatch.setattr(
        tuning_module,
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


def test_entries_around_the_vector_write_sizes_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tiny entries (copied into a shared buffer), medium ones (their own buffers in a vectored
    # write, some from non-contiguous tensors, so a temporary that must outlive the queue),
    # lazily conjugated and negated views (written as their values), and more entries than
    # one vectored write takes: the same values come back.
    monkeypatch.setattr(
        tuning_module,
        "TUNING",
        dataclasses.replace(tuning_module.TUNING, write_buffer_bytes=1 << 30),
    )
    generator = torch.Generator().manual_seed(1)
    complex_values = torch.randn(4096, dtype=torch.complex64, generator=generator)
    state: dict[str, Any] = {
        "tiny": [torch.randn(n, generator=generator) for n in (0, 1, 100, 4095)],
        "medium": [torch.randn(n, generator=generator) for n in (4096, 50_000, 200_000)],
        "transposed": torch.randn(300, 200, generator=generator).t(),
        "conjugated": complex_values.conj(),
        "negated": torch.randn(5000, dtype=torch.complex64, generator=generator).conj().imag,
        "many": [torch.full((5000,), float(i)) for i in range(1100)],
    }
    ckpt.save(state, tmp_path / "c")
    target = {
        "tiny": [torch.zeros_like(t) for t in state["tiny"]],
        "medium": [torch.zeros_like(t) for t in state["medium"]],
        "transposed": torch.zeros(200, 300),
        "conjugated": torch.zeros(4096, dtype=torch.complex64),
        "negated": torch.zeros(5000),
        "many": [torch.zeros(5000) for _ in range(1100)],
    }
    ckpt.load(target, tmp_path / "c")
    for key in ("tiny", "medium", "many"):
        assert all(torch.equal(a, b) for a, b in zip(target[key], state[key], strict=True))
    assert torch.equal(target["transposed"], state["transposed"])
    assert torch.equal(target["conjugated"], complex_values.conj().resolve_conj())
    assert torch.equal(target["negated"], state["negated"].resolve_neg())
