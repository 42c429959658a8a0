"""``shardwise inspect``: the table, the totals, the save facts and ``--json``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as ckpt
from tests.unit.cli._helpers import (
    OBJECT_KEYS,
    _run,
)

# -- inspect ---------------------------------------------------------------------------------


def test_inspect_prints_a_table_totals_and_save_facts(
    source: tuple[Path, dict[str, torch.Tensor]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "inspect", source[0])
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["key", "kind", "dtype", "size", "chunks", "bytes"]
    rows = {line.split()[0]: line.split() for line in lines[1:13]}
    assert rows["layer.weight"] == [
        "layer.weight",
        "tensor",
        "float32",
        "[8,",
        "4]",
        "1",
        "128",
        "B",
    ]
    assert rows["layer.bias"] == ["layer.bias", "tensor", "bfloat16", "[4]", "1", "8", "B"]
    assert rows["scale"] == ["scale", "tensor", "float64", "[]", "1", "8", "B"]
    assert rows["sharded"] == ["sharded", "tensor", "float32", "[6,", "4]", "2", "96", "B"]
    assert rows["blob"] == ["blob", "bytesio", "-", "-", "-", "15", "B"]
    assert rows["raw"] == ["raw", "bytes", "-", "-", "-", "5", "B"]
    assert rows["step"] == ["step", "json", "-", "-", "-", "1", "B"]
    assert lines[13:15] == ["", "7 tensors (371 B in 8 chunks), 5 objects (29 B), 1 data file"]
    assert re.fullmatch(
        r"saved by shardwise 0\.1\.0 with torch \S+, world size 1, checksums xxh3_64, "
        r"save id [0-9a-f]{16}",
        lines[15],
    )


def test_inspect_json(
    source: tuple[Path, dict[str, torch.Tensor]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "inspect", source[0], "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["writer"] == "shardwise 0.1.0"
    assert summary["torch_version"] == torch.__version__
    assert (summary["world_size"], summary["checksum_algorithm"]) == (1, "xxh3_64")
    assert summary["save_id"] == ckpt.read_metadata(source[0]).storage_meta.save_id
    assert (summary["num_tensors"], summary["num_objects"], summary["num_files"]) == (7, 5, 1)
    assert (summary["tensor_bytes"], summary["num_chunks"], summary["num_tied"]) == (371, 8, 0)
    entries = {entry["key"]: entry for entry in summary["entries"]}
    assert list(entries) == sorted([*source[1], *OBJECT_KEYS])
    assert entries["sharded"] == {
        "key": "sharded",
        "kind": "tensor",
        "dtype": "float32",
        "size": [6, 4],
        "num_chunks": 2,
        "bytes": 96,
        "tied_to": None,
    }
    assert entries["cfg.name"] == {
        "key": "cfg.name",
        "kind": "json",
        "dtype": None,
        "size": None,
        "num_chunks": None,
        "bytes": len('"run"'),
        "tied_to": None,
    }
