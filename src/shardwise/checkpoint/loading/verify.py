"""``verify``: read every byte of a checkpoint and check every block checksum, every data file,
and every data file's safetensors header against the index (``shardwise verify`` is this
function and its printing)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardwise._progress import ByteBar
from shardwise.checkpoint.index import Index, ObjectRecord, TensorRecord, decode_text
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
from shardwise.checkpoint.loading.index_file import quoted
from shardwise.checkpoint.loading.read import audit
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.storage import UnsafePathError
from shardwise.errors import CheckpointDataError, CheckpointFormatError, ChecksumError

__all__ = ["VerifyProblem", "VerifyReport", "verify"]

# A BAD HEADER problem names this many disagreements before it says "and N more".
_MAX_REASONS = 3
# A problem names this many keys before it says "and N more".
_MAX_KEYS = 5


@dataclass(frozen=True, slots=True)
class VerifyProblem:
    """One problem :func:`verify` found.

    Attributes:
        kind: ``MISSING``, ``UNSAFE``, ``TRUNCATED``, ``SIZE``, ``UNREADABLE``, ``BAD HEADER``,
            ``CHECKSUM`` or ``BAD JSON``.
        key: The state-dict key concerned, if one is.
        file: The data file concerned (relative to the checkpoint), if one is.
        detail: What is wrong.
    """

    kind: str
    key: str | None
    file: str | None
    detail: str

    def line(self) -> str:
        """The problem in one line, as ``shardwise verify`` prints it."""
        if self.kind == "BAD JSON":
            return f"BAD JSON key {self.key!r}: {self.detail}"
        if self.kind == "CHECKSUM":
            key = f"key {self.key!r} " if self.key else ""
            return f"CHECKSUM {key}in {self.file}: {self.detail}"
        return f"{self.kind} data file {self.file}: {self.detail}"

    def to_json(self) -> dict[str, str | None]:
        """The problem as a JSON object (``shardwise verify --json``)."""
        return {"kind": self.kind, "key": self.key, "file": self.file, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`verify` checked and found.

    Attributes:
        path: The checkpoint, as given.
        problems: Every problem found, data file by data file (sorted), in file order.
        num_entries: The keys of the checkpoint.
        num_files: The data files checked.
        num_chunks_and_blobs: The tensor chunks and object blobs their headers were checked
            against.
        bytes_checked: The data bytes read and checked against their block checksums.
    """

    path: str
    problems: tuple[VerifyProblem, ...]
    num_entries: int
    num_files: int
    num_chunks_and_blobs: int
    bytes_checked: int

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems


@dataclass(frozen=True, slots=True)
class _Item:
    """One tensor chunk or object blob, and the entry its data file's header should hold."""

    fqn: str
    chunk: SavedChunk
    entry: FileEntry


def _items_by_file(index: Index) -> dict[str, list[_Item]]:
    """Every data file of the index (sorted), with its items in file order. A tied tensor's
    alias has no items: its bytes are its target's, checked under the target's key."""
    by_file: dict[str, list[_Item]] = {name: [] for name in sorted(index.files)}
    entries: dict[str, TensorRecord | ObjectRecord] = {**index.tensors, **index.objects}
    for fqn, entry in sorted(entries.items()):  # so that items of one place keep key order
        if fqn in index.aliases:
            continue
        if isinstance(entry, TensorRecord):
            for chunk in entry.chunks:
                key = chunk_key(fqn, chunk.offsets)
                stored = FileEntry(key, entry.dtype, chunk.sizes, chunk.nbytes)
                by_file[chunk.file].append(_Item(fqn, chunk, stored))
        elif entry.blob is not None:
            blob = entry.blob
            stored = FileEntry(bytes_key(fqn), None, (blob.nbytes,), blob.nbytes)
            by_file[blob.file].append(_Item(fqn, blob, stored))
    for items in by_file.values():
        items.sort(key=lambda item: (item.chunk.begin, item.chunk.end))
    return by_file


def _json_problems(index: Index) -> list[VerifyProblem]:
    problems = []
    for fqn, item in sorted(index.objects.items()):
        if item.text is not None:
            try:
                decode_text(item)
            except CheckpointFormatError as err:
                problems.append(VerifyProblem("BAD JSON", fqn, None, err.bare_message))
    return problems


def _file_problem(
    reader: CheckpointReader, name: str, items: Sequence[_Item], err: CheckpointDataError
) -> VerifyProblem:
    """The problem of a data file the reader refused to open."""
    cause = err.__cause__
    if isinstance(cause, FileNotFoundError):
        keys = sorted({item.fqn for item in items})
        return VerifyProblem(
            "MISSING", None, name, f"holds {quoted(keys, _MAX_KEYS) or 'no entry'}"
        )
    if isinstance(cause, UnsafePathError):
        path = cause.filename
        where = "" if path in (None, reader.files.path(name)) else f" ({path})"
        return VerifyProblem("UNSAFE", None, name, f"{cause.strerror}{where}; not read")
    if cause is None:  # a regular file whose size disagrees with the index
        needed = reader.index.files.get(name) or 0
        try:
            size = reader.storage.size(reader.files.path(name))
        except OSError:
            size = needed
        if size < needed:
            lost = sorted({item.fqn for item in items if item.chunk.end > size})
            return VerifyProblem(
                "TRUNCATED",
                None,
                name,
                f"{size} bytes, the index needs {needed}; lost data of "
                f"{quoted(lost, _MAX_KEYS) or 'no entry'}",
            )
        if size > needed:
            return VerifyProblem(
                "SIZE",
                None,
                name,
                f"{size} bytes, {size - needed} more than the {needed} the index accounts for",
            )
    return VerifyProblem("UNREADABLE", None, name, err.bare_message)


def _header_problem(
    reader: CheckpointReader, name: str, items: Sequence[_Item], size: int
) -> VerifyProblem | None:
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
        return VerifyProblem("BAD HEADER", None, name, str(err))
    except OSError as err:
        return VerifyProblem("UNREADABLE", None, name, f"cannot read its header: {err}")
    expected = [header_entry(i.entry, i.chunk.begin) for i in items]
    reasons = compare_header(header, expected, referenced=parse_reference(name) is not None)
    if not reasons:
        return None
    more = len(reasons) - _MAX_REASONS
    suffix = f"; and {more} more" if more > 0 else ""
    return VerifyProblem("BAD HEADER", None, name, f"{'; '.join(reasons[:_MAX_REASONS])}{suffix}")


def _verify_file(
    reader: CheckpointReader,
    name: str,
    items: list[_Item],
    problems: list[VerifyProblem],
    bar: ByteBar,
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
    size = reader.index.files.get(name) or 0
    header = _header_problem(reader, name, items, size)
    if header is not None:
        problems.append(header)
    found: list[ChecksumError] = []
    owners = [(item.chunk.begin, item.chunk.end, item.fqn) for item in items]
    try:
        audit(reader.files, [name], found, bar.update, {name: owners})
    except CheckpointDataError as err:
        problems.append(VerifyProblem("UNREADABLE", None, name, err.bare_message))
        return 0
    problems.extend(VerifyProblem("CHECKSUM", m.key or None, name, m.bare_message) for m in found)
    return size - reader.index.data_starts[name]


def verify(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> VerifyReport:
    """Read every byte of the checkpoint at ``path`` and check it (one process, no collective).

    Every block is checked against its checksum, every data file's type and size against the
    index, every data file's safetensors header against the entries the index puts there, and
    every JSON value kept in the index decodes. The problems found are reported, not raised,
    so that one call names them all.

    Args:
        path: Checkpoint directory or fsspec URL (``~`` is expanded).
        storage_options: fsspec options for URLs.
        progress: Show a progress bar (stderr) of the bytes checked.

    Returns:
        The :class:`VerifyReport`; ``report.ok`` when nothing is wrong.

    Raises:
        CheckpointNotFoundError: No committed checkpoint at ``path``.
        CheckpointFormatError: The index is corrupt, malformed or of an unknown version
            (nothing can be checked against it).
        CheckpointStorageError: The storage failed.

    Example:
        >>> report = shardwise.checkpoint.verify("/ckpt/100")
        >>> report.ok, [problem.line() for problem in report.problems]
    """
    location = os.fspath(path)
    with CheckpointReader.open(path, storage_options) as reader:
        index = reader.index
        problems = _json_problems(index)
        by_file = _items_by_file(index)
        total = sum((index.files[name] or 0) - index.data_starts[name] for name in by_file)
        checked = 0
        with ByteBar(total, f"verifying {reader.path}", enabled=progress) as bar:
            for name, items in by_file.items():
                checked += _verify_file(reader, name, items, problems, bar)
        return VerifyReport(
            path=location,
            problems=tuple(problems),
            num_entries=len(index.tensors.keys() | index.objects.keys()),
            num_files=len(by_file),
            num_chunks_and_blobs=sum(len(items) for items in by_file.values()),
            bytes_checked=checked,
        )
