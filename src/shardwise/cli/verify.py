"""``shardwise verify``: read every byte of a checkpoint and check every block checksum, every
data file, and every data file's safetensors header against the index."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardwise._progress import ByteBar, human_bytes
from shardwise.checkpoint.index import ObjectRecord, TensorRecord, decode_text
from shardwise.checkpoint.index.data_file import (
    FileEntry,
    bytes_key,
    chunk_key,
    compare_header,
    header_entry,
    header_length,
    parse_header,
)
from shardwise.checkpoint.index.names import parse_reference
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.loading.read import audit
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.storage import UnsafePathError
from shardwise.cli._checkpoint import _Checkpoint, _open_checkpoint
from shardwise.cli._common import EXIT_FAILED, EXIT_OK, _count, _keys_text, print_json
from shardwise.errors import CheckpointDataError, CheckpointFormatError, ChecksumError

# A BAD HEADER line names this many disagreements before it says "and N more".
_MAX_REASONS = 3


@dataclass(frozen=True, slots=True)
class _Item:
    """One tensor chunk or object blob, and the entry its data file's header should hold."""

    fqn: str
    chunk: SavedChunk
    entry: FileEntry
    blob: bool

    def describe(self) -> str:
        return (
            "the stored object" if self.blob else f"the chunk at offsets {list(self.chunk.offsets)}"
        )


@dataclass(frozen=True, slots=True)
class _Problem:
    """One problem found: its kind (``MISSING``, ``CHECKSUM``, ...), the key and the data file
    concerned (either may be None), and what is wrong."""

    kind: str
    key: str | None
    file: str | None
    detail: str

    def line(self) -> str:
        """The problem as the text output prints it."""
        if self.kind == "BAD JSON":
            return f"BAD JSON key {self.key!r}: {self.detail}"
        if self.kind == "CHECKSUM":
            key = f"key {self.key!r} " if self.key else ""
            return f"CHECKSUM {key}in {self.file}: {self.detail}"
        return f"{self.kind} data file {self.file}: {self.detail}"

    def to_json(self) -> dict[str, str | None]:
        return {"kind": self.kind, "key": self.key, "file": self.file, "detail": self.detail}


def _items_by_file(checkpoint: _Checkpoint) -> dict[str, list[_Item]]:
    """Every data file of the index (sorted), with its items in file order. A tied tensor's
    alias has no items: its bytes are its target's, checked under the target's key."""
    by_file: dict[str, list[_Item]] = {name: [] for name in sorted(checkpoint.index.files)}
    for fqn, entry in checkpoint.entries.items():
        if fqn in checkpoint.aliases:
            continue
        if isinstance(entry, TensorRecord):
            for chunk in entry.chunks:
                key = chunk_key(fqn, chunk.offsets)
                stored = FileEntry(key, entry.dtype, chunk.sizes, chunk.nbytes)
                by_file[chunk.file].append(_Item(fqn, chunk, stored, blob=False))
        elif entry.blob is not None:
            blob = entry.blob
            stored = FileEntry(bytes_key(fqn), None, (blob.nbytes,), blob.nbytes)
            by_file[blob.file].append(_Item(fqn, blob, stored, blob=True))
    for items in by_file.values():
        items.sort(key=lambda item: (item.chunk.begin, item.chunk.end))
    return by_file


def _json_problems(checkpoint: _Checkpoint) -> list[_Problem]:
    problems = []
    for fqn, entry in checkpoint.entries.items():
        if isinstance(entry, ObjectRecord) and entry.text is not None:
            try:
                decode_text(entry)
            except CheckpointFormatError as err:
                problems.append(_Problem("BAD JSON", fqn, None, err.bare_message))
    return problems


def _needed_size(reader: CheckpointReader, name: str, items: Sequence[_Item]) -> int:
    """The size the index declares for data file ``name``."""
    return reader.index.files.get(name) or 0


def _file_problem(
    reader: CheckpointReader, name: str, items: Sequence[_Item], err: CheckpointDataError
) -> _Problem:
    """The problem of a data file the reader refused to open."""
    cause = err.__cause__
    if isinstance(cause, FileNotFoundError):
        keys = sorted({item.fqn for item in items})
        return _Problem("MISSING", None, name, f"holds {_keys_text(keys) or 'no entry'}")
    if isinstance(cause, UnsafePathError):
        path = cause.filename
        where = "" if path in (None, reader.files.path(name)) else f" ({path})"
        return _Problem("UNSAFE", None, name, f"{cause.strerror}{where}; not read")
    if cause is None:  # a regular file whose size disagrees with the index
        needed = _needed_size(reader, name, items)
        try:
            size = reader.storage.size(reader.files.path(name))
        except OSError:
            size = needed
        if size < needed:
            lost = sorted({item.fqn for item in items if item.chunk.end > size})
            return _Problem(
                "TRUNCATED",
                None,
                name,
                f"{size} bytes, the index needs {needed}; lost data of "
                f"{_keys_text(lost) or 'no entry'}",
            )
        if size > needed:
            return _Problem(
                "SIZE",
                None,
                name,
                f"{size} bytes, {size - needed} more than the {needed} the index accounts for",
            )
    return _Problem("UNREADABLE", None, name, err.bare_message)


def _header_problem(
    reader: CheckpointReader, name: str, items: Sequence[_Item], size: int
) -> _Problem | None:
    """Why the safetensors header of data file ``name`` (of ``size`` bytes) is invalid or
    disagrees with the index, or None."""
    handle = reader.files.handle(name)
    try:
        prefix = bytearray(8)
        count = handle.read_into(0, memoryview(prefix))
        # Bounded by the file size (and safetensors' limit) before anything is allocated.
        data = bytearray(8 + header_length(prefix[:count], size))
        count = handle.read_into(0, memoryview(data))
        header = parse_header(data[:count], size)
    except ValueError as err:
        return _Problem("BAD HEADER", None, name, str(err))
    except OSError as err:
        return _Problem("UNREADABLE", None, name, f"cannot read its header: {err}")
    expected = [header_entry(i.entry, i.chunk.begin) for i in items]
    reasons = compare_header(header, expected, referenced=parse_reference(name) is not None)
    if not reasons:
        return None
    more = len(reasons) - _MAX_REASONS
    suffix = f"; and {more} more" if more > 0 else ""
    return _Problem("BAD HEADER", None, name, f"{'; '.join(reasons[:_MAX_REASONS])}{suffix}")


def _verify_file(
    reader: CheckpointReader, name: str, items: list[_Item], problems: list[_Problem], bar: Any
) -> int:
    """Check data file ``name``: its type and size, its header, and every block of its data
    section (a block is named after the first entry it holds; bytes no entry holds, the
    padding between entries, under no key). Appends every problem found; returns the bytes
    checked."""
    try:
        reader.files.handle(name)
    except CheckpointDataError as err:
        problems.append(_file_problem(reader, name, items, err))
        return 0
    size = _needed_size(reader, name, items)
    header = _header_problem(reader, name, items, size)
    if header is not None:
        problems.append(header)
    found: list[ChecksumError] = []
    owners = [(item.chunk.begin, item.chunk.end, item.fqn) for item in items]
    try:
        audit(reader.files, [name], found, bar.update, {name: owners})
    except CheckpointDataError as err:
        problems.append(_Problem("UNREADABLE", None, name, err.bare_message))
        return 0
    problems.extend(_Problem("CHECKSUM", m.key or None, name, m.bare_message) for m in found)
    return size - reader.index.data_starts[name]


def _verify(checkpoint: _Checkpoint) -> tuple[list[_Problem], int, int]:
    """Every problem found, the number of chunks and blobs, and the bytes checked."""
    problems = _json_problems(checkpoint)
    by_file = _items_by_file(checkpoint)
    index = checkpoint.index
    total = sum((index.files[name] or 0) - index.data_starts[name] for name in by_file)
    checked = 0
    with ByteBar(total, f"verifying {checkpoint.path}") as bar:
        for name, items in by_file.items():
            checked += _verify_file(checkpoint.reader, name, items, problems, bar)
    return problems, sum(len(items) for items in by_file.values()), checked


def run(args: argparse.Namespace) -> int:
    """Check every byte of checkpoint ``args.path``; exit code 1 when a problem is found."""
    with _open_checkpoint(args.path, args.storage_options) as checkpoint:
        problems, count, bytes_read = _verify(checkpoint)
        entries = len(checkpoint.entries)
    if args.json:
        print_json(
            {
                "path": args.path,
                "ok": not problems,
                "problems": [problem.to_json() for problem in problems],
                "num_problems": len(problems),
                "num_entries": entries,
                "num_chunks_and_blobs": count,
                "bytes_checked": bytes_read,
            }
        )
        return EXIT_FAILED if problems else EXIT_OK
    for problem in problems:
        print(problem.line())
    if problems:
        found = _count(len(problems), "problem")
        print(f"{args.path}: {found} in {_count(entries, 'entry', 'entries')}")
        return EXIT_FAILED
    print(
        f"{args.path}: OK, {_count(entries, 'entry', 'entries')}, {count} chunks and blobs, "
        f"{human_bytes(bytes_read)} checked"
    )
    return EXIT_OK
