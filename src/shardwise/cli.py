"""The ``shardwise`` command line (also ``python -m shardwise``).

Commands::

    shardwise inspect PATH [--json]        what a checkpoint holds, and how it was saved
    shardwise verify PATH                  read every byte and check every checksum
    shardwise diff A B [--atol --rtol]     compare two checkpoints key by key
    shardwise consolidate PATH OUT [--max-shard-size SIZE]
                                           Hugging Face style safetensors files
    shardwise convert-dcp DCP_DIR OUT      a torch.distributed.checkpoint directory into a
                                           shardwise checkpoint, without running pickled code

Exit codes: 0 success, 1 verification or comparison failed, 2 bad usage or unreadable input.
Progress bars (tqdm, on stderr) appear only when stderr is a terminal. See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import pickle
import re
import struct
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import xxhash

from shardwise import __version__
from shardwise.checkpoint import (
    BytesStorageMetadata,
    CheckpointDataError,
    CheckpointError,
    CheckpointFormatError,
    ChecksumError,
    TensorStorageMetadata,
    read_metadata,
    save,
)
from shardwise.checkpoint.metadata import MetadataIndex
from shardwise.checkpoint.storage import Storage, open_storage

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2

# verify reads data files in pieces of this size: large sequential reads, bounded memory.
_PIECE_BYTES = 16 << 20
# Hugging Face's default shard size for save_pretrained.
_DEFAULT_MAX_SHARD_SIZE = "5GB"
# How many keys a problem line names before it says "and N more".
_MAX_NAMED_KEYS = 5


class _InputError(Exception):
    """Input the command cannot use (exit code 2); the message says what and why."""


# -------------------------------------------------------------------------------------------
# Small helpers.
# -------------------------------------------------------------------------------------------


def _progress(total: int, description: str, unit: str = "B") -> Any:
    """A tqdm bar on stderr, shown only when stderr is a terminal."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        desc=description,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )


def _human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_PATTERN = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """A byte count from ``"500MB"``, ``"2GB"``, ``"1GiB"``, ``"1.5GB"`` or ``"1048576"``.

    Decimal units (KB, MB, GB, TB) are powers of 1000 as in Hugging Face; KiB, MiB, GiB, TiB
    are powers of 1024. Case does not matter.

    Raises:
        ValueError: Not a positive size with a known unit.
    """
    match = _SIZE_PATTERN.fullmatch(text)
    unit = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ValueError(
            f"invalid size {text!r}: use a number of bytes or a number with a unit "
            f"(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 500MB or 1GiB"
        )
    size = int(float(match.group(1)) * unit)
    if size <= 0:
        raise ValueError(f"invalid size {text!r}: it must be positive")
    return size


def _size_argument(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _tolerance_argument(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"invalid tolerance {text!r}: use a number >= 0")
    return value


def _count(number: int, noun: str, plural: str | None = None) -> str:
    """``"1 tensor"``, ``"2 tensors"``, ``"2 entries"`` (with ``plural="entries"``)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _keys_text(keys: Sequence[str]) -> str:
    named = ", ".join(repr(key) for key in keys[:_MAX_NAMED_KEYS])
    rest = len(keys) - _MAX_NAMED_KEYS
    return f"{named} and {rest} more" if rest > 0 else named


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------
# Reading a shardwise checkpoint.
# -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Stored:
    """Where one tensor chunk or object blob lives, as the index records it."""

    fqn: str
    file: str
    begin: int
    end: int
    checksum: str
    offsets: tuple[int, ...] | None  # None for an object blob
    sizes: tuple[int, ...] | None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def describe(self) -> str:
        where = "object" if self.offsets is None else f"chunk at offsets {list(self.offsets)}"
        return f"key {self.fqn!r} {where} in {self.file}"


def _stored(
    fqn: str,
    info: object,
    offsets: tuple[int, ...] | None = None,
    sizes: tuple[int, ...] | None = None,
) -> _Stored:
    """The storage info ``info`` of ``fqn``, checked for the fields and types it needs."""
    if not isinstance(info, Mapping):
        raise CheckpointFormatError("the index has no storage info for it", key=fqn)
    file, begin, end, checksum = (info.get(name) for name in ("file", "begin", "end", "checksum"))
    if (
        not isinstance(file, str)
        or type(begin) is not int
        or type(end) is not int
        or not isinstance(checksum, str)
        or not 0 <= begin <= end
    ):
        raise CheckpointFormatError(
            f"malformed storage info {dict(info)!r}: expected file, begin <= end and checksum",
            key=fqn,
        )
    return _Stored(fqn, file, begin, end, checksum, offsets, sizes)


class _Checkpoint:
    """A committed shardwise checkpoint opened for reading (index parsed once)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.storage: Storage = open_storage(path)
        self.metadata = read_metadata(path)
        self.checksum_algorithm = (self.metadata.planner_data or {}).get("checksum_algorithm")
        data = self.metadata.storage_data
        self._infos: Mapping[MetadataIndex, Any] = data if isinstance(data, Mapping) else {}
        self._file_sizes: dict[str, int] = {}

    @property
    def entries(self) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
        return self.metadata.state_dict_metadata

    def kind(self, fqn: str) -> str:
        """``"tensor"``, or the encoding of an object (``json``, ``bytes``, ...)."""
        if isinstance(self.entries[fqn], TensorStorageMetadata):
            return "tensor"
        info = self._infos.get(MetadataIndex(fqn))
        encoding = info.get("encoding") if isinstance(info, Mapping) else None
        return encoding if isinstance(encoding, str) else "object"

    def chunks(self, fqn: str) -> list[_Stored]:
        entry = self.entries[fqn]
        assert isinstance(entry, TensorStorageMetadata)
        return [
            _stored(
                fqn,
                self._infos.get(MetadataIndex(fqn, chunk.offsets)),
                tuple(chunk.offsets),
                tuple(chunk.sizes),
            )
            for chunk in entry.chunks
        ]

    def object_info(self, fqn: str) -> Mapping[str, Any]:
        info = self._infos.get(MetadataIndex(fqn))
        if not isinstance(info, Mapping) or not isinstance(info.get("encoding"), str):
            raise CheckpointFormatError("the index has no storage info for it", key=fqn)
        return info

    def object_blob(self, fqn: str) -> _Stored | None:
        """Where the object ``fqn`` is stored; None for a JSON value kept in the index."""
        info = self.object_info(fqn)
        if info["encoding"] == "json":
            if not isinstance(info.get("text"), str):
                raise CheckpointFormatError("a JSON entry without its text", key=fqn)
            return None
        return _stored(fqn, info)

    def file_path(self, name: str) -> str:
        return self.storage.join(*name.split("/"))

    def file_size(self, name: str) -> int | None:
        """Size of data file ``name``, or None when it is missing."""
        if name not in self._file_sizes:
            path = self.file_path(name)
            if not self.storage.exists(path):
                return None
            self._file_sizes[name] = self.storage.size(path)
        return self._file_sizes[name]

    def read_into(self, item: _Stored, buffer: memoryview) -> None:
        """Read ``item``'s bytes into ``buffer`` and check their checksum."""
        path = self.file_path(item.file)
        size = self.file_size(item.file)
        if size is None:
            raise CheckpointDataError("data file is missing", key=item.fqn, file=path)
        if item.end > size:
            raise CheckpointDataError(
                f"data file is truncated: it has {size} bytes, the index says it holds bytes "
                f"up to {item.end}",
                key=item.fqn,
                file=path,
            )
        count = self.storage.read_into(path, item.begin, buffer)
        if count != item.nbytes:
            raise CheckpointDataError(
                f"data file is truncated: read {count} of {item.nbytes} bytes",
                key=item.fqn,
                file=path,
            )
        actual = xxhash.xxh3_64_hexdigest(buffer)
        if actual != item.checksum:
            raise ChecksumError(
                f"checksum mismatch: expected {item.checksum}, got {actual}",
                key=item.fqn,
                file=path,
            )

    def tensor(self, fqn: str) -> torch.Tensor:
        """The whole tensor ``fqn`` as one CPU tensor, every chunk checksum verified."""
        entry = self.entries[fqn]
        assert isinstance(entry, TensorStorageMetadata)
        dtype = entry.properties.dtype
        result = torch.empty(tuple(entry.size), dtype=dtype)
        itemsize = result.element_size()
        covered = 0
        for item in self.chunks(fqn):
            assert item.offsets is not None and item.sizes is not None
            count = math.prod(item.sizes)
            if count == 0:
                continue
            if item.nbytes != count * itemsize:
                raise CheckpointFormatError(
                    f"the chunk at offsets {list(item.offsets)} has {item.nbytes} bytes stored, "
                    f"{count * itemsize} expected",
                    key=fqn,
                )
            raw = torch.empty(item.nbytes, dtype=torch.uint8)
            self.read_into(item, _byte_view(raw))
            region = result
            for dim, (offset, length) in enumerate(zip(item.offsets, item.sizes, strict=True)):
                region = region.narrow(dim, offset, length)
            region.copy_(raw.view(dtype).view(item.sizes))
            covered += count
        if covered != result.numel():
            raise CheckpointFormatError(
                f"the saved chunks cover {covered} of the tensor's {result.numel()} elements",
                key=fqn,
            )
        return result

    def object_payload(self, fqn: str) -> bytes:
        """The stored bytes of object ``fqn`` (the JSON text for a JSON value); never decoded,
        so a pickled entry is compared, not run."""
        item = self.object_blob(fqn)
        if item is None:
            return str(self.object_info(fqn)["text"]).encode()
        data = bytearray(item.nbytes)
        self.read_into(item, memoryview(data))
        return bytes(data)


def _open_checkpoint(path: str) -> _Checkpoint:
    # read_metadata refuses indexes whose checksum algorithm is not the xxh3_64 used here.
    return _Checkpoint(path)


# -------------------------------------------------------------------------------------------
# inspect
# -------------------------------------------------------------------------------------------


def _entry_rows(checkpoint: _Checkpoint) -> list[dict[str, Any]]:
    rows = []
    for fqn, entry in checkpoint.entries.items():
        kind = checkpoint.kind(fqn)
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            itemsize = torch.empty((), dtype=dtype).element_size()
            rows.append(
                {
                    "key": fqn,
                    "kind": kind,
                    "dtype": _dtype_name(dtype),
                    "size": list(entry.size),
                    "num_chunks": len(entry.chunks),
                    "bytes": math.prod(entry.size) * itemsize,
                }
            )
            continue
        info = checkpoint.object_info(fqn)
        if kind == "json":
            nbytes = len(str(info.get("text", "")).encode())
        else:
            nbytes = _stored(fqn, info).nbytes
        rows.append(
            {"key": fqn, "kind": kind, "dtype": None, "size": None, "num_chunks": None,
             "bytes": nbytes}
        )  # fmt: skip
    return rows


def _inspect_summary(checkpoint: _Checkpoint) -> dict[str, Any]:
    rows = _entry_rows(checkpoint)
    planner_data = checkpoint.metadata.planner_data
    facts = dict(planner_data) if isinstance(planner_data, Mapping) else {}
    meta = checkpoint.metadata.storage_meta
    files: set[str] = set()
    for fqn in checkpoint.entries:
        if checkpoint.kind(fqn) == "tensor":
            files.update(item.file for item in checkpoint.chunks(fqn))
        elif (blob := checkpoint.object_blob(fqn)) is not None:
            files.add(blob.file)
    tensors = [row for row in rows if row["kind"] == "tensor"]
    objects = [row for row in rows if row["kind"] != "tensor"]
    return {
        "path": checkpoint.path,
        "format_version": 1,
        "writer": facts.get("writer"),
        "torch_version": facts.get("torch"),
        "world_size": facts.get("world_size"),
        "checksum_algorithm": facts.get("checksum_algorithm"),
        "save_id": None if meta is None else meta.save_id,
        "num_tensors": len(tensors),
        "num_objects": len(objects),
        "tensor_bytes": sum(row["bytes"] for row in tensors),
        "object_bytes": sum(row["bytes"] for row in objects),
        "num_chunks": sum(row["num_chunks"] for row in tensors),
        "num_files": len(files),
        "entries": rows,
    }


def _print_table(rows: list[list[str]], right_aligned: set[int]) -> None:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell.rjust(width) if column in right_aligned else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


def _cmd_inspect(args: argparse.Namespace) -> int:
    summary = _inspect_summary(_open_checkpoint(args.path))
    if args.json:
        print(json.dumps(summary, indent=2))
        return EXIT_OK
    header = ["key", "kind", "dtype", "size", "chunks", "bytes"]
    table = [header]
    for row in summary["entries"]:
        table.append(
            [
                row["key"],
                row["kind"],
                row["dtype"] or "-",
                "-" if row["size"] is None else str(row["size"]),
                "-" if row["num_chunks"] is None else str(row["num_chunks"]),
                _human_bytes(row["bytes"]),
            ]
        )
    _print_table(table, right_aligned={4, 5})
    print()
    print(
        f"{_count(summary['num_tensors'], 'tensor')} "
        f"({_human_bytes(summary['tensor_bytes'])} in {_count(summary['num_chunks'], 'chunk')}), "
        f"{_count(summary['num_objects'], 'object')} ({_human_bytes(summary['object_bytes'])}), "
        f"{_count(summary['num_files'], 'data file')}"
    )
    print(
        f"saved by {summary['writer']} with torch {summary['torch_version']}, world size "
        f"{summary['world_size']}, checksums {summary['checksum_algorithm']}, save id "
        f"{summary['save_id']}"
    )
    return EXIT_OK


# -------------------------------------------------------------------------------------------
# verify
# -------------------------------------------------------------------------------------------


def _structure_problems(checkpoint: _Checkpoint) -> tuple[list[str], list[_Stored]]:
    """Problems visible in the index alone, and every stored item to read."""
    problems: list[str] = []
    items: list[_Stored] = []
    for fqn, entry in checkpoint.entries.items():
        try:
            if isinstance(entry, TensorStorageMetadata):
                itemsize = torch.empty((), dtype=entry.properties.dtype).element_size()
                covered = 0
                for item in checkpoint.chunks(fqn):
                    assert item.sizes is not None and item.offsets is not None
                    expected = math.prod(item.sizes) * itemsize
                    covered += math.prod(item.sizes)
                    if item.nbytes != expected:
                        problems.append(
                            f"BAD SIZE {item.describe()}: {item.nbytes} bytes stored, "
                            f"{expected} expected"
                        )
                    items.append(item)
                if covered != math.prod(entry.size):
                    problems.append(
                        f"INCOMPLETE key {fqn!r}: the chunks cover {covered} of "
                        f"{math.prod(entry.size)} elements"
                    )
                continue
            blob = checkpoint.object_blob(fqn)
            if blob is not None:
                items.append(blob)
            else:
                json.loads(checkpoint.object_info(fqn)["text"])
        except CheckpointFormatError as err:
            problems.append(f"BAD INDEX key {fqn!r}: {err}")
        except json.JSONDecodeError as err:
            problems.append(f"BAD JSON key {fqn!r}: {err}")
    return problems, items


def _hash_ranges(
    checkpoint: _Checkpoint, name: str, items: list[_Stored], progress: Any
) -> list[str]:
    """The checksum of every item of one data file, reading the file in large sequential
    pieces (items are sorted by offset and lie inside the file)."""
    path = checkpoint.file_path(name)
    hashers = [xxhash.xxh3_64() for _ in items]
    # Spans of touching or overlapping items are read in one sweep each.
    spans: list[tuple[int, int, int, int]] = []  # begin, end, first item, last item + 1
    for index, item in enumerate(items):
        if spans and item.begin <= spans[-1][1]:
            begin, end, first, _ = spans[-1]
            spans[-1] = (begin, max(end, item.end), first, index + 1)
        else:
            spans.append((item.begin, item.end, index, index + 1))
    largest = max((end - begin for begin, end, _, _ in spans), default=0)
    buffer = memoryview(bytearray(min(_PIECE_BYTES, largest)))
    for begin, end, first, stop in spans:
        position = begin
        while position < end:
            count = min(len(buffer), end - position)
            got = checkpoint.storage.read_into(path, position, buffer[:count])
            if got != count:
                raise CheckpointDataError(
                    f"data file is truncated: read {got} of {count} bytes at offset {position}",
                    file=path,
                )
            piece_end = position + count
            while first < stop and items[first].end <= position:
                first += 1
            for index in range(first, stop):
                item = items[index]
                if item.begin >= piece_end:
                    break
                low, high = max(item.begin, position), min(item.end, piece_end)
                if low < high:
                    hashers[index].update(buffer[low - position : high - position])
            progress.update(count)
            position = piece_end
    return [str(hasher.hexdigest()) for hasher in hashers]


def _verify(checkpoint: _Checkpoint) -> tuple[list[str], int, int]:
    """Every problem found, the number of items checked and the bytes read."""
    problems, items = _structure_problems(checkpoint)
    by_file: dict[str, list[_Stored]] = {}
    for item in items:
        by_file.setdefault(item.file, []).append(item)
    total = sum(item.nbytes for item in items)
    bytes_read = 0
    with _progress(total, f"verifying {checkpoint.path}") as bar:
        for name, file_items in sorted(by_file.items()):
            file_items.sort(key=lambda item: (item.begin, item.end))
            size = checkpoint.file_size(name)
            keys = sorted({item.fqn for item in file_items})
            if size is None:
                problems.append(f"MISSING data file {name}: holds {_keys_text(keys)}")
                continue
            expected = max(item.end for item in file_items)
            readable = [item for item in file_items if item.end <= size]
            if size < expected:
                lost = sorted({item.fqn for item in file_items if item.end > size})
                problems.append(
                    f"TRUNCATED data file {name}: {size} bytes, the index needs {expected}; "
                    f"lost data of {_keys_text(lost)}"
                )
            elif size > expected:
                problems.append(
                    f"SIZE data file {name}: {size} bytes, {size - expected} more than the "
                    f"{expected} the index accounts for"
                )
            digests = _hash_ranges(checkpoint, name, readable, bar)
            bytes_read += sum(item.nbytes for item in readable)
            for item, digest in zip(readable, digests, strict=True):
                if digest != item.checksum:
                    problems.append(
                        f"CHECKSUM {item.describe()}: expected {item.checksum}, got {digest}"
                    )
    return problems, len(items), bytes_read


def _cmd_verify(args: argparse.Namespace) -> int:
    checkpoint = _open_checkpoint(args.path)
    problems, count, bytes_read = _verify(checkpoint)
    for problem in problems:
        print(problem)
    entries = len(checkpoint.entries)
    if problems:
        found = _count(len(problems), "problem")
        print(f"{args.path}: {found} in {_count(entries, 'entry', 'entries')}")
        return EXIT_FAILED
    print(
        f"{args.path}: OK, {_count(entries, 'entry', 'entries')}, {count} chunks and blobs, "
        f"{_human_bytes(bytes_read)} checked"
    )
    return EXIT_OK


# -------------------------------------------------------------------------------------------
# diff
# -------------------------------------------------------------------------------------------


def _widened(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` in float64 (complex128 for complex), or None for dtypes without arithmetic
    (e.g. packed 4-bit floats): those are compared bit for bit."""
    target = torch.complex128 if tensor.dtype.is_complex else torch.float64
    try:
        return tensor.to(target)
    except (RuntimeError, TypeError):
        return None


def _compare_tensors(
    first: torch.Tensor, second: torch.Tensor, atol: float, rtol: float
) -> str | None:
    """Why two tensors of the same size and dtype differ (allclose with NaN equal to NaN), or
    None when they do not."""
    if first.numel() == 0:
        return None
    exact = atol == 0 and rtol == 0
    wide_first, wide_second = _widened(first), _widened(second)
    if wide_first is None or wide_second is None:
        # Compare the bytes of each element.
        raw_first = first.reshape(-1).view(torch.uint8).reshape(first.numel(), -1)
        raw_second = second.reshape(-1).view(torch.uint8).reshape(first.numel(), -1)
        close = (raw_first == raw_second).all(dim=1).reshape(first.shape)
    elif first.dtype.is_floating_point or first.dtype.is_complex or not exact:
        close = torch.isclose(wide_first, wide_second, rtol=rtol, atol=atol, equal_nan=True)
    else:
        close = first == second  # integers and bools: exact without a round trip
    mismatches = int((~close).sum())
    if mismatches == 0:
        return None
    position = tuple(int(i) for i in torch.unravel_index((~close).reshape(-1).nonzero()[0, 0],
                                                         close.shape))  # fmt: skip
    detail = ""
    if wide_first is not None and wide_second is not None:
        deltas = (wide_first - wide_second).abs().reshape(-1)
        finite = deltas[~deltas.isnan()]
        largest = float(finite.max()) if finite.numel() else math.nan
        detail = (
            f"; first at {list(position)}: {first[position].item()!r} vs "
            f"{second[position].item()!r}; max abs diff {largest:.6g}"
        )
    return f"values differ in {mismatches} of {first.numel()} elements{detail}"


def _short(payload: bytes) -> str:
    text = repr(payload if len(payload) <= 40 else payload[:37] + b"...")
    return text


def _compare_objects(kind: str, first: bytes, second: bytes) -> str | None:
    if kind == "json":
        left, right = json.loads(first), json.loads(second)
        # Canonical text: NaN equals NaN and key order does not matter.
        if json.dumps(left, sort_keys=True) == json.dumps(right, sort_keys=True):
            return None
        return f"values differ: {first.decode()[:60]} vs {second.decode()[:60]}"
    if first == second:
        return None
    if len(first) != len(second):
        return f"{kind} values differ: {len(first)} vs {len(second)} bytes"
    where = next(i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)
    return f"{kind} values differ first at byte {where}: {_short(first)} vs {_short(second)}"


def _diff(first: _Checkpoint, second: _Checkpoint, atol: float, rtol: float) -> list[str]:
    differences = []
    keys_first, keys_second = first.entries, second.entries
    for fqn in keys_first:
        if fqn not in keys_second:
            differences.append(f"- {fqn!r}: only in A ({first.kind(fqn)})")
    for fqn in keys_second:
        if fqn not in keys_first:
            differences.append(f"+ {fqn!r}: only in B ({second.kind(fqn)})")
    common = [fqn for fqn in keys_first if fqn in keys_second]
    with _progress(len(common), "comparing", unit="key") as bar:
        for fqn in common:
            bar.update(1)
            entry_first, entry_second = keys_first[fqn], keys_second[fqn]
            kind_first, kind_second = first.kind(fqn), second.kind(fqn)
            if kind_first != kind_second:
                differences.append(f"~ {fqn!r}: kind {kind_first} in A, {kind_second} in B")
                continue
            if isinstance(entry_first, TensorStorageMetadata):
                assert isinstance(entry_second, TensorStorageMetadata)
                dtypes = entry_first.properties.dtype, entry_second.properties.dtype
                if dtypes[0] != dtypes[1]:
                    differences.append(
                        f"~ {fqn!r}: dtype {_dtype_name(dtypes[0])} in A, "
                        f"{_dtype_name(dtypes[1])} in B"
                    )
                    continue
                if entry_first.size != entry_second.size:
                    differences.append(
                        f"~ {fqn!r}: size {list(entry_first.size)} in A, "
                        f"{list(entry_second.size)} in B"
                    )
                    continue
                why = _compare_tensors(first.tensor(fqn), second.tensor(fqn), atol, rtol)
            else:
                why = _compare_objects(
                    kind_first, first.object_payload(fqn), second.object_payload(fqn)
                )
            if why is not None:
                differences.append(f"~ {fqn!r}: {why}")
    return differences


def _cmd_diff(args: argparse.Namespace) -> int:
    first, second = _open_checkpoint(args.a), _open_checkpoint(args.b)
    differences = _diff(first, second, args.atol, args.rtol)
    for line in differences:
        print(line)
    if differences:
        print(_count(len(differences), "difference"))
        return EXIT_FAILED
    print(f"no differences ({_count(len(first.entries), 'key')})")
    return EXIT_OK


# -------------------------------------------------------------------------------------------
# consolidate
# -------------------------------------------------------------------------------------------

_safetensors_codes: dict[torch.dtype, str | None] = {}


def _safetensors_code(dtype: torch.dtype) -> str | None:
    """The dtype code the installed safetensors library writes for ``dtype``, or None when it
    cannot store it (or stores it in a shape other than torch's, e.g. packed sub-byte types)."""
    if dtype not in _safetensors_codes:
        import safetensors.torch

        probe = torch.zeros(1, dtype=dtype)
        code: str | None = None
        try:
            data = safetensors.torch.save({"x": probe})
        except (KeyError, ValueError, TypeError, RuntimeError):
            data = None  # the library has no code for this dtype
        if data is not None:
            (length,) = struct.unpack("<Q", data[:8])
            entry = json.loads(data[8 : 8 + length])["x"]
            if entry["shape"] == [1] and entry["data_offsets"] == [0, probe.element_size()]:
                code = str(entry["dtype"])
        _safetensors_codes[dtype] = code
    return _safetensors_codes[dtype]


@dataclass(frozen=True, slots=True)
class _OutTensor:
    fqn: str
    code: str
    shape: tuple[int, ...]
    nbytes: int


def _shard(tensors: list[_OutTensor], max_bytes: int) -> list[list[_OutTensor]]:
    """Group tensors, in order, into files of at most ``max_bytes`` each, by Hugging Face's
    rule: a tensor larger than the limit is put in a file of its own right away, while the
    file being filled stays open for the tensors after it."""
    shards: list[list[_OutTensor]] = []
    current: list[_OutTensor] = []
    current_bytes = 0
    for tensor in tensors:
        if tensor.nbytes > max_bytes:
            shards.append([tensor])
            continue
        if current_bytes + tensor.nbytes > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(tensor)
        current_bytes += tensor.nbytes
    if current:
        shards.append(current)
    return shards or [[]]


def _write_safetensors(
    checkpoint: _Checkpoint, tensors: list[_OutTensor], path: str, progress: Any
) -> None:
    """Write a safetensors file, streaming one assembled tensor at a time (memory stays
    bounded by the largest tensor, not by the file)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    position = 0
    for tensor in tensors:
        header[tensor.fqn] = {
            "dtype": tensor.code,
            "shape": list(tensor.shape),
            "data_offsets": [position, position + tensor.nbytes],
        }
        position += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the safetensors library aligns the data section to 8
    temporary = f"{path}.tmp"
    try:
        with open(temporary, "wb") as file:
            file.write(struct.pack("<Q", len(text)) + text)
            for tensor in tensors:
                data = checkpoint.tensor(tensor.fqn)
                file.write(_byte_view(data.contiguous()))
                progress.update(tensor.nbytes)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)


_OUTPUT_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def _cmd_consolidate(args: argparse.Namespace) -> int:
    checkpoint = _open_checkpoint(args.path)
    tensors: list[_OutTensor] = []
    skipped_objects = []
    for fqn, entry in checkpoint.entries.items():
        if not isinstance(entry, TensorStorageMetadata):
            skipped_objects.append(fqn)
            continue
        dtype = entry.properties.dtype
        code = _safetensors_code(dtype)
        if code is None:
            print(
                f"warning: skipping {fqn!r}: safetensors cannot store dtype {_dtype_name(dtype)}",
                file=sys.stderr,
            )
            continue
        nbytes = math.prod(entry.size) * torch.empty((), dtype=dtype).element_size()
        tensors.append(_OutTensor(fqn, code, tuple(entry.size), nbytes))
    if skipped_objects:
        print(
            f"note: {len(skipped_objects)} non-tensor entries are not written (safetensors "
            f"holds tensors only): {_keys_text(skipped_objects)}",
            file=sys.stderr,
        )
    total = sum(tensor.nbytes for tensor in tensors)
    shards = _shard(tensors, args.max_shard_size)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    os.makedirs(args.out, exist_ok=True)
    with _progress(total, f"consolidating into {args.out}") as bar:
        for name, shard in zip(names, shards, strict=True):
            _write_safetensors(checkpoint, shard, os.path.join(args.out, name), bar)
    written = set(names)
    if len(shards) > 1:
        weight_map = {
            tensor.fqn: name for name, shard in zip(names, shards, strict=True) for tensor in shard
        }
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        index_name = "model.safetensors.index.json"
        temporary = os.path.join(args.out, f"{index_name}.tmp")
        with open(temporary, "w") as file:
            file.write(json.dumps(index, indent=2) + "\n")
        os.replace(temporary, os.path.join(args.out, index_name))
        written.add(index_name)
    # Files of an earlier consolidation into the same directory would mix with these.
    for name in os.listdir(args.out):
        if _OUTPUT_NAME.fullmatch(name) and name not in written:
            os.remove(os.path.join(args.out, name))
    print(
        f"wrote {_count(len(tensors), 'tensor')} ({_human_bytes(total)}) to "
        f"{_count(len(names), 'file')} in {args.out}"
    )
    return EXIT_OK


# -------------------------------------------------------------------------------------------
# convert-dcp: DCP's .metadata pickle read without running its code.
# -------------------------------------------------------------------------------------------

_DCP_METADATA = ".metadata"
_ZIP_MAGIC = b"PK\x03\x04"


class _Record:
    """Stand-in for a DCP metadata class: it only keeps the known fields, so no code of the
    real class (``__setstate__``, ``__post_init__``, validators) runs while unpickling."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(self.FIELDS):
            raise pickle.UnpicklingError(f"too many arguments for {type(self).__name__}")
        for name in self.FIELDS:
            setattr(self, name, None)
        for name, value in zip(self.FIELDS, args, strict=False):
            setattr(self, name, value)
        self._update(kwargs)

    def _update(self, state: Mapping[Any, Any]) -> None:
        for name, value in state.items():
            if name in self.FIELDS:  # unknown (newer) fields are ignored, never set
                setattr(self, name, value)

    def __setstate__(self, state: Any) -> None:
        for name in self.FIELDS:
            if not hasattr(self, name):
                setattr(self, name, None)
        # A dataclass pickles its __dict__, or (dict-or-None, slots dict) with __slots__.
        if isinstance(state, tuple) and len(state) == 2:
            for part in state:
                if part is not None and not isinstance(part, dict):
                    raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")
                self._update(part or {})
        elif isinstance(state, dict):
            self._update(state)
        else:
            raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")

    def get(self, name: str) -> Any:
        return getattr(self, name, None)


class _DCPMetadata(_Record):
    FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class _DCPTensorEntry(_Record):
    FIELDS = ("properties", "size", "chunks")


class _DCPChunk(_Record):
    FIELDS = ("offsets", "sizes")


class _DCPBytesEntry(_Record):
    FIELDS = ()


class _DCPIndex(_Record):
    FIELDS = ("fqn", "offset", "index")


class _DCPStorageMeta(_Record):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class _DCPStorageInfo(_Record):
    FIELDS = ("relative_path", "offset", "length", "transform_descriptors")


_MEMORY_FORMATS = {
    "TORCH_CONTIGUOUS_FORMAT": (0, torch.contiguous_format),
    "TORCH_CHANNELS_LAST": (1, torch.channels_last),
    "TORCH_PRESERVE_FORMAT": (2, torch.preserve_format),
}


def _memory_format(code: object) -> torch.memory_format:
    """Stand-in for DCP's memory-format enum, called with a member's value."""
    for value, memory_format in _MEMORY_FORMATS.values():
        if code == value and type(code) is int:
            return memory_format
    raise pickle.UnpicklingError(f"unknown memory format code {code!r}")


class _DCPProperties(_Record):
    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state: Any) -> None:
        # DCP pickles TensorProperties as (dtype, layout, requires_grad, format code, pin).
        if isinstance(state, tuple) and len(state) == 5:
            self._update(dict(zip(self.FIELDS, state, strict=True)))
        else:
            super().__setstate__(state)


def _layout(name: object) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout``: ``"torch.strided"`` to the layout."""
    if isinstance(name, str) and name.startswith("torch."):
        value = vars(torch).get(name.removeprefix("torch."))
        if isinstance(value, torch.layout):
            return value
    raise pickle.UnpicklingError(f"unknown layout {name!r}")


def _path_text(*parts: object) -> str:
    """Stand-in for pathlib's path classes (a checkpoint_id given as a Path)."""
    if not all(isinstance(part, str) for part in parts):
        raise pickle.UnpicklingError("a path made of something other than strings")
    return os.path.join(*(str(part) for part in parts)) if parts else ""


def _enum_member(owner: object, name: object) -> Any:
    """The only use of ``builtins.getattr`` allowed: a memory-format enum member by name
    (how some Python versions pickle enum members)."""
    is_enum = isinstance(owner, functools.partial) and owner.func is _memory_format
    if is_enum and isinstance(name, str) and name in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[name][1]
    raise pickle.UnpicklingError("getattr is only allowed for DCP's memory-format enum members")


_DCP_MODULE = "torch.distributed.checkpoint.metadata"
_SHARD_METADATA_MODULE = "torch.distributed._shard.sharded_tensor.metadata"  # torch < 2.2
_PATH_CLASSES = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP_MODULE, "Metadata"): _DCPMetadata,
    (_DCP_MODULE, "TensorStorageMetadata"): _DCPTensorEntry,
    (_DCP_MODULE, "ChunkStorageMetadata"): _DCPChunk,
    (_DCP_MODULE, "BytesStorageMetadata"): _DCPBytesEntry,
    (_DCP_MODULE, "MetadataIndex"): _DCPIndex,
    (_DCP_MODULE, "StorageMeta"): _DCPStorageMeta,
    (_DCP_MODULE, "TensorProperties"): _DCPProperties,
    (_DCP_MODULE, "_MEM_FORMAT_ENCODING"): _memory_format,
    (_SHARD_METADATA_MODULE, "TensorProperties"): _DCPProperties,
    (_SHARD_METADATA_MODULE, "MEM_FORMAT_ENCODING"): _memory_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _DCPStorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    ("builtins", "getattr"): _enum_member,
    **{(module, name): _path_text for module in ("pathlib", "pathlib._local") for name in
       _PATH_CLASSES},
}  # fmt: skip


class _ForbiddenGlobalError(pickle.UnpicklingError):
    """The pickle references something outside the allow-list."""


class _DCPUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` into stand-in records. Only the names of
    ``_ALLOWED_GLOBALS`` and torch's dtype, layout and memory-format constants resolve; each
    resolves to a shardwise stand-in or an inert torch value, so nothing from the file runs.

    A pickle can also set attributes on what it loads (BUILD). torch's values are immutable,
    BUILD on a stand-in class fails (they define ``__setstate__``), and functions are handed
    out as a fresh ``functools.partial`` per reference, so no pickle can alter what a later
    one gets."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if isinstance(allowed, types.FunctionType):
            return functools.partial(allowed)
        if allowed is not None:
            return allowed
        if module == "torch":
            # vars(), not getattr(): torch's module __getattr__ imports submodules lazily.
            value = vars(torch).get(name)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise _ForbiddenGlobalError(
            f"it references {module}.{name}, which is not part of DCP's metadata"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP's metadata")


def _read_dcp_metadata(directory: str) -> _DCPMetadata:
    path = os.path.join(directory, _DCP_METADATA)
    if not os.path.isfile(path):
        raise _InputError(
            f"{directory} is not a torch.distributed.checkpoint directory: {path} is missing"
        )
    with open(path, "rb") as file:
        data = file.read()
    try:
        metadata = _DCPUnpickler(io.BytesIO(data)).load()
    except _ForbiddenGlobalError as err:
        raise _InputError(f"refusing to read {path}: {err}") from err
    # Malformed pickles fail in many ways; each is "unreadable input" here.
    except (
        pickle.UnpicklingError,
        EOFError,
        TypeError,
        ValueError,
        LookupError,
        AttributeError,
        RecursionError,
        struct.error,
    ) as err:
        raise _InputError(f"cannot read {path}: {type(err).__name__}: {err}") from err
    if not isinstance(metadata, _DCPMetadata):
        raise _InputError(f"{path} does not hold DCP metadata (found {type(metadata).__name__})")
    return metadata


def _int_tuple(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise _InputError(f"malformed DCP metadata: {what} is {value!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class _DCPRange:
    """Where DCP stored one item."""

    file: str
    offset: int
    length: int


def _dcp_storage(metadata: _DCPMetadata) -> dict[tuple[str, tuple[int, ...] | None], _DCPRange]:
    storage = metadata.get("storage_data")
    if not isinstance(storage, dict):
        raise _InputError("malformed DCP metadata: storage_data is not a dict")
    ranges = {}
    for key, info in storage.items():
        if not isinstance(key, _DCPIndex) or not isinstance(info, _DCPStorageInfo):
            raise _InputError(
                "this DCP checkpoint was not written by FileSystemWriter (unknown storage_data)"
            )
        fqn, offset = key.get("fqn"), key.get("offset")
        if not isinstance(fqn, str):
            raise _InputError(f"malformed DCP metadata: a storage key fqn is {fqn!r}")
        where = f"the storage of {fqn!r}"
        transforms = info.get("transform_descriptors")
        if transforms:
            raise _InputError(
                f"{where} uses transforms {list(transforms)} (e.g. compression), which "
                "convert-dcp does not support"
            )
        file, start, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if not isinstance(file, str) or type(start) is not int or type(length) is not int:
            raise _InputError(f"malformed DCP metadata: {where} is {vars(info)!r}")
        normalized = os.path.normpath(file)
        if os.path.isabs(normalized) or normalized.split(os.sep)[0] == os.pardir:
            raise _InputError(f"{where} points outside the checkpoint directory: {file!r}")
        index = None if offset is None else _int_tuple(offset, f"the offset of {where}")
        ranges[(fqn, index)] = _DCPRange(normalized, start, length)
    return ranges


def _read_dcp_range(directory: str, fqn: str, where: _DCPRange) -> bytes:
    path = os.path.join(directory, where.file)
    try:
        with open(path, "rb") as file:
            file.seek(where.offset)
            data = file.read(where.length)
    except FileNotFoundError as err:
        raise _InputError(f"{fqn!r}: DCP data file {path} is missing") from err
    if len(data) != where.length:
        raise _InputError(
            f"{fqn!r}: DCP data file {path} is truncated (read {len(data)} of {where.length} "
            f"bytes at offset {where.offset})"
        )
    return data


def _torch_load(payload: bytes, fqn: str, safe: Iterable[type] = ()) -> Any:
    """Decode a ``torch.save`` payload with ``weights_only=True`` (no code runs)."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    context = safe_globals(list(safe)) if safe_globals is not None else contextlib.nullcontext()
    try:
        with context:
            return torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise _InputError(
            f"{fqn!r}: its DCP payload cannot be read without running pickled code ({first_line})"
        ) from err


def _is_json_value(value: object) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json_value(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_value(v) for k, v in value.items())
    return False


def _dcp_object(directory: str, fqn: str, where: _DCPRange) -> Any:
    payload = _read_dcp_range(directory, fqn, where)
    if not payload.startswith(_ZIP_MAGIC):
        return payload  # raw bytes (a planner that does not torch.save its objects)
    # DCP's default planner stores every non-tensor value as torch.save(value).
    value = _torch_load(payload, fqn, safe=[io.BytesIO])
    if isinstance(value, (bytes, io.BytesIO)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if _is_json_value(value):
        return value
    raise _InputError(
        f"{fqn!r} holds a {type(value).__name__}, which a shardwise checkpoint stores only "
        "with pickle; convert-dcp does not pickle"
    )


def _dcp_tensor(
    directory: str,
    fqn: str,
    entry: _DCPTensorEntry,
    ranges: Mapping[tuple[str, tuple[int, ...] | None], _DCPRange],
) -> torch.Tensor:
    properties = entry.get("properties")
    dtype = properties.get("dtype") if isinstance(properties, _DCPProperties) else None
    if not isinstance(dtype, torch.dtype):
        raise _InputError(f"malformed DCP metadata: {fqn!r} has no dtype")
    size = _int_tuple(entry.get("size"), f"the size of {fqn!r}")
    chunks = entry.get("chunks")
    if not isinstance(chunks, list) or not all(isinstance(c, _DCPChunk) for c in chunks):
        raise _InputError(f"malformed DCP metadata: the chunks of {fqn!r}")
    result = torch.empty(size, dtype=dtype)
    covered = 0
    for chunk in chunks:
        offsets = _int_tuple(chunk.get("offsets"), f"a chunk offset of {fqn!r}")
        sizes = _int_tuple(chunk.get("sizes"), f"a chunk size of {fqn!r}")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise _InputError(f"malformed DCP metadata: a chunk of {fqn!r} has the wrong dims")
        if math.prod(sizes) == 0:
            continue
        if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
            raise _InputError(f"malformed DCP metadata: a chunk of {fqn!r} exceeds its size")
        where = ranges.get((fqn, offsets))
        if where is None:
            raise _InputError(f"{fqn!r}: no storage for the chunk at offsets {list(offsets)}")
        data = _torch_load(_read_dcp_range(directory, fqn, where), fqn)
        if not isinstance(data, torch.Tensor) or data.dtype != dtype or data.shape != sizes:
            found = (
                f"{data.dtype} {list(data.shape)}"
                if isinstance(data, torch.Tensor)
                else type(data).__name__
            )
            raise _InputError(
                f"{fqn!r}: the chunk at offsets {list(offsets)} holds {found}, the metadata "
                f"says {dtype} {list(sizes)}"
            )
        region = result
        for dim, (offset, length) in enumerate(zip(offsets, sizes, strict=True)):
            region = region.narrow(dim, offset, length)
        region.copy_(data)
        covered += math.prod(sizes)
    if covered != result.numel():
        raise _InputError(
            f"{fqn!r}: the DCP chunks cover {covered} of the tensor's {result.numel()} elements"
        )
    if properties.get("requires_grad") is True and (dtype.is_floating_point or dtype.is_complex):
        result.requires_grad_(True)
    return result


def _cmd_convert_dcp(args: argparse.Namespace) -> int:
    directory = args.dcp_dir
    metadata = _read_dcp_metadata(directory)
    entries = metadata.get("state_dict_metadata")
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        raise _InputError("malformed DCP metadata: state_dict_metadata is not a dict of keys")
    ranges = _dcp_storage(metadata)
    state_dict: dict[str, Any] = {}
    num_tensors = 0
    with _progress(len(entries), f"converting {directory}", unit="key") as bar:
        for fqn, entry in entries.items():
            if isinstance(entry, _DCPTensorEntry):
                state_dict[fqn] = _dcp_tensor(directory, fqn, entry, ranges)
                num_tensors += 1
            elif isinstance(entry, _DCPBytesEntry):
                where = ranges.get((fqn, None))
                if where is None:
                    raise _InputError(f"{fqn!r}: no storage for this object")
                state_dict[fqn] = _dcp_object(directory, fqn, where)
            else:
                raise _InputError(f"malformed DCP metadata: {fqn!r} is a {type(entry).__name__}")
            bar.update(1)
    save(state_dict, args.out, progress=sys.stderr.isatty())
    print(
        f"converted {_count(num_tensors, 'tensor')} and "
        f"{_count(len(state_dict) - num_tensors, 'object')} from {directory} to {args.out}"
    )
    return EXIT_OK


# -------------------------------------------------------------------------------------------
# Entry point.
# -------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Inspect, verify, compare, consolidate and convert shardwise checkpoints.",
        epilog="Exit codes: 0 success, 1 verification or comparison failed, 2 bad usage or "
        "unreadable input.",
    )
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = commands.add_parser("inspect", help="list the entries of a checkpoint")
    inspect.add_argument("path", help="checkpoint directory or fsspec URL")
    inspect.add_argument("--json", action="store_true", help="print a JSON summary")
    inspect.set_defaults(handler=_cmd_inspect)

    verify = commands.add_parser("verify", help="read all data and check every checksum")
    verify.add_argument("path", help="checkpoint directory or fsspec URL")
    verify.set_defaults(handler=_cmd_verify)

    diff = commands.add_parser("diff", help="compare two checkpoints")
    diff.add_argument("a", help="first checkpoint")
    diff.add_argument("b", help="second checkpoint")
    diff.add_argument(
        "--atol", type=_tolerance_argument, default=0.0, help="absolute tolerance (default 0)"
    )
    diff.add_argument(
        "--rtol", type=_tolerance_argument, default=0.0, help="relative tolerance (default 0)"
    )
    diff.set_defaults(handler=_cmd_diff)

    consolidate = commands.add_parser(
        "consolidate", help="write every tensor in full to Hugging Face style safetensors"
    )
    consolidate.add_argument("path", help="checkpoint directory or fsspec URL")
    consolidate.add_argument("out", help="output directory")
    consolidate.add_argument(
        "--max-shard-size",
        type=_size_argument,
        default=parse_size(_DEFAULT_MAX_SHARD_SIZE),
        metavar="SIZE",
        help="split into several files above this size: 500MB, 2GB, 1GiB or bytes "
        f"(default {_DEFAULT_MAX_SHARD_SIZE})",
    )
    consolidate.set_defaults(handler=_cmd_consolidate)

    convert = commands.add_parser(
        "convert-dcp", help="convert a torch.distributed.checkpoint directory (no pickled code)"
    )
    convert.add_argument("dcp_dir", help="DCP checkpoint directory (.metadata + .distcp files)")
    convert.add_argument("out", help="output shardwise checkpoint directory or URL")
    convert.set_defaults(handler=_cmd_convert_dcp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardwise`` command line with ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 success, 1 verification or comparison failed, 2 bad usage or
        unreadable input.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        # argparse exits on --help, --version and usage errors; report its code instead.
        code = exit_.code
        return code if isinstance(code, int) else (EXIT_OK if code is None else EXIT_ERROR)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (CheckpointError, _InputError, OSError) as err:
        print(f"shardwise {args.command}: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130
