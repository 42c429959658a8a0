"""Fixtures of the command-line tests: ``source``, a checkpoint of every kind of value (saved once
per module), and ``copy``, a private copy of it to damage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as ckpt
from tests.unit.cli._helpers import _source


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("cli") / "source"
    state_dict, tensors = _source()
    ckpt.save(state_dict, path)
    return path, tensors


@pytest.fixture
def copy(source: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Path:
    """A private copy of the source checkpoint, to damage."""
    return Path(shutil.copytree(source[0], tmp_path / "copy"))
