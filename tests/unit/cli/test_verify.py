"""The ``shardwise`` command line on real checkpoints written in a single process: inspect,
verify (corruption, truncation, missing files, safetensors headers, no other index), diff
(tolerances), consolidate to Hugging Face style safetensors (single file and split), hostile
checkpoints (linked data files, corrupt blocks: exit 3, nothing outside opened, nothing written),
convert-dcp from a real torch DCP checkpoint, and the refusal of DCP metadata that references
anything but DCP's own classes."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import io
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardwise.checkpoint as ckpt
from shardwise import cli
from shardwise.checkpoint import MetadataIndex
from shardwise.checkpoint.dcp_import import _unpickle
from shardwise.checkpoint.huggingface.files import OutTensor, split_files
from shardwise.checkpoint.index import data_file as data_format
from shardwise.checkpoint.index.data_file import FileEntry, HeaderEntry
from shardwise.local_shards import LocalShardsWrapper

OBJECT_KEYS = ["blob", "cfg.lr", "cfg.name", "raw", "step"]


def _column_shards(full: torch.Tensor) -> LocalShardsWrapper:
    """Two column shards of ``full`` on this process: a tensor saved as two chunks."""
    return LocalShardsWrapper(
        [full[:, :1].contiguous(), full[:, 1:].contiguous()], [(0, 0), (0, 1)]
    )


def _source() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A state dict with every kind of value, and the full tensor of every tensor key."""
    g = torch.Generator().manual_seed(0)
    sharded = torch.randn(6, 4, generator=g)
    tensors = {
        "cplx": torch.randn(3, dtype=torch.complex128, generator=g),
        "ids": torch.arange(10, dtype=torch.int64),
        "layer.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "layer.weight": torch.randn(8, 4, generator=g),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.25, dtype=torch.float64),
        "sharded": sharded,
    }
    state_dict: dict[str, Any] = {
        "layer": {"weight": tensors["layer.weight"].clone(), "bias": tensors["layer.bias"].clone()},
        "scale": tensors["scale"].clone(),
        "ids": tensors["ids"].clone(),
        "mask": tensors["mask"].clone(),
        "cplx": tensors["cplx"].clone(),
        "sharded": _column_shards(sharded),
        "step": 7,
        "cfg": {"lr": 0.1, "name": "run"},
        "blob": io.BytesIO(b"optimizer bytes"),
        "raw": b"\x00\x01raw",
    }
    return state_dict, tensors


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


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = cli.main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _chunk_info(path: Path, fqn: str, offsets: tuple[int, ...]) -> dict[str, Any]:
    metadata = ckpt.read_metadata(path)
    info: dict[str, Any] = metadata.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
    return info


def _flip_byte(path: Path, info: dict[str, Any], at: int) -> None:
    file = path / info["file"]
    data = bytearray(file.read_bytes())
    data[info["begin"] + at] ^= 0xFF
    file.write_bytes(bytes(data))


def _data_file(path: Path) -> Path:
    (file,) = (path / "data").iterdir()
    return file


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


# -- verify ----------------------------------------------------------------------------------


def test_verify_passes_then_names_the_corrupted_key(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "verify", copy)
    # No progress bar: stderr is not a terminal under pytest.
    assert (code, err) == (0, "")
    assert out == f"{copy}: OK, 12 entries, 10 chunks and blobs, 391 B checked\n"

    info = _chunk_info(copy, "sharded", (0, 1))
    _flip_byte(copy, info, 5)
    code, out, _ = _run(capsys, "verify", copy)
    assert code == 1
    # One block: the file's data section is smaller than 1 MiB, and holds every entry, so
    # the problem names a key of that block and says the changed bytes may be another's.
    (expected,) = info["checksums"]
    got = out.split("got ")[1].split()[0]
    end = (copy / info["file"]).stat().st_size
    problem, summary = out.splitlines()
    assert re.fullmatch(
        f"CHECKSUM key '[^']+' in {re.escape(info['file'])}: checksum mismatch for a chunk of "
        f"this tensor in block 0 of the file \\(bytes {info['blocks_begin']}-{end}\\), which "
        "also holds bytes of other entries \\(the changed bytes may be theirs\\): expected "
        f"{expected}, got {got} — the data file is corrupt",
        problem,
    ), problem
    assert summary == f"{copy}: 1 problem in 12 entries"
    assert got != expected


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_on_a_terminal(
    source: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(capsys, "verify", source[0])[2] == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["verify", str(source[0])]) == 0
    assert f"verifying {source[0]}:" in terminal.getvalue()
    assert "/391 B [" in terminal.getvalue()  # the bar counts the bytes to check


def test_verify_reports_truncated_extended_and_missing_data_files(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    info = _chunk_info(copy, "sharded", (0, 0))
    data_file = copy / info["file"]
    original = data_file.read_bytes()
    # Cut in the middle of the first 'sharded' chunk: it and everything after it are lost.
    cut = info["begin"] + 3
    storage_data = ckpt.read_metadata(copy).storage_data
    lost = sorted({key.fqn for key, item in storage_data.items() if item.get("end", 0) > cut})
    assert "sharded" in lost
    data_file.write_bytes(original[:cut])
    code, out, _ = _run(capsys, "verify", copy)
    assert code == 1
    named = ", ".join(repr(key) for key in lost[:5])
    more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
    assert out.splitlines() == [
        f"TRUNCATED data file {info['file']}: {cut} bytes, the index needs {len(original)}; "
        f"lost data of {named}{more}",
        f"{copy}: 1 problem in 12 entries",
    ]

    data_file.write_bytes(original + b"xyz")
    code, out, _ = _run(capsys, "verify", copy)
    assert code == 1
    assert out.splitlines() == [
        f"SIZE data file {info['file']}: {len(original) + 3} bytes, 3 more than the "
        f"{len(original)} the index accounts for",
        f"{copy}: 1 problem in 12 entries",
    ]

    data_file.unlink()
    code, out, _ = _run(capsys, "verify", copy)
    assert code == 1
    assert out.splitlines() == [
        f"MISSING data file {info['file']}: holds 'blob', 'cplx', 'ids', 'layer.bias', "
        "'layer.weight' and 4 more",
        f"{copy}: 1 problem in 12 entries",
    ]


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


def test_subprocess_python_m_shardwise_exit_codes(copy: Path) -> None:
    _flip_byte(copy, _chunk_info(copy, "layer.weight", (0, 0)), 0)
    result = subprocess.run(
        [sys.executable, "-m", "shardwise", "verify", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith("CHECKSUM key '")
    assert " in data/rank-00000." in result.stdout
    assert "in block 0 of the file " in result.stdout
    assert result.stdout.endswith(f"{copy}: 1 problem in 12 entries\n")


# -- verify: safetensors headers -------------------------------------------------------------


def _header(file: Path) -> tuple[int, dict[str, Any]]:
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length])


def _replace_header(file: Path, text: str) -> None:
    """Put ``text`` in place of the file's header, padded with spaces to the same length: every
    data byte stays where it was."""
    length, _ = _header(file)
    encoded = text.encode()
    assert len(encoded) <= length
    data = bytearray(file.read_bytes())
    data[8 : 8 + length] = encoded.ljust(length)
    file.write_bytes(bytes(data))


def _compact(header: dict[str, Any]) -> str:
    return json.dumps(header, separators=(",", ":"))


def _renamed(header: dict[str, Any], start: int) -> tuple[str, str]:
    header["idz@0"] = header.pop("ids@0")
    return _compact(header), "entry 'ids@0' is missing; entry 'idz@0' is not in the index"


def _reshaped(header: dict[str, Any], start: int) -> tuple[str, str]:
    header["layer.weight@0,0"]["shape"] = [4, 8]
    return _compact(header), "entry 'layer.weight@0,0' has shape [4, 8], the index says [8, 4]"


def _retyped(header: dict[str, Any], start: int) -> tuple[str, str]:
    header["ids@0"]["dtype"] = "F64"  # as wide as I64: the header stays consistent in itself
    return _compact(header), "entry 'ids@0' has dtype F64, the index says I64"


def _moved(header: dict[str, Any], start: int) -> tuple[str, str]:
    # Two 8-byte entries trade places: still packed, both disagree with the index.
    bias, scale = header["layer.bias@0"], header["scale@"]
    (b0, b1), (s0, s1) = bias["data_offsets"], scale["data_offsets"]
    bias["data_offsets"], scale["data_offsets"] = [s0, s1], [b0, b1]
    return _compact(header), (
        f"entry 'layer.bias@0' holds bytes {start + s0}-{start + s1} of the file, the index "
        f"says {start + b0}-{start + b1}; entry 'scale@' holds bytes {start + b0}-{start + b1} "
        f"of the file, the index says {start + s0}-{start + s1}"
    )


def _extra(header: dict[str, Any], start: int) -> tuple[str, str]:
    del header["__metadata__"]  # room for one more entry in the same header length
    end = max(entry["data_offsets"][1] for entry in header.values())
    header["extra@bytes"] = {"dtype": "U8", "shape": [0], "data_offsets": [end, end]}
    return _compact(header), "entry 'extra@bytes' is not in the index"


def _repeated(header: dict[str, Any], start: int) -> tuple[str, str]:
    return _compact(header).replace(
        '"mask@0"', '"ids@0"'
    ), "the header repeats the key 'ids@0' in one JSON object"


def _inconsistent(header: dict[str, Any], start: int) -> tuple[str, str]:
    header["mask@0"]["shape"] = [4]
    offsets = header["mask@0"]["data_offsets"]
    return _compact(header), (
        f"entry 'mask@0' has data_offsets {offsets} (3 bytes), but shape [4] of BOOL needs 4"
    )


@pytest.mark.parametrize(
    "edit", [_renamed, _reshaped, _retyped, _moved, _extra, _repeated, _inconsistent]
)
def test_verify_reports_a_header_that_disagrees_with_the_index(
    source: tuple[Path, Any],
    copy: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict[str, Any], int], tuple[str, str]],
) -> None:
    data_file = _data_file(copy)
    length, header = _header(data_file)
    text, why = edit(header, 8 + length)
    _replace_header(data_file, text)
    code, out, err = _run(capsys, "verify", copy)
    assert (code, err) == (1, "")
    # Only the header is wrong: every checksum still matches.
    assert out.splitlines() == [
        f"BAD HEADER data file data/{data_file.name}: {why}",
        f"{copy}: 1 problem in 12 entries",
    ]
    # Readers take byte ranges from the index, never from a header.
    assert _run(capsys, "diff", source[0], copy)[:2] == (0, "no differences (12 keys)\n")


_PAST_THE_END = "the header length {length} runs past the end of the file ({size} bytes)"
_TOO_LARGE = "the header length {length} is larger than the 100000000 bytes safetensors accepts"


@pytest.mark.parametrize(
    ("length", "why"),
    [
        (lambda size: size - 7, _PAST_THE_END),
        (lambda size: 1 << 40, _TOO_LARGE),
        (lambda size: 0, "the header does not start with '{{'"),
    ],
    ids=["past-the-end", "too-large", "empty"],
)
def test_verify_reports_a_broken_header_length(
    source: tuple[Path, Any],
    copy: Path,
    capsys: pytest.CaptureFixture[str],
    length: Callable[[int], int],
    why: str,
) -> None:
    data_file = _data_file(copy)
    data = bytearray(data_file.read_bytes())
    data[:8] = struct.pack("<Q", length(len(data)))
    data_file.write_bytes(bytes(data))
    code, out, _ = _run(capsys, "verify", copy)
    assert code == 1
    assert out.splitlines() == [
        f"BAD HEADER data file data/{data_file.name}: "
        + why.format(length=length(len(data)), size=len(data)),
        f"{copy}: 1 problem in 12 entries",
    ]
    assert _run(capsys, "diff", source[0], copy)[0] == 0


def _file(header: object, data: bytes = b"") -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


_F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x01\x00", "the file has 2 bytes, too few for the 8-byte header length"),
        (struct.pack("<Q", 3) + b"{}", "the header length 3 runs past the end of the file (10"),
        (_file(b" {}"), "the header does not start with '{'"),
        (_file(b'{"\xff":1}'), "the header is not UTF-8 text"),
        (_file(b'{"x":'), "the header is not valid JSON"),
        (_file(b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nested too deeply"),
        (_file(b'{"x":NaN}'), "the header contains NaN, which is not JSON"),
        (_file(b'{"x":{"a":1,"a":1}}'), "the header repeats the key 'a'"),
        (_file({"__metadata__": {"a": 1}}), "the header's __metadata__ must map strings to"),
        (_file({"__metadata__": ["a"]}), "the header's __metadata__ must map strings to strings"),
        (_file({"x": 1}), "entry 'x' must be an object with exactly the keys dtype, shape, data_"),
        (_file({"x": {**_F32, "more": 1}}, bytes(8)), "entry 'x' must be an object with exactly"),
        (_file({"x": {**_F32, "dtype": "F128"}}, bytes(8)), "entry 'x' has the unknown dtype 'F12"),
        (_file({"x": {**_F32, "shape": [-2]}}, bytes(8)), "entry 'x' has a malformed shape [-2]"),
        (_file({"x": {**_F32, "shape": [True, 2]}}, bytes(8)), "entry 'x' has a malformed shape"),
        (_file({"x": {**_F32, "shape": [1] * 65}}, bytes(8)), "entry 'x' has a malformed shape"),
        (_file({"x": {**_F32, "shape": [0, 1 << 61, 1 << 61], "data_offsets": [0, 0]}}),
         "entry 'x' has the shape [0, 2305843009213693952, 2305843009213693952], which no tensor"),
        (_file({"x": {**_F32, "data_offsets": [8, 0]}}, bytes(8)), "malformed data_offsets [8, 0]"),
        (_file({"x": {**_F32, "data_offsets": [0]}}, bytes(8)), "malformed data_offsets [0]"),
        (_file({"x": {**_F32, "data_offsets": [0, 8.0]}}, bytes(8)), "malformed data_offsets"),
        (_file({"x": {**_F32, "shape": [3]}}, bytes(8)),
         "entry 'x' has data_offsets [0, 8] (8 bytes), but shape [3] of F32 needs 12"),
        (_file({"x": {**_F32, "data_offsets": [4, 12]}}, bytes(12)),
         "entry 'x' starts at data offset 4, where the entries before it end at 0: a hole before"),
        (_file({"x": _F32, "y": {**_F32, "data_offsets": [4, 12]}}, bytes(12)),
         "entry 'y' starts at data offset 4, where the entries before it end at 8: it overlaps"),
        (_file({"x": _F32}, bytes(9)), "the entries end at byte "),
        (_file({"x": _F32}, bytes(7)), "the entries end at byte "),
    ],
)  # fmt: skip
def test_parse_header_refuses_what_safetensors_readers_would_trip_on(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        data_format.parse_header(data, len(data))


def test_parse_header_reads_what_layout_file_writes() -> None:
    entries = [
        FileEntry("w@0,0", torch.float32, (2, 3), 24),
        FileEntry("c@0", torch.complex128, (2,), 32),  # no safetensors code: raw bytes
        FileEntry("s@", torch.float64, (), 8),
        FileEntry("e@0", torch.int8, (0,), 0),
        FileEntry("b@bytes", None, (5,), 5),
    ]
    layout = data_format.layout_file(entries, {"format": "shardwise"})
    data = layout.header + bytes(layout.size - len(layout.header))
    header = data_format.parse_header(data, len(data))
    assert header.metadata == {"format": "shardwise"}
    assert 8 + header.length == layout.ranges[0][0]
    expected = [
        data_format.header_entry(entry, begin)
        for entry, (begin, _) in zip(entries, layout.ranges, strict=True)
    ]
    assert list(header.entries.values()) == expected
    assert header.entries["c@0"] == HeaderEntry("c@0", "U8", (32,), *layout.ranges[1])
    assert data_format.compare_header(header, expected) == []
    # The safetensors library reads the same entries.
    assert set(safetensors.torch.load(data)) == {entry.key for entry in entries}
    # The end of the data section is the end of the file: a longer file is refused.
    with pytest.raises(ValueError, match="the entries end at byte"):
        data_format.parse_header(data + b"\0", len(data) + 1)


def test_compare_header_names_every_disagreement() -> None:
    entry = HeaderEntry("a@0", "F32", (2,), 64, 72)
    header = data_format.Header(56, None, {"a@0": entry})
    assert data_format.compare_header(header, [entry]) == []
    assert data_format.compare_header(header, [entry, entry]) == [
        "the index places two entries named 'a@0' in this file"
    ]
    other = HeaderEntry("a@0", "I32", (1, 2), 72, 80)
    assert data_format.compare_header(header, [other]) == [
        "entry 'a@0' has dtype F32, the index says I32",
        "entry 'a@0' has shape [2], the index says [1, 2]",
        "entry 'a@0' holds bytes 64-72 of the file, the index says 72-80",
    ]
    assert data_format.compare_header(header, []) == ["entry 'a@0' is not in the index"]


def test_a_metadata_document_is_no_index(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # ``Metadata.to_json`` writes a document of the first, unreleased index's shape (format
    # version 1): no reader takes it for an index.
    (copy / "shardwise.json").write_text(ckpt.read_metadata(copy).to_json())
    for command in ("verify", "inspect"):
        code, out, err = _run(capsys, command, copy)
        assert (code, out) == (3, "")
        assert "unsupported checkpoint format version 1; this shardwise reads version 4" in err
        assert err.count("\n") == 1


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


# -- consolidate -----------------------------------------------------------------------------


def _safetensors_contents(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as file:
        assert file.metadata() == {"format": "pt"}
        return {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118


def test_consolidate_single_file(
    source: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "hf"
    code, out, err = _run(capsys, "consolidate", source[0], out_dir)
    assert code == 0
    assert out == f"wrote 6 tensors (323 B) to 1 file in {out_dir}\n"
    assert err.splitlines() == [
        "warning: skipping 'cplx': safetensors cannot store dtype complex128",
        "note: 5 non-tensor entries are not written (safetensors holds tensors only): 'blob', "
        "'cfg.lr', 'cfg.name', 'raw', 'step'",
    ]
    assert sorted(os.listdir(out_dir)) == ["model.safetensors"]
    contents = _safetensors_contents(out_dir / "model.safetensors")
    expected = {key: value for key, value in source[1].items() if key != "cplx"}
    assert sorted(contents) == sorted(expected)
    for key, value in expected.items():
        assert contents[key].dtype == value.dtype, key
        assert torch.equal(contents[key], value), key
    loaded = load_file(str(out_dir / "model.safetensors"))
    assert all(torch.equal(loaded[key], value) for key, value in expected.items())


def test_consolidate_split_like_hugging_face(
    source: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "hf"
    code, out, _ = _run(capsys, "consolidate", source[0], out_dir, "--max-shard-size", "100")
    assert code == 0
    assert out == f"wrote 6 tensors (323 B) to 3 files in {out_dir}\n"
    names = [f"model-{i:05d}-of-00003.safetensors" for i in range(1, 4)]
    assert sorted(os.listdir(out_dir)) == [*names, "model.safetensors.index.json"]
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    # In key order, 100 bytes per file, as Hugging Face splits: layer.weight (128 bytes) gets
    # a file of its own at once, the file being filled (ids, layer.bias) stays open.
    assert index == {
        "metadata": {"total_size": 80 + 8 + 128 + 3 + 8 + 96},
        "weight_map": {
            "ids": names[1],
            "layer.bias": names[1],
            "layer.weight": names[0],
            "mask": names[1],
            "scale": names[1],
            "sharded": names[2],
        },
    }
    for name in names:
        contents = _safetensors_contents(out_dir / name)
        assert sorted(contents) == sorted(k for k, v in index["weight_map"].items() if v == name)
        for key, value in contents.items():
            assert torch.equal(value, source[1][key]), key

    # Consolidating again into the same directory replaces the split files and the index.
    assert _run(capsys, "consolidate", source[0], out_dir, "--max-shard-size", "1GB")[0] == 0
    assert os.listdir(out_dir) == ["model.safetensors"]


def test_split_rule_is_hugging_faces() -> None:
    # The example of transformers' docs (limit 10: [6], [6+2], [6+2+2]) plus a tensor above the
    # limit, which gets a file of its own while the file being filled stays open.
    sizes = [6, 6, 2, 6, 2, 2, 12, 1]
    tensors = [OutTensor(f"t{i}", f"t{i}", torch.uint8, (n,), n) for i, n in enumerate(sizes)]
    shards = split_files(tensors, lambda t: t.nbytes, 10)
    assert [[t.nbytes for t in shard] for shard in shards] == [[6], [6, 2], [12], [6, 2, 2], [1]]
    assert split_files([], lambda t: t.nbytes, 10) == [[]]


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


# -- convert-dcp -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Custom:
    """A value DCP can only store by pickling it."""

    marker: str

    def __setstate__(self, state: dict[str, Any]) -> None:
        Path(state["marker"]).write_text("executed")  # proof that unpickling ran code


def _dcp_save(state_dict: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # DCP warns that it assumes a single process; that is the point here.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state_dict, checkpoint_id=str(path), no_dist=True)


def test_convert_dcp_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = torch.Generator().manual_seed(1)
    sharded = torch.randn(6, 4, generator=g)
    expected = {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.randn(5, generator=g).to(torch.bfloat16),
        "s": torch.tensor(3.5),
        "nested.x": torch.arange(4, dtype=torch.int64).reshape(2, 2),
        "lsw": sharded,
    }
    source = {
        "w": expected["w"].clone(),
        "b": expected["b"].clone(),
        "s": expected["s"].clone(),
        "nested": {"x": expected["nested.x"].clone()},
        "lsw": _column_shards(sharded),
        "blob": io.BytesIO(b"\x00blob"),
        "raw": b"raw bytes",
        "step": 7,
        "name": "run-1",
    }
    _dcp_save(source, tmp_path / "dcp")
    out_dir = tmp_path / "converted"
    code, out, err = _run(capsys, "convert-dcp", tmp_path / "dcp", out_dir)
    assert (code, err) == (0, "")
    assert out == f"converted 5 tensors and 4 objects from {tmp_path / 'dcp'} to {out_dir}\n"

    metadata = ckpt.read_metadata(out_dir)
    assert len(metadata.state_dict_metadata["lsw"].chunks) == 1  # assembled into one tensor
    target: dict[str, Any] = {
        "w": torch.zeros(4, 3),
        "b": torch.zeros(5, dtype=torch.bfloat16),
        "s": torch.zeros(()),
        "nested": {"x": torch.zeros(2, 2, dtype=torch.int64)},
        "lsw": torch.zeros(6, 4),
        "blob": io.BytesIO(),
        "raw": b"",
        "step": 0,
        "name": "",
    }
    ckpt.load(target, out_dir)
    for key in ("w", "b", "s", "lsw"):
        assert target[key].dtype == expected[key].dtype
        assert torch.equal(target[key], expected[key]), key
    assert torch.equal(target["nested"]["x"], expected["nested.x"])
    assert target["blob"].getvalue() == b"\x00blob"
    assert (target["raw"], target["step"], target["name"]) == (b"raw bytes", 7, "run-1")
    assert _run(capsys, "verify", out_dir)[0] == 0


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("exploit", f"it references {os.system.__module__}.system, which is not part of DCP's"),
        (b"cbuiltins\neval\n(S'1+1'\ntR.", "it references builtins.eval, which is not part"),
        (
            b"cbuiltins\ngetattr\n(ctorch\nSize\nS'__class__'\ntR.",
            "getattr is only allowed for DCP's memory-format enum members",
        ),
        (pickle.dumps({"state_dict_metadata": {}}), "does not hold DCP metadata (found dict)"),
        (b"not a pickle", "cannot read"),
    ],
)
def test_convert_dcp_refuses_metadata_outside_the_allow_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], payload: bytes | str, message: str
) -> None:
    marker = tmp_path / "executed"
    directory = tmp_path / "dcp"
    directory.mkdir()
    data = pickle.dumps(_Exploit(marker)) if payload == "exploit" else payload
    assert isinstance(data, bytes)
    (directory / ".metadata").write_bytes(data)
    code, out, err = _run(capsys, "convert-dcp", directory, tmp_path / "out")
    assert (code, out) == (3, "")
    assert err.startswith("shardwise convert-dcp: error: ")
    assert message in err
    assert "Traceback" not in err
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_dcp_metadata_cannot_alter_the_allowed_stand_ins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "dcp").mkdir()
    metadata = tmp_path / "dcp" / ".metadata"
    # BUILD with a slots state on an allowed class, then on an allowed function.
    metadata.write_bytes(
        b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\nN}S'FIELDS'\n(S'x'\nts\x86b."
    )
    code, _, err = _run(capsys, "convert-dcp", tmp_path / "dcp", tmp_path / "out")
    assert code == 3
    assert "__setstate__() missing 1 required positional argument" in err
    assert _unpickle.DCPIndex.FIELDS == ("fqn", "offset", "index")
    metadata.write_bytes(
        b"ctorch.serialization\n_get_layout\nN}S'__defaults__'\n(S'x'\nts\x86b"
        b"S'torch.strided'\n\x85R."
    )
    code, _, err = _run(capsys, "convert-dcp", tmp_path / "dcp", tmp_path / "out")
    assert code == 3
    assert err.endswith("TypeError: invalid partial state\n")  # a fresh partial refuses it
    assert _unpickle.layout.__defaults__ is None


def test_convert_dcp_refuses_pickled_objects_and_non_dcp_directories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "executed"
    _dcp_save({"w": torch.ones(2), "custom": _Custom(str(marker))}, tmp_path / "dcp")
    code, out, err = _run(capsys, "convert-dcp", tmp_path / "dcp", tmp_path / "out")
    assert (code, out) == (3, "")
    assert err.startswith(
        "shardwise convert-dcp: error: 'custom': its DCP payload cannot be read without running "
        "pickled code (Weights only load failed."
    )
    assert not marker.exists()
    assert not (tmp_path / "out").exists()

    code, _, err = _run(capsys, "convert-dcp", tmp_path, tmp_path / "out")
    assert code == 3
    assert err == (
        f"shardwise convert-dcp: error: {tmp_path} is not a torch.distributed.checkpoint "
        f"directory: {tmp_path / '.metadata'} is missing\n"
    )
