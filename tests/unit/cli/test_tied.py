"""Tied tensors (one tensor saved once under several keys: the index's aliases) as the
commands see them: ``inspect`` names the ties and counts the bytes once, ``verify`` checks
the shared bytes once (under the key that holds them), ``diff`` compares values, so a tied
checkpoint and an untied one with the same values do not differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from tests.unit.cli._helpers import _run


def _state(tied: bool) -> dict[str, Any]:
    shared = torch.arange(12.0).reshape(4, 3)
    return {
        "embed": shared,
        "norm": torch.ones(3),
        "head": shared if tied else shared.clone(),
        "step": 5,
    }


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tied") / "ckpt"
    ckpt.save(_state(tied=True), path)
    return path


def test_inspect_names_the_ties_and_counts_their_bytes_once(
    tied: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "inspect", tied)
    assert code == 0
    lines = out.splitlines()
    assert lines[6:8] == [
        "3 tensors (60 B in 2 chunks; 1 tied to another), 1 object (1 B), 1 data file",
        "tied (saved once): head = embed",
    ]
    summary = json.loads(_run(capsys, "inspect", tied, "--json")[1])
    assert (summary["num_tensors"], summary["num_tied"], summary["tensor_bytes"]) == (3, 1, 60)
    rows = {row["key"]: row for row in summary["entries"]}
    assert rows["head"]["tied_to"] == "embed"
    assert rows["head"]["size"] == [4, 3] and rows["head"]["bytes"] == 48
    assert rows["embed"]["tied_to"] is None


def test_verify_checks_the_shared_bytes_once(
    tied: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "verify", tied)
    assert (code, out) == (0, f"{tied}: OK, 4 entries, 2 chunks and blobs, 60 B checked\n")

    copy = tmp_path / "copy"
    shutil.copytree(tied, copy)
    (info,) = [
        value for key, value in ckpt.read_metadata(copy).storage_data.items() if key.fqn == "embed"
    ]
    data_file = copy / info["file"]
    data = bytearray(data_file.read_bytes())
    data[info["begin"]] ^= 0xFF
    data_file.write_bytes(bytes(data))
    code, out, _ = _run(capsys, "verify", copy)
    assert code == 1
    problem, summary = out.splitlines()
    assert problem.startswith(f"CHECKSUM key 'embed' in {info['file']}: checksum mismatch ")
    assert summary == f"{copy}: 1 problem in 4 entries"


def test_diff_compares_values_not_ties(
    tied: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt.save(_state(tied=False), tmp_path / "untied")
    assert _run(capsys, "diff", tied, tmp_path / "untied") == (0, "no differences (4 keys)\n", "")
