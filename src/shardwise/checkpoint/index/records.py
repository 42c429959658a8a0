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
    Treated as immutable (not frozen: see ``SavedChunk``). ``chunks`` is a tuple, or for a
    grid a :class:`~.layouts.LayoutChunks`, which builds a chunk only when asked for."""

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
        format_version: :data:`~.names.FORMAT_VERSION`.
        block_size: Bytes per checksummed block of a data section.
        files: The size of each data file (a rank that wrote nothing has none).
        tensors, objects: The tensor and the other entries by key, in index order.
        save: Facts of the save.
        aliases: Tied tensors: alias key -> the key first in the saved state dict;
            ``tensors`` holds each alias too, with its target's chunks.
        data_starts: Per file, the first byte of its data section (where blocks count from).
        file_checksums: Per file, its data section's block checksums, concatenated.
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
        """The first byte of the first block of ``file`` that ``[begin, end)`` touches, and the
        checksums of the blocks it touches (none for an empty range). Blocks are counted from
        the data section's start; the last one ends at the file's end."""
        start = self.data_starts[file]
        first = (begin - start) // self.block_size
        stop = -(-(end - start) // self.block_size) if end > begin else first
        sums = self.file_checksums[file]
        return start + first * self.block_size, [
            sums[16 * block : 16 * block + 16] for block in range(first, stop)
        ]

    def to_metadata(self) -> Metadata:
        """The index as DCP-style :class:`Metadata`, built lazily (see :mod:`.view`)."""
        return metadata_view(self)
