"""``shardwise verify`` on real checkpoints written in a single process: corruption, truncation,
missing and extended data files, safetensors headers that disagree with the index or are
broken, a metadata document that is no index, progress bars, ``python -m shardwise``."""

from __future__ import annotations

import io
import json
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import shardwise.checkpoint as ckpt
from shardwise import cli
from shardwise.checkpoint.index import data_file as data_format
from shardwise.checkpoint.index.data_file import FileEntry, HeaderEntry
from tests.unit.cli._helpers import (
    _chunk_info,
    _data_file,
    _flip_byte,
    _run,
)

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


def test_verify_json(
    source: tuple[Path, Any], copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "verify", source[0], "--json")
    assert (code, err) == (0, "")
    summary = json.loads(out)
    assert summary["ok"] is True and summary["problems"] == []
    assert summary["num_problems"] == 0 and summary["num_entries"] == 12
    assert summary["bytes_checked"] > 0 and summary["num_chunks_and_blobs"] > 0
    _flip_byte(copy, _chunk_info(copy, "layer.weight", (0, 0)), 0)
    (copy / "shardwise.json").read_bytes()  # the index is intact
    code, out, err = _run(capsys, "verify", copy, "--json")
    assert (code, err) == (1, "")
    summary = json.loads(out)
    assert summary["ok"] is False and summary["num_problems"] == 1
    (problem,) = summary["problems"]
    assert set(problem) == {"kind", "key", "file", "detail"}
    assert problem["kind"] == "CHECKSUM" and problem["file"].startswith("data/rank-00000.")
    assert problem["key"] is not None and "block 0" in problem["detail"]
    _data_file(copy).unlink()
    code, out, _ = _run(capsys, "verify", copy, "--json")
    (problem,) = json.loads(out)["problems"]
    assert (code, problem["kind"], problem["key"]) == (1, "MISSING", None)
    assert out.count("\n") == 1  # one object on one line
