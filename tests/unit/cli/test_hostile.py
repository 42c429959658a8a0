"""Hostile checkpoints through the commands: linked data files (never opened, nothing written),
a flipped byte inside a sub-box, keys that are not printable."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.local_shards import LocalShardsWrapper
from tests.unit.cli._helpers import (
    _chunk_info,
    _data_file,
    _flip_byte,
    _run,
)

# -- hostile checkpoints ---------------------------------------------------------------------


class _OpenRecorder:
    """Records the paths opened while ``paths`` is a list (an audit hook stays for the life of
    the process, so it is installed once and switched on per test)."""

    paths: list[str] | None = None
    installed = False

    @classmethod
    def hook(cls, event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and cls.paths is not None and isinstance(args[0], (str, os.PathLike)):
            cls.paths.append(os.fspath(args[0]))


@pytest.fixture
def opened_paths() -> Iterator[list[str]]:
    if not _OpenRecorder.installed:
        sys.addaudithook(_OpenRecorder.hook)
        _OpenRecorder.installed = True
    _OpenRecorder.paths = []
    yield _OpenRecorder.paths
    _OpenRecorder.paths = None


@pytest.mark.parametrize("linked", ["file", "directory"])
@pytest.mark.parametrize("command", ["inspect", "verify", "diff", "consolidate"])
def test_data_behind_a_symbolic_link_is_never_opened(
    copy: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    opened_paths: list[str],
    linked: str,
    command: str,
) -> None:
    data_file = _data_file(copy)
    outside = tmp_path / "outside"
    outside.mkdir()
    if linked == "file":
        shutil.move(data_file, outside / data_file.name)
        data_file.symlink_to(outside / data_file.name)
    else:
        shutil.move(copy / "data", outside / "data")
        (copy / "data").symlink_to(outside / "data", target_is_directory=True)
    out_dir = tmp_path / "hf"
    argv = {
        "inspect": ["inspect", copy],
        "verify": ["verify", copy],
        "diff": ["diff", copy, copy],
        "consolidate": ["consolidate", copy, out_dir],
    }[command]
    code, out, err = _run(capsys, *argv)
    assert str(copy / "shardwise.json") in opened_paths  # the recorder sees the reader's opens
    refused = (str(outside), str(copy / "data"))
    assert [path for path in opened_paths if path.startswith(refused)] == []
    assert not out_dir.exists()
    if command == "verify":  # a problem to report, like a missing file
        assert (code, err) == (1, "")
        problem, summary = out.splitlines()
        assert problem.startswith(f"UNSAFE data file data/{data_file.name}: ")
        assert problem.endswith("; not read")
        assert "link" in problem
        assert summary == f"{copy}: 1 problem in 12 entries"
        return
    assert (code, out) == (3, "")
    assert err.startswith(
        f"shardwise {command}: error: data file is not a regular file inside the checkpoint: "
    )
    assert err.endswith(f"file '{data_file}')\n")
    assert err.count("\n") == 1


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tensor saved as two row chunks of 1.2 MB: two checksummed blocks per chunk."""
    full = torch.randn(2, 300_000, generator=torch.Generator().manual_seed(2))
    path = tmp_path_factory.mktemp("large") / "ckpt"
    rows = LocalShardsWrapper([full[:1].clone(), full[1:].clone()], [(0, 0), (1, 0)])
    ckpt.save({"big": rows}, path)
    return path


@pytest.mark.parametrize("command", ["verify", "diff", "consolidate"])
def test_a_flipped_byte_inside_a_sub_box(
    large: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    path = Path(shutil.copytree(large, tmp_path / "copy"))
    info = _chunk_info(path, "big", (1, 0))
    assert len(info["checksums"]) == 2
    # The second chunk touches blocks 1 and 2 of the file (counted from its data section):
    # a byte in block 2, which holds nothing else.
    _flip_byte(path, info, (1 << 20) + 10)
    assert info["begin"] + (1 << 20) + 10 >= info["blocks_begin"] + (1 << 20)
    block = (
        "checksum mismatch for a chunk of this tensor in block 2 of the file (bytes "
        f"{info['blocks_begin'] + (1 << 20)}-{info['end']})"
    )
    if command == "verify":
        code, out, err = _run(capsys, "verify", path)
        assert (code, err) == (1, "")
        problem, summary = out.splitlines()
        assert problem.startswith(f"CHECKSUM key 'big' in {info['file']}: {block}")
        assert f"expected {info['checksums'][1]}, got " in problem
        assert summary == f"{path}: 1 problem in 1 entry"
        return
    out_dir = tmp_path / "hf"
    if command == "diff":
        code, out, err = _run(capsys, "diff", large, path)
    else:
        # An earlier consolidation stays as it was: nothing is replaced unless all is written.
        assert _run(capsys, "consolidate", large, out_dir)[0] == 0
        before = (out_dir / "model.safetensors").read_bytes()
        code, out, err = _run(capsys, "consolidate", path, out_dir)
        assert os.listdir(out_dir) == ["model.safetensors"]
        assert (out_dir / "model.safetensors").read_bytes() == before
    assert (code, out) == (3, "")
    assert err.startswith(f"shardwise {command}: error: {block}")
    assert f"expected {info['checksums'][1]}, got " in err
    assert err.endswith(f"(key 'big', file '{path / info['file']}')\n")
    assert err.count("\n") == 1


def test_keys_that_are_not_printable_are_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt.save({"a\nb": torch.zeros(1), "\x1b[2J": 1}, tmp_path / "ckpt")
    code, out, _ = _run(capsys, "inspect", tmp_path / "ckpt")
    assert code == 0
    rows = out.splitlines()[1:3]
    assert [row.split()[0] for row in rows] == ["'\\x1b[2J'", "'a\\nb'"]
