"""A self-contained copy of a checkpoint (``shardwise materialize``): every byte its index
points at — in its own data files and in the sibling checkpoints an incremental one
references — read and verified, written into new data files under ``out`` that hold exactly
the index's entries, then a version 4 index (``docs/format.md``, *Incremental checkpoints*).
The copy loads anywhere, on its own, with any reader of version 4."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardwise.checkpoint.index import (
    DATA_DIR,
    INDEX_NAME,
    FileFacts,
    Index,
    LayoutRecord,
    ObjectRecord,
    SaveFacts,
    data_file_name,
    decode_index,
    encode_index,
)
from shardwise.checkpoint.index.data_file import FileEntry, bytes_key, chunk_key, layout_file
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.loading.read import Segment, read
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.metadata import Metadata
from shardwise.checkpoint.saving.writer import FileBlocks, open_fresh
from shardwise.checkpoint.storage import Storage, open_storage
from shardwise.errors import CheckpointError, CheckpointStorageError

__all__ = ["materialize"]

#: Bytes read (and verified) at a time while copying an entry.
_PIECE_BYTES = 64 << 20


@dataclass(slots=True)
class _Entry:
    """One stored entry of the source: a tensor chunk or a blob, and its place in the copy."""

    key: str  # the data file entry's name
    fqn: str
    chunk: SavedChunk
    file_entry: FileEntry
    moved: SavedChunk | None = None


def _entries(index: Index) -> dict[str, list[_Entry]]:
    """The stored entries of ``index`` by source file, in the order of their bytes there."""
    by_file: dict[str, list[_Entry]] = {name: [] for name in index.files}
    for fqn, record in index.tensors.items():
        if fqn in index.aliases:
            continue  # its bytes are its target's
        for chunk in record.chunks:
            key = chunk_key(fqn, chunk.offsets)
            entry = FileEntry(key, record.dtype, chunk.sizes, chunk.nbytes)
            by_file[chunk.file].append(_Entry(key, fqn, chunk, entry))
    for fqn, item in index.objects.items():
        if item.blob is not None:
            key = bytes_key(fqn)
            entry = FileEntry(key, None, (item.blob.nbytes,), item.blob.nbytes)
            by_file[item.blob.file].append(_Entry(key, fqn, item.blob, entry))
    for entries in by_file.values():
        entries.sort(key=lambda entry: (entry.chunk.begin, entry.key))
    return by_file


def _copy_file(
    reader: CheckpointReader,
    out: Storage,
    source: str,
    entries: list[_Entry],
    name: str,
    save_id: str,
    progress: Callable[[int], object] | None,
) -> FileFacts:
    """Write ``entries`` of data file ``source`` (every byte verified as read) to data file
    ``name`` of ``out``; their new places are set in each entry's ``moved``."""
    number = name.split("rank-")[1].split(".")[0]
    layout = layout_file(
        [entry.file_entry for entry in entries],
        {"format": "shardwise", "save_id": save_id, "rank": str(int(number))},
    )
    final = out.join(*name.split("/"))
    staging = f"{final}.tmp" if out.atomic_rename else final
    writer = open_fresh(out, staging, None)
    blocks = FileBlocks(reader.index.block_size)
    try:
        writer.write(layout.header)
        buffer = bytearray(min(_PIECE_BYTES, max((e.chunk.nbytes for e in entries), default=0)))
        for entry, (begin, end) in zip(entries, layout.ranges, strict=True):
            for start in range(0, entry.chunk.nbytes, _PIECE_BYTES):
                view = memoryview(buffer)[: min(_PIECE_BYTES, entry.chunk.nbytes - start)]
                read(reader.files, [Segment(source, entry.chunk.begin + start, view, entry.fqn)])
                blocks.update(view)
                writer.write(view)
                if progress is not None:
                    progress(len(view))
            entry.moved = SavedChunk(entry.chunk.offsets, entry.chunk.sizes, name, begin, end)
    except BaseException:
        writer.abort()
        raise
    writer.close(sync=True)
    if staging != final:
        out.rename(staging, final)
    return FileFacts(layout.size, len(layout.header), blocks.checksums())


def materialize(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int], object] | None = None,
) -> Metadata:
    """Copy the checkpoint at ``path`` into a self-contained one at ``out`` (one process).

    An incremental checkpoint reads data files of earlier checkpoints of its series; its
    materialized copy holds every byte it needs in its own files and loads anywhere. Every
    byte is verified as it is read; the copy's index is written last (its commit).

    Args:
        progress: Called with the bytes of each piece copied.

    Returns:
        The copy's :class:`Metadata` (as :func:`read_metadata` of ``out`` gives it).

    Raises:
        CheckpointError: ``out`` holds a checkpoint already, or the source is invalid or a byte
            of it does not match its checksum (nothing is committed at ``out`` then).
        CheckpointStorageError: Writing the copy failed (``out`` is a file, its ``data`` a
            symbolic link, the disk is full, ...).
    """
    target = os.path.expanduser(os.fspath(out))
    try:
        return _materialize(path, target, storage_options, progress).to_metadata()
    except CheckpointError:
        raise
    except OSError as err:
        raise CheckpointStorageError(
            f"cannot write the copy of {os.fspath(path)} at {target}: {err}"
        ) from err


def _materialize(
    path: str | os.PathLike[str],
    target: str,
    storage_options: dict[str, Any] | None,
    progress: Callable[[int], object] | None,
) -> Index:
    storage = open_storage(target, storage_options)
    if storage.exists(storage.join(INDEX_NAME)):
        raise CheckpointError(f"{target} holds a checkpoint already; choose a new directory")
    with CheckpointReader.open(path, storage_options) as reader:
        index = reader.index
        storage.makedirs(storage.join(DATA_DIR))
        save_id = secrets.token_hex(8)
        files: list[tuple[str, FileFacts] | None] = []
        by_file = {source: entries for source, entries in _entries(index).items() if entries}
        for number, (source, entries) in enumerate(sorted(by_file.items())):
            name = data_file_name(number, save_id)
            files.append(
                (name, _copy_file(reader, storage, source, entries, name, save_id, progress))
            )
        if storage.atomic_rename:
            storage.sync_dir(storage.join(DATA_DIR))
        moved: dict[tuple[str, str], SavedChunk] = {}
        for entries in by_file.values():
            for entry in entries:
                assert entry.moved is not None
                moved[entry.fqn, entry.key] = entry.moved
        tensors = [
            LayoutRecord(
                fqn,
                record.properties,
                record.size,
                tuple(moved[fqn, chunk_key(fqn, c.offsets)] for c in record.chunks),
            )
            for fqn, record in index.tensors.items()
            if fqn not in index.aliases
        ]
        objects = [
            item
            if item.blob is None
            else ObjectRecord(fqn, item.encoding, blob=moved[fqn, bytes_key(fqn)])
            for fqn, item in index.objects.items()
        ]
        was = index.save
        saved = SaveFacts(was.writer, was.torch, was.world_size, save_id, target)
        data = encode_index(
            saved,
            files or [None],
            tensors,
            objects,
            block_size=index.block_size,
            aliases=index.aliases,
        )
    copy = decode_index(data)
    if copy.tensors.keys() != index.tensors.keys() or copy.objects.keys() != index.objects.keys():
        raise CheckpointError("the materialized index does not read back as built")
    storage.replace_small(storage.join(INDEX_NAME), data)
    if storage.atomic_rename:
        storage.sync_dir(storage.root)
    return copy
