"""What every command shares: usage errors (exit 2), a missing or incomplete checkpoint (exit 3),
``--version``, ``--help``, sizes, and the console script."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest

import shardwise.checkpoint as ckpt
from shardwise import cli
from tests.unit.cli._helpers import (
    _run,
)


def test_missing_or_incomplete_checkpoint_is_unreadable_input(
    copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (copy / "shardwise.json").unlink()
    for command in (["verify", copy], ["inspect", copy], ["diff", copy, copy]):
        code, out, err = _run(capsys, *command)
        assert (code, out) == (3, "")
        assert err.startswith(f"shardwise {command[0]}: error: {copy} is not a complete shardwise")
        assert "Traceback" not in err
    code, _, err = _run(capsys, "consolidate", tmp_path / "nothing", tmp_path / "out")
    assert code == 3
    assert err == (
        f"shardwise consolidate: error: no checkpoint at {tmp_path / 'nothing'} "
        f"(file '{tmp_path / 'nothing' / 'shardwise.json'}')\n"
    )
    assert not (tmp_path / "out").exists()


# -- usage -----------------------------------------------------------------------------------


def test_usage_errors_exit_2(
    source: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "out"
    for argv in (
        [],
        ["frobnicate"],
        ["diff", source[0]],
        ["diff", source[0], source[0], "--atol", "-1"],
        ["diff", source[0], source[0], "--rtol", "nan"],
        ["consolidate", source[0], out_dir, "--max-shard-size", "12XB"],
        ["consolidate", source[0], out_dir, "--max-shard-size", "0"],
    ):
        code, out, err = _run(capsys, *argv)
        assert (code, out) == (2, ""), argv
        assert "usage: shardwise" in err
    assert not out_dir.exists()
    _, _, err = _run(capsys, "consolidate", source[0], out_dir, "--max-shard-size", "12XB")
    assert err.endswith(
        "error: argument --max-shard-size: invalid size '12XB': use a number of bytes or a "
        "number with a unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 500MB or 1GiB\n"
    )
    assert _run(capsys, "--version")[:2] == (0, "shardwise 0.1.0\n")
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    assert "convert-dcp" in out


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("500MB", 500_000_000),
        ("2GB", 2_000_000_000),
        ("1GiB", 1 << 30),
        ("1gib", 1 << 30),
        ("64KiB", 65536),
        ("1.5kb", 1500),
        ("123", 123),
        (" 10 B ", 10),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert cli.parse_size(text) == size


def test_console_script_points_at_main() -> None:
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="shardwise")
    assert entry.value == "shardwise.cli:main"
    assert entry.load() is cli.main


# -- exit codes and JSON of the commands that write ------------------------------------------


def test_one_table_maps_exceptions_to_exit_codes() -> None:
    from shardwise.cli._app import exit_code
    from shardwise.cli._common import UsageError

    assert exit_code(UsageError("bad --prefix")) == 2
    for err in (
        ckpt.CheckpointFormatError("bad index"),
        ckpt.CheckpointNotFoundError("nothing"),
        ckpt.ChecksumError("flipped"),
        ckpt.DCPImportError("pickled"),
        ckpt.CheckpointKeyError("collide"),
    ):
        assert exit_code(err) == 3, err
    assert exit_code(ckpt.CheckpointStorageError("no credentials")) == 4
    assert exit_code(PermissionError(13, "Permission denied")) == 4
    assert exit_code(ZeroDivisionError("a bug")) is None


def test_the_commands_that_write_print_one_json_object(
    source: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "consolidate", source[0], tmp_path / "hf", "--json")
    assert code == 0
    assert json.loads(out) == {
        "path": str(source[0]),
        "out": str(tmp_path / "hf"),
        "files": ["model.safetensors"],
        "config": None,
        "num_tensors": 6,  # complex128 is skipped
        "bytes": json.loads(out)["bytes"],
    }
    assert out.count("\n") == 1
    code, out, err = _run(capsys, "materialize", source[0], tmp_path / "copy", "--json")
    assert (code, err) == (0, "")
    summary = json.loads(out)
    assert summary["out"] == str(tmp_path / "copy") and summary["num_tensors"] == 7
    assert summary["num_objects"] == 5 and summary["num_files"] >= 1 and summary["bytes"] > 0
