"""The records of a validated index: what :func:`~shardwise.checkpoint.index.decode_index`
returns and what the writer builds (see ``docs/format.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardwise.checkpoint.index.view import metadata_view
from shardwise.checkpoint.metadata import Metadata
from shardwise.checkpoint.planning.planner import SavedChunk
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
    Treated as immutable (not frozen: see
    :class:`~shardwise.checkpoint.planning.planner.SavedChunk`).

    ``chunks`` is a tuple, except for a tensor saved by a rule (a grid): a
    :class:`~shardwise.checkpoint.index.layouts.LayoutChunks`, a sequence that builds a chunk
    only when it is asked for (and answers box queries by arithmetic)."""

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
    """A validated checkpoint index (see ``docs/format.md``).

    Attributes:
        format_version: The format's version (:data:`~.names.FORMAT_VERSION`).
        block_size: Bytes per checksummed block of a data section.
        files: Every data file that holds something, with its size (a rank that wrote
            nothing has no file: its number in the index is ``null``, and it is not here).
        tensors: The tensor entries by key, in index order.
        objects: The other entries by key, in index order.
        save: Facts of the save.
        aliases: Tied tensors: alias key -> the key whose tensor it is (the one first in the
            saved state dict). ``tensors`` holds each alias too, with its target's record (the
            same chunks), so that readers need not know about ties.
        data_starts: Per file, the first byte of its data section (where its blocks are
            counted from).
        file_checksums: Per file, the checksums of its data section's blocks, concatenated
            (16 hex digits each): a chunk's blocks are the file's blocks it touches
            (:meth:`blocks_of`).
    """

    format_version: int
    block_size: int
    files: dict[str, int]
    tensors: dict[str, TensorRecord]
    objects: dict[str, ObjectRecord]
    save: SaveFacts
    aliases: dict[str, str] = field(default_factory=dict)
    data_starts: dict[str, int] = field(default_factory=dict)
    file_checksums: dict[str, str] = field(default_factory=dict)

    def file_blocks(self, chunk: SavedChunk) -> tuple[int, list[str]]:
        """The blocks ``chunk``'s bytes touch (see :meth:`blocks_of`)."""
        return self.blocks_of(chunk.file, chunk.begin, chunk.end)

    def blocks_of(self, file: str, begin: int, end: int) -> tuple[int, list[str]]:
        """The first byte of the first block of ``file``'s data section that the bytes
        ``[begin, end)`` touch, and the checksums of every block they touch (none when the
        range is empty). A block is ``block_size`` bytes from the data section's start; the
        last one ends at the file's end."""
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
        return metadata_view(self)
