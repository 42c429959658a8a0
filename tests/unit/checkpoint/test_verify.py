"""``shardwise.checkpoint.verify``: the library form of ``shardwise verify``, a report of every
problem found (``tests/unit/cli/test_verify.py`` checks the command's printing of it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as ckpt


def _save(path: Path) -> None:
    ckpt.save({"w": torch.arange(64.0), "b": torch.ones(3), "step": 7, "blob": b"xyz"}, path)


def _data_file(path: Path) -> Path:
    (file,) = (path / "data").iterdir()
    return file


def test_a_sound_checkpoint_is_ok(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path)
    report = ckpt.verify(path)
    assert isinstance(report, ckpt.VerifyReport)
    assert report.ok and report.problems == ()
    assert report.path == str(path)
    assert (report.num_entries, report.num_files, report.num_chunks_and_blobs) == (4, 1, 3)
    assert report.bytes_checked == 64 * 4 + 3 * 4 + 3  # w, b and the blob; step is JSON
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.bytes_checked = 0  # type: ignore[misc]


def test_a_corrupt_byte_is_a_checksum_problem_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path)
    file = _data_file(path)
    data = bytearray(file.read_bytes())
    data[-20] ^= 0xFF  # in the bytes of "w", the last tensor before b's and the blob's
    file.write_bytes(bytes(data))
    report = ckpt.verify(path)
    assert not report.ok
    (problem,) = report.problems
    assert isinstance(problem, ckpt.VerifyProblem)
    assert (problem.kind, problem.file) == ("CHECKSUM", f"data/{file.name}")
    assert problem.line().startswith(f"CHECKSUM key {problem.key!r} in data/{file.name}: ")
    assert problem.to_json() == {
        "kind": "CHECKSUM",
        "key": problem.key,
        "file": f"data/{file.name}",
        "detail": problem.detail,
    }


def test_missing_and_truncated_files_are_problems_not_errors(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path)
    file = _data_file(path)
    data = file.read_bytes()
    file.write_bytes(data[:-10])
    (truncated,) = ckpt.verify(path).problems
    assert truncated.kind == "TRUNCATED" and "lost data of" in truncated.detail
    file.unlink()
    report = ckpt.verify(path)
    (missing,) = report.problems
    assert missing.kind == "MISSING" and "'b'" in missing.detail and "'w'" in missing.detail
    assert report.bytes_checked == 0


def test_an_unreadable_index_is_raised(tmp_path: Path) -> None:
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.verify(tmp_path / "nothing")
    path = tmp_path / "ckpt"
    _save(path)
    (path / "shardwise.json").write_text("{")
    with pytest.raises(ckpt.CheckpointFormatError):
        ckpt.verify(path)
