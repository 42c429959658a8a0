"""The strict=False warning of ``load`` and ``load_safetensors`` names the keys and points at
the caller's line, not at shardwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardwise.checkpoint as ckpt


def test_load_warns_at_the_callers_line_naming_both_kinds_of_keys(tmp_path: Path) -> None:
    ckpt.save({"a": torch.ones(2), "extra": torch.ones(1)}, tmp_path / "c")
    with pytest.warns(UserWarning) as caught:
        ckpt.load({"a": torch.zeros(2), "b": torch.zeros(1)}, tmp_path / "c", strict=False)
    (warning,) = caught
    assert warning.filename == __file__
    text = str(warning.message)
    assert "1 key missing from the checkpoint ('b')" in text
    assert "1 key in the checkpoint but not in the state dict (not loaded) ('extra')" in text


def test_load_safetensors_warns_at_the_callers_line(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2), "extra": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    state = {"a": torch.zeros(2), "b": torch.zeros(1)}
    with pytest.warns(UserWarning) as caught:
        ckpt.load_safetensors(state, tmp_path / "model.safetensors", strict=False)
    (warning,) = caught
    assert warning.filename == __file__
    assert "1 key missing from the safetensors files ('b')" in str(warning.message)
    assert torch.equal(state["a"], torch.ones(2))
