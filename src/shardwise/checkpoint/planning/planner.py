"""The records save and load share, the agreement on tied tensors, and which bytes each rank
reads for each target box; every rank reaches the same plan from the same metadata. The records
are slotted, not frozen, and treated as immutable: a save or load builds one per chunk, and
frozen construction costs four to five times as much."""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from shardwise._boxes import Box, intersect
from shardwise.checkpoint import tuning
from shardwise.checkpoint.index.records import SavedChunk

__all__ = [
    "Box",
    "Candidates",
    "ChunkLookup",
    "ChunkRead",
    "TensorPlan",
    "WriteAssignment",
    "agree_aliases",
    "plan_reads",
    "whole_reads",
]


def numel(sizes: Sequence[int]) -> int:
    """Number of elements of a box of ``sizes``."""
    return math.prod(sizes)


@dataclass(slots=True)
class TensorPlan:
    """What :func:`agree_aliases` compares of one tensor: its global facts (``dtype`` by
    :func:`shardwise.metadata.dtype_name`) and ``holders``, per distinct box its group ranks."""

    dtype: str
    size: tuple[int, ...]
    properties: dict[str, Any]
    holders: dict[Box, list[int]] = field(default_factory=dict)


def agree_aliases(
    local_aliases: Sequence[Mapping[str, str]], merged: Mapping[str, TensorPlan]
) -> dict[str, str]:
    """The tied tensors of a save: key -> the key it is tied to, from every rank's view.

    ``local_aliases[r]`` maps each key whose local data rank ``r`` sees to be that of an
    earlier key (in state-dict order) to that key. A key is tied to a target when every rank
    that holds an element of either says so, the two have the same global facts, and the
    target is not itself tied. Anything less is saved as two tensors (always correct)."""
    candidates: dict[str, str] = {}
    refused: set[str] = set()
    for aliases in local_aliases:
        for alias, target in aliases.items():
            if candidates.setdefault(alias, target) != target:
                refused.add(alias)
    agreed: dict[str, str] = {}
    for alias, target in candidates.items():
        if alias in refused or alias not in merged or target not in merged:
            continue
        a, t = merged[alias], merged[target]
        if (a.dtype, a.size, a.properties) != (t.dtype, t.size, t.properties):
            continue
        witnesses = {
            rank
            for plan in (a, t)
            for (_, sizes), ranks in plan.holders.items()
            if numel(sizes)
            for rank in ranks
        }
        if witnesses and all(local_aliases[rank].get(alias) == target for rank in witnesses):
            agreed[alias] = target
    return {alias: target for alias, target in agreed.items() if target not in agreed}


@dataclass(slots=True)
class WriteAssignment:
    """One chunk a rank writes."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int


@dataclass(slots=True, unsafe_hash=True)
class ChunkRead:
    """A read of ``nbytes`` at absolute ``file_offset`` in the file of chunk number ``chunk``
    for the global box ``overlap``; ``whole_chunk``: the entire chunk (checksum verifiable);
    ``strides``: ``None`` for the overlap in C order, else its element strides in the bytes."""

    chunk: int
    file_offset: int
    nbytes: int
    overlap: Box
    whole_chunk: bool
    strides: tuple[int, ...] | None


def _span(sizes: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from the first to the last of a box of ``sizes`` in a chunk of ``strides``."""
    return 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides, strict=True))


def _split_level(
    overlap_sizes: Sequence[int], strides: Sequence[int], itemsize: int, read_cost: int
) -> int:
    """How many leading dims to split a non-contiguous overlap along (one read per index of
    them): the least ``reads * read_cost + bytes``, the fewest reads on a tie."""

    def cost(level: int) -> int:
        span = _span(overlap_sizes[level:], strides[level:])
        return numel(overlap_sizes[:level]) * (read_cost + span * itemsize)

    return min(range(len(overlap_sizes)), key=cost, default=0)


class Candidates(Protocol):
    """Finds the chunks of a tensor that may overlap a box (:class:`ChunkLookup`)."""

    def candidates(self, target: Box) -> list[int]:
        """Indices of the chunks that may overlap ``target``, ascending (a superset)."""


class ChunkLookup:
    """The chunks of one tensor that may overlap a box, in O(log n + k) for ``k`` candidates
    instead of O(n) (a rank of a 1,024-rank job plans its share without scanning every
    chunk): sorted by offset along the dim with the most distinct offsets, then bisected.
    ``chunks``: the saved chunks' boxes, any order (empty ones are never returned)."""

    __slots__ = ("_dim", "_ends", "_longest", "_order", "_starts")

    def __init__(self, chunks: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        filled = [i for i, (_, sizes) in enumerate(chunks) if numel(sizes)]
        ndim = len(chunks[0][0]) if chunks else 0
        self._dim = -1
        self._order = filled
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._longest = 0
        if ndim and len(filled) > 1:
            dim = max(range(ndim), key=lambda d: len({chunks[i][0][d] for i in filled}))
            self._dim = dim
            self._order = sorted(filled, key=lambda i: chunks[i][0][dim])
            self._starts = [chunks[i][0][dim] for i in self._order]
            self._ends = [chunks[i][0][dim] + chunks[i][1][dim] for i in self._order]
            self._longest = max(map(operator.sub, self._ends, self._starts))

    def candidates(self, target: Box) -> list[int]:
        if self._dim < 0 or not target[0]:
            return sorted(self._order)
        start = target[0][self._dim]
        end = start + target[1][self._dim]
        low = bisect.bisect_right(self._starts, start - self._longest)
        high = bisect.bisect_left(self._starts, end)
        return sorted(
            self._order[position] for position in range(low, high) if self._ends[position] > start
        )


def plan_reads(
    target: Box,
    chunks: Sequence[SavedChunk],
    itemsize: int,
    lookup: Candidates | None = None,
    read_cost: int | None = None,
) -> list[ChunkRead]:
    """The reads that fill ``target`` from ``chunks``, ordered by file and offset.

    A non-contiguous overlap (e.g. a column block of row-wise chunks) is read in pieces split
    along its leading dims, each from its first to its last element, so that a gap is read
    through exactly when it is smaller than ``TUNING.read_cost_bytes`` (on local files a
    positioned read costs about as much as copying 64 KiB). ``lookup`` (a :class:`ChunkLookup`
    of ``chunks``, or a grid's ``LayoutChunks``) finds the overlapping chunks fast.

    Raises:
        ValueError: The chunks do not cover ``target``.
    """
    if read_cost is None:
        read_cost = tuning.TUNING.read_cost_bytes
    if len(chunks) == 1:  # one chunk that is the whole target (the common case): one read
        only = chunks[0]
        if only.offsets == target[0] and only.sizes == target[1]:
            return [ChunkRead(0, only.begin, only.end - only.begin, target, True, None)]
    target_offsets, target_sizes = target
    indices = range(len(chunks)) if lookup is None else lookup.candidates(target)
    if numel(target_sizes):
        # A target that is a saved chunk (a load on the layout of the save): the chunks tile
        # the tensor (the coverage count below assumes it too), so no other one overlaps it.
        for index in indices:
            chunk = chunks[index]
            if chunk.offsets == target_offsets and chunk.sizes == target_sizes:
                return [ChunkRead(index, chunk.begin, chunk.end - chunk.begin, target, True, None)]
    reads = []
    covered = 0
    for index in indices:
        chunk = chunks[index]
        overlap: Box | None = ((), ())
        if target_offsets:
            overlap = intersect(target_offsets, target_sizes, chunk.offsets, chunk.sizes)
        if overlap is None:
            continue
        covered += numel(overlap[1])
        if overlap == (chunk.offsets, chunk.sizes):
            reads.append(ChunkRead(index, chunk.begin, chunk.nbytes, overlap, True, None))
        else:
            reads.extend(_overlap_reads(index, chunk, overlap, itemsize, read_cost))
    if covered != numel(target[1]):
        raise ValueError(
            f"saved chunks cover {covered} of the {numel(target[1])} elements of the box at "
            f"offsets {list(target[0])} with sizes {list(target[1])}"
        )
    reads.sort(key=lambda read: (chunks[read.chunk].file, read.file_offset))
    return reads


def whole_reads(chunks: Sequence[SavedChunk]) -> list[ChunkRead]:
    """:func:`plan_reads` of the whole tensor ``chunks`` tile, without intersecting boxes:
    every chunk with elements, read whole, in file order."""
    reads = [
        ChunkRead(
            index, chunk.begin, chunk.end - chunk.begin, (chunk.offsets, chunk.sizes), True, None
        )
        for index, chunk in enumerate(chunks)
        if numel(chunk.sizes)
    ]
    reads.sort(key=lambda read: (chunks[read.chunk].file, read.file_offset))
    return reads


def _overlap_reads(
    index: int, chunk: SavedChunk, overlap: Box, itemsize: int, read_cost: int
) -> list[ChunkRead]:
    """The reads of a part of a chunk (see :func:`plan_reads`)."""
    offsets, sizes = overlap
    strides = [math.prod(chunk.sizes[dim + 1 :]) for dim in range(len(chunk.sizes))]
    level = _split_level(sizes, strides, itemsize, read_cost)
    piece_sizes = (1,) * level + tuple(sizes[level:])
    span = _span(piece_sizes, strides)
    layout = None if span == numel(piece_sizes) else tuple(strides)
    nbytes = span * itemsize
    reads = []
    for lead in itertools.product(*(range(size) for size in sizes[:level])):
        piece_offsets = tuple(map(operator.add, offsets, lead)) + tuple(offsets[level:])
        first = sum(
            (o - c) * s for o, c, s in zip(piece_offsets, chunk.offsets, strides, strict=True)
        )
        begin = chunk.begin + first * itemsize
        reads.append(ChunkRead(index, begin, nbytes, (piece_offsets, piece_sizes), False, layout))
    return reads
