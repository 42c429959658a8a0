"""``shardwise verify``: read every byte of a checkpoint and check every block checksum, every
data file, and every data file's safetensors header against the index."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardwise._progress import ByteBar, human_bytes
from shardwise.checkpoint.format import (
    FileEntry,
    bytes_key,
    chunk_key,
    compare_header,
    header_entry,
    header_length,
    parse_header,
)
from shardwise.checkpoint.index import ObjectRecord, TensorRecord, block_checksums, decode_text
from shardwise.checkpoint.planner import SavedChunk
from shardwise.checkpoint.reader import CheckpointReader
from shardwise.checkpoint.storage import UnsafePathError
from shardwise.cli._checkpoint import _Checkpoint, _open_checkpoint
from shardwise.cli._common import EXIT_FAILED, EXIT_OK, _count, _keys_text
from shardwise.errors import CheckpointDataError, CheckpointFormatError, ChecksumError

# A BAD HEADER line names this many disagreements before it says "and N more".
_MAX_REASONS = 3
_EMPTY_CHECKSUM = block_checksums(b"")


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


def _json_problems(checkpoint: _Checkpoint) -> list[str]:
    problems = []
    for fqn, entry in checkpoint.entries.items():
        if isinstance(entry, ObjectRecord) and entry.text is not None:
            try:
                decode_text(entry)
            except CheckpointFormatError as err:
                problems.append(f"BAD JSON key {fqn!r}: {err.bare_message}")
    return problems


def _needed_size(reader: CheckpointReader, name: str, items: Sequence[_Item]) -> int:
    """The size the index gives data file ``name`` (version 1: up to its last byte range)."""
    declared = reader.index.files.get(name)
    if declared is not None:
        return declared
    return max((item.chunk.end for item in items), default=0)


def _file_problem(
    reader: CheckpointReader, name: str, items: Sequence[_Item], err: CheckpointDataError
) -> str:
    """The problem line for a data file the reader refused to open."""
    cause = err.__cause__
    if isinstance(cause, FileNotFoundError):
        keys = sorted({item.fqn for item in items})
        return f"MISSING data file {name}: holds {_keys_text(keys) or 'no entry'}"
    if isinstance(cause, UnsafePathError):
        path = cause.filename
        where = "" if path in (None, reader.file_path(name)) else f" ({path})"
        return f"UNSAFE data file {name}: {cause.strerror}{where}; not read"
    if cause is None:  # a regular file whose size disagrees with the index
        needed = _needed_size(reader, name, items)
        try:
            size = reader.storage.size(reader.file_path(name))
        except OSError:
            size = needed
        if size < needed:
            lost = sorted({item.fqn for item in items if item.chunk.end > size})
            return (
                f"TRUNCATED data file {name}: {size} bytes, the index needs {needed}; lost "
                f"data of {_keys_text(lost) or 'no entry'}"
            )
        if size > needed:
            return (
                f"SIZE data file {name}: {size} bytes, {size - needed} more than the {needed} "
                "the index accounts for"
            )
    return f"UNREADABLE data file {name}: {err.bare_message}"


def _header_problem(
    reader: CheckpointReader, name: str, items: Sequence[_Item], size: int
) -> str | None:
    """Why the safetensors header of data file ``name`` (of ``size`` bytes) is invalid or
    disagrees with the index, or None."""
    handle = reader.handle(name)
    try:
        prefix = bytearray(8)
        count = handle.read_into(0, memoryview(prefix))
        # Bounded by the file size (and safetensors' limit) before anything is allocated.
        data = bytearray(8 + header_length(prefix[:count], size))
        count = handle.read_into(0, memoryview(data))
        header = parse_header(data[:count], size)
    except ValueError as err:
        return f"BAD HEADER data file {name}: {err}"
    except OSError as err:
        return f"UNREADABLE data file {name}: cannot read its header: {err}"
    reasons = compare_header(header, [header_entry(i.entry, i.chunk.begin) for i in items])
    if not reasons:
        return None
    more = len(reasons) - _MAX_REASONS
    suffix = f"; and {more} more" if more > 0 else ""
    return f"BAD HEADER data file {name}: {'; '.join(reasons[:_MAX_REASONS])}{suffix}"


def _natural(text: str) -> tuple[Any, ...]:
    """Sort key putting "block 2" before "block 10"."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def _layers(items: Sequence[_Item]) -> list[dict[str, _Item]]:
    """``items`` split into groups holding at most one chunk of each key, so that the key of
    a checksum mismatch found in a group names its chunk (a file usually holds one chunk per
    key: one group)."""
    layers: list[dict[str, _Item]] = []
    seen: dict[str, int] = {}
    for item in items:
        position = seen.get(item.fqn, 0)
        seen[item.fqn] = position + 1
        if position == len(layers):
            layers.append({})
        layers[position][item.fqn] = item
    return layers


def _verify_file(
    reader: CheckpointReader, name: str, items: list[_Item], problems: list[str], bar: Any
) -> int:
    """Check data file ``name``: its type and size, its header, and every block of
    ``items``. Appends one line per problem; returns the bytes checked."""
    try:
        handle = reader.handle(name)
    except CheckpointDataError as err:
        problems.append(_file_problem(reader, name, items, err))
        return 0
    needed = _needed_size(reader, name, items)
    if handle.size > needed:  # version 1 only: version 2 declares every file's size
        problems.append(
            f"SIZE data file {name}: {handle.size} bytes, {handle.size - needed} more than "
            f"the {needed} the index accounts for"
        )
    header = _header_problem(reader, name, items, needed)
    if header is not None:
        problems.append(header)
    by_file = reader.index.block_scope == "file"  # version 4: no checksums per chunk
    for item in () if by_file else items:
        if item.chunk.nbytes == 0 and item.chunk.checksums != _EMPTY_CHECKSUM:
            problems.append(
                f"CHECKSUM key {item.fqn!r} in {name}: {item.describe()} is empty, so its "
                f"checksum is {_EMPTY_CHECKSUM}, the index says {item.chunk.checksums}"
            )
    located: list[tuple[_Item | None, ChecksumError]] = []
    checked = sum(item.chunk.nbytes for item in items)
    # Version 4: blocks belong to the file, and one may hold bytes of several entries: each
    # is checked once, under the first entry it holds; the blocks that hold none (the
    # padding between entries, an empty section) last, under no key.
    seen: set[int] = set()
    try:
        for layer in _layers(items):
            found: list[ChecksumError] = []
            blocks = [
                block
                for item in layer.values()
                for block in reader.blocks(item.fqn, item.chunk, 0, item.chunk.nbytes)
                if block.begin not in seen
            ]
            if by_file:
                seen.update(block.begin for block in blocks)
            reader.verify(blocks, problems=found, progress=bar.update)
            located.extend((layer[str(mismatch.key)], mismatch) for mismatch in found)
        if by_file:
            found = []
            rest = [block for block in reader.data_blocks(name) if block.begin not in seen]
            reader.verify(rest, problems=found)
            located.extend((None, mismatch) for mismatch in found)
    except CheckpointDataError as err:
        problems.append(f"UNREADABLE data file {name}: {err.bare_message}")
        checked = 0
    located.sort(
        key=lambda pair: (
            pair[0].chunk.begin if pair[0] is not None else -1,
            _natural(pair[1].bare_message),
        )
    )
    problems.extend(
        f"CHECKSUM {'' if item is None else f'key {item.fqn!r} '}in {name}: {mismatch.bare_message}"
        for item, mismatch in located
    )
    return checked


def _verify(checkpoint: _Checkpoint) -> tuple[list[str], int, int]:
    """Every problem found, the number of chunks and blobs, and the bytes checked."""
    problems = _json_problems(checkpoint)
    by_file = _items_by_file(checkpoint)
    total = sum(item.chunk.nbytes for items in by_file.values() for item in items)
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
    for problem in problems:
        print(problem)
    if problems:
        found = _count(len(problems), "problem")
        print(f"{args.path}: {found} in {_count(entries, 'entry', 'entries')}")
        return EXIT_FAILED
    print(
        f"{args.path}: OK, {_count(entries, 'entry', 'entries')}, {count} chunks and blobs, "
        f"{human_bytes(bytes_read)} checked"
    )
    return EXIT_OK
