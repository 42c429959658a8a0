"""``shardwise diff``: tolerances, NaN, tagged values, and a corrupt checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from tests.unit.cli._helpers import (
    _chunk_info,
    _flip_byte,
    _run,
    _source,
)

# -- diff ------------------------------------------------------------------------------------


def test_diff(
    source: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    same, _ = _source()
    ckpt.save(same, tmp_path / "same")
    code, out, err = _run(capsys, "diff", source[0], tmp_path / "same")
    assert (code, out, err) == (0, "no differences (12 keys)\n", "")

    changed, tensors = _source()
    weight = changed["layer"]["weight"]
    weight[2, 1] += 1e-3
    changed["step"] = 8
    changed["raw"] = b"\x00\x01rbw"
    changed["ids"] = changed["ids"].to(torch.int32)
    changed["cfg"]["name"] = b"run"
    del changed["mask"]
    changed["extra"] = None
    ckpt.save(changed, tmp_path / "changed")
    code, out, _ = _run(capsys, "diff", source[0], tmp_path / "changed")
    assert code == 1
    old, new = tensors["layer.weight"][2, 1].item(), weight[2, 1].item()
    assert out.splitlines() == [
        "- 'mask': only in A (tensor)",
        "+ 'extra': only in B (json)",
        "~ 'cfg.name': kind json in A, bytes in B",
        "~ 'ids': dtype int64 in A, int32 in B",
        f"~ 'layer.weight': values differ in 1 of 32 elements; first at [2, 1]: {old!r} vs "
        f"{new!r}; max abs diff {abs(new - old):.6g}",
        "~ 'raw': bytes values differ first at byte 3: b'\\x00\\x01raw' vs b'\\x00\\x01rbw'",
        "~ 'step': values differ: 7 vs 8",
        "7 differences",
    ]

    only_weight, _ = _source()
    only_weight["layer"]["weight"][2, 1] += 1e-3
    ckpt.save(only_weight, tmp_path / "close")
    assert _run(capsys, "diff", source[0], tmp_path / "close")[0] == 1
    assert _run(capsys, "diff", source[0], tmp_path / "close", "--atol", "1e-2")[:2] == (
        0,
        "no differences (12 keys)\n",
    )
    assert _run(capsys, "diff", source[0], tmp_path / "close", "--rtol", "1e-9")[0] == 1
    # rtol is relative to B's value, as in torch.allclose.
    rtol = 2e-3 / abs(new)
    assert _run(capsys, "diff", source[0], tmp_path / "close", "--rtol", str(rtol))[0] == 0


def test_diff_treats_nan_as_equal_to_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("a", "b"):
        ckpt.save({"x": torch.tensor([float("nan"), 1.0]), "y": float("nan")}, tmp_path / name)
    assert _run(capsys, "diff", tmp_path / "a", tmp_path / "b")[:2] == (
        0,
        "no differences (2 keys)\n",
    )


def test_diff_compares_tagged_values_by_type_and_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np

    def state(scale: float, pair: Any) -> dict[str, Any]:
        return {
            "rng": np.random.RandomState(0).get_state(),
            "scale": np.float32(scale),
            "shape": torch.Size([2, 3]),
            "pair": pair,
        }

    ckpt.save(state(0.5, (1, 2)), tmp_path / "a")
    ckpt.save(state(0.5, (1, 2)), tmp_path / "b")
    assert _run(capsys, "diff", tmp_path / "a", tmp_path / "b")[:2] == (
        0,
        "no differences (4 keys)\n",
    )
    ckpt.save(state(0.25, [1, 2]), tmp_path / "c")
    code, out, _ = _run(capsys, "diff", tmp_path / "a", tmp_path / "c")
    assert code == 1
    assert out.splitlines() == [
        "~ 'pair': kind pyjson in A, json in B",  # a tuple is not a list
        "~ 'scale': values differ: "
        '{"__numpy__": ["float32", 0.5]} vs {"__numpy__": ["float32", 0.25]}',
        "2 differences",
    ]


def test_diff_of_a_corrupt_checkpoint_is_unreadable_input(
    source: tuple[Path, Any], copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    info = _chunk_info(copy, "ids", (0,))
    _flip_byte(copy, info, 0)
    code, out, err = _run(capsys, "diff", source[0], copy)
    assert (code, out) == (3, "")
    # The file's one block holds every entry: the first entry read fails.
    end = (copy / info["file"]).stat().st_size
    assert re.fullmatch(
        "shardwise diff: error: checksum mismatch for a (chunk of this tensor|stored object) "
        f"in block 0 of the file \\(bytes {info['blocks_begin']}-{end}\\), which also holds "
        "bytes of other entries \\(the changed bytes may be theirs\\): expected "
        f"{info['checksums'][0]}, got [0-9a-f]{{16}} — the data file is corrupt \\(key "
        f"'[^']+', file '{re.escape(str(copy / info['file']))}'\\)\n",
        err,
    ), err


def test_diff_json(
    source: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "diff", source[0], source[0], "--json")
    assert (code, err) == (0, "")
    summary = json.loads(out)
    assert summary["equal"] is True and summary["differences"] == []
    assert summary["num_keys_a"] == summary["num_keys_b"] == 12
    state, tensors = _source()
    state["scale"] = tensors["scale"] + 1
    state["ids"] = torch.arange(4)
    del state["raw"]
    state["extra"] = 1
    ckpt.save(state, tmp_path / "other")
    code, out, err = _run(capsys, "diff", source[0], tmp_path / "other", "--json")
    assert (code, err) == (1, "")
    summary = json.loads(out)
    assert summary["equal"] is False and summary["num_differences"] == 4
    rows = {row["key"]: row for row in summary["differences"]}
    assert rows["raw"] == {"change": "-", "key": "raw", "field": "key", "a": "bytes", "b": None,
                           "detail": None}  # fmt: skip
    assert (rows["extra"]["change"], rows["extra"]["b"]) == ("+", "json")
    assert (rows["ids"]["field"], rows["ids"]["a"], rows["ids"]["b"]) == ("size", [10], [4])
    assert rows["scale"]["field"] == "value" and "values differ" in rows["scale"]["detail"]
