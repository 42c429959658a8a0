"""The records of a validated index: what :func:`~shardwise.checkpoint.index.decode_index`
returns and what the writer builds (see ``docs/format.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardwise.checkpoint.index.view import metadata_view
from shardwise.checkpoint.metadata import Metadata
from shardwise.checkpoint.planner import SavedChunk
from shardwise.metadata import TensorProperties

__all__ = ["Index", "ObjectRecord", "SaveFacts", "TensorRecord"]


@dataclass(frozen=True, slots=True)
class SaveFacts:
    """Who wrote the checkpoint, and for which path."""

    writer: str
    torch: str
    world_size: int
    save_id: str
    checkpoint_id: str | None


@dataclass(slots=True)
class TensorRecord:
    """One saved tensor: its properties, global size and chunks (which tile it exactly).
    Treated as immutable (not frozen: see :class:`~shardwise.checkpoint.planner.SavedChunk`).

    ``chunks`` is a tuple, except in a version-4 index, where a tensor saved by a rule (a
    grid) has a :class:`~shardwise.checkpoint.index.layouts.LayoutChunks`: a sequence that
    builds a chunk only when it is asked for (its ``layout`` answers box queries directly)."""

    fqn: str
    properties: TensorProperties
    size: tuple[int, ...]
    chunks: Sequence[SavedChunk]

    @property
    def dtype(self) -> torch.dtype:
        return self.properties.dtype


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    """One saved non-tensor value: JSON text kept in the index, or a blob in a data file."""

    fqn: str
    encoding: str
    text: str | None = None
    blob: SavedChunk | None = None


@dataclass(frozen=True, slots=True)
class Index:
    """A validated checkpoint index.

    Attributes:
        format_version: 1 to 4.
        block_size: Bytes per checksummed block; ``None`` in version 1 (one block per chunk).
        files: Every data file named, with its declared size (``None`` in version 1, where
            only the file itself knows).
        tensors: The tensor entries by key, in save order.
        objects: The other entries by key, in save order.
        save: Facts of the save (versions 2-4; ``None`` in version 1).
        legacy: The parsed version-1 document (``None`` in versions 2-4).
        aliases: Tied tensors (versions 3 and 4): alias key -> the key whose tensor it is (the
            one first in the saved state dict). ``tensors`` holds each alias too, with its
            target's record (the same chunks), so that readers need not know about ties.
        data_starts: Version 4: per file, the first byte of its data section (where its
            blocks are counted from). Empty in versions 1-3.
        file_checksums: Version 4: per file, the checksums of its data section's blocks,
            concatenated (16 hex digits each). In version 4 ``SavedChunk.checksums`` is empty:
            a chunk's blocks are the file's blocks it touches (:meth:`file_blocks`).
    """

    format_version: int
    block_size: int | None
    files: dict[str, int | None]
    tensors: dict[str, TensorRecord]
    objects: dict[str, ObjectRecord]
    save: SaveFacts | None = None
    legacy: Metadata | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    data_starts: dict[str, int] = field(default_factory=dict)
    file_checksums: dict[str, str] = field(default_factory=dict)

    @property
    def block_scope(self) -> str:
        """``"file"`` when blocks are counted from each file's data section (version 4),
        ``"chunk"`` when from each chunk's first byte (versions 1-3)."""
        return "file" if self.file_checksums else "chunk"

    def block_size_of(self, chunk: SavedChunk) -> int:
        """The block size of ``chunk``'s checksums (a version-1 chunk is a single block)."""
        return self.block_size if self.block_size is not None else max(chunk.nbytes, 1)

    def file_blocks(self, chunk: SavedChunk) -> tuple[int, list[str]]:
        """Version 4: the blocks ``chunk``'s bytes touch (see :meth:`blocks_of`)."""
        return self.blocks_of(chunk.file, chunk.begin, chunk.end)

    def blocks_of(self, file: str, begin: int, end: int) -> tuple[int, list[str]]:
        """Version 4: the first byte of the first block of ``file``'s data section that the
        bytes ``[begin, end)`` touch, and the checksums of every block they touch (none when
        the range is empty). A block is ``block_size`` bytes from the data section's start;
        the last one ends at the file's end."""
        assert self.block_size is not None and file in self.file_checksums
        start = self.data_starts[file]
        first = (begin - start) // self.block_size
        stop = -(-(end - start) // self.block_size) if end > begin else first
        sums = self.file_checksums[file]
        return start + first * self.block_size, [
            sums[16 * block : 16 * block + 16] for block in range(first, stop)
        ]

    def to_metadata(self) -> Metadata:
        """The index as DCP-style :class:`Metadata` (see ``docs/format.md``, *In memory*):
        its entries and storage infos are built when they are first looked at, so that a
        save of millions of chunks does not build millions of objects nobody reads."""
        if self.legacy is not None:
            return self.legacy
        return metadata_view(self)
