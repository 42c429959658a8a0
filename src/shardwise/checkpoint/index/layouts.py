"""The index's tensor layouts: a tensor described by its rule instead of one row per chunk.

A ``grid`` (``docs/format.md``, *The index*) cuts each dim by the ceil rule and maps each cell
to a file by an affine rule: a tensor sharded over 1,024 ranks is one row, not 1,024. A reader
derives each cell's begin by a prefix sum over its file (:class:`FileOrder`). Pure; O(dims)
per query, or O(cells of one file)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from shardwise._boxes import Box
from shardwise.checkpoint.index.records import SavedChunk

__all__ = ["FileOrder", "Grid", "LayoutChunks", "ceil_grid_steps", "file_cells"]


def ceil_grid_steps(size: Sequence[int], parts: Sequence[int]) -> tuple[int, ...]:
    """The steps of a ceil-rule grid of ``parts`` chunks per dim of ``size`` (1 if empty)."""
    return tuple(max(1, -(-n // k)) for n, k in zip(size, parts, strict=True))


@dataclass(frozen=True, slots=True)
class Grid:
    """A tensor cut into cells ``[k * step, min((k + 1) * step, size))`` along each dim
    (``steps`` >= 1: ``size[d]`` or more for an unsplit dim). Cell ``(k_0, ...)`` is in file
    ``first + sum(k_d * strides[d])`` (a number in the index's ``files``)."""

    size: tuple[int, ...]
    steps: tuple[int, ...]
    first: int
    strides: tuple[int, ...]
    #: Cells along each dim (none past the end; one along an empty dim).
    counts: tuple[int, ...] = field(init=False, compare=False, repr=False)
    last_file: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        counts = tuple(max(1, -(-n // s)) for n, s in zip(self.size, self.steps, strict=True))
        last = self.first + sum((c - 1) * s for c, s in zip(counts, self.strides, strict=True))
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "last_file", last)

    @property
    def num_cells(self) -> int:
        return math.prod(self.counts)

    def file_of(self, cell: Sequence[int]) -> int:
        """The file number of ``cell``."""
        return self.first + sum(k * s for k, s in zip(cell, self.strides, strict=True))

    def box(self, cell: Sequence[int]) -> Box:
        """``cell``'s box in the tensor: ``(offsets, sizes)``."""
        offsets = tuple(k * s for k, s in zip(cell, self.steps, strict=True))
        sizes = tuple(
            max(0, min(o + s, n) - o)
            for o, s, n in zip(offsets, self.steps, self.size, strict=True)
        )
        return offsets, sizes

    def cell_at(self, number: int) -> tuple[int, ...]:
        """The cell of row-major ``number``."""
        cell = []
        for count in reversed(self.counts):
            number, k = divmod(number, count)
            cell.append(k)
        return tuple(reversed(cell))

    def number_of(self, cell: Sequence[int]) -> int:
        """The row-major number of ``cell``."""
        number = 0
        for k, count in zip(cell, self.counts, strict=True):
            number = number * count + k
        return number

    def cells(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """The cells sharing an element with box ``(offsets, sizes)``, row-major; O(dims + hits)."""
        if not all(sizes):
            return iter(())
        ranges = []
        for o, s, step, count in zip(offsets, sizes, self.steps, self.counts, strict=True):
            low, high = o // step, min(count, -(-(o + s) // step))
            if low >= high:
                return iter(())
            ranges.append(range(low, high))
        return itertools.product(*ranges)

    def cells_in_file(self, file: int) -> Iterator[tuple[int, ...]]:
        """The cells in ``file``, in row-major order: O(cells found x dims) for strides
        that tell the dims apart (each dim's range is bounded by what the later dims can
        still add); a dim of stride 0 repeats its cells in the same file."""
        counts, strides = self.counts, self.strides
        reach = [0] * (len(counts) + 1)  # the most the dims from d on can add
        for d in range(len(counts) - 1, -1, -1):
            reach[d] = reach[d + 1] + (counts[d] - 1) * strides[d]

        def walk(d: int, remaining: int, prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
            if d == len(counts):
                if remaining == 0:
                    yield prefix
                return
            stride = strides[d]
            if stride == 0:
                ks: range = range(counts[d])
            else:
                low = max(0, -(-(remaining - reach[d + 1]) // stride))
                ks = range(low, min(counts[d] - 1, remaining // stride) + 1)
            for k in ks:
                yield from walk(d + 1, remaining - k * stride, (*prefix, k))

        if file < self.first:
            return iter(())
        return walk(0, file - self.first, ())


def file_cells(
    grids: Sequence[tuple[str, Grid, int]], file: int
) -> Iterator[tuple[str, int, Box, int]]:
    """The grid cells of ``file`` in the order it holds them, ``(key, cell number, box, nbytes)``,
    from ``grids``: ``(key, grid, itemsize)`` of every grid tensor, in index order."""
    # A model repeats a few shapes: cells are found once per distinct (grid, itemsize).
    known: dict[tuple[Grid, int], list[tuple[int, Box, int]]] = {}
    for key, grid, itemsize in grids:
        if not grid.first <= file <= grid.last_file:
            continue
        cells = known.get((grid, itemsize))
        if cells is None:
            cells = known[grid, itemsize] = []
            for cell in grid.cells_in_file(file):
                box = grid.box(cell)
                cells.append((grid.number_of(cell), box, math.prod(box[1]) * itemsize))
        for number, box, nbytes in cells:
            yield key, number, box, nbytes


class FileOrder:
    """The begins of the grid cells of data file number ``file``: a prefix sum over
    :func:`file_cells` from ``data_start``. ``end`` is where the cells must end: the first
    byte of the file's other entries, or its size.

    Raises:
        ValueError: The cells do not end exactly at ``end`` (the message says where).
    """

    __slots__ = ("_begins",)

    def __init__(
        self, grids: Sequence[tuple[str, Grid, int]], file: int, data_start: int, end: int
    ) -> None:
        self._begins: dict[tuple[str, int], int] = {}
        position = data_start
        for key, number, _, nbytes in file_cells(grids, file):
            self._begins[key, number] = position
            position += nbytes
            if position > end:
                raise ValueError(f"its grid cells run past byte {end}, at {key!r}")
        if position != end:
            raise ValueError(f"its grid cells end at byte {position}, not at {end}")

    def begin(self, key: str, number: int) -> int:
        """The first byte of cell ``number`` (row-major) of ``key``'s grid."""
        return self._begins[key, number]


class LayoutChunks(Sequence[SavedChunk]):
    """The chunks of grid tensor ``key`` (its ``TensorRecord.chunks``), each built when first
    asked for; :meth:`candidates` finds those overlapping a box without building the others (a
    ``planner.ChunkLookup``: ``plan_reads`` takes it as its ``lookup``). ``names``: the index's
    file names by number; ``order``: a file number's :class:`FileOrder` (refusing a null)."""

    __slots__ = ("_built", "_itemsize", "_key", "_len", "_names", "_order", "grid")

    def __init__(
        self,
        key: str,
        grid: Grid,
        itemsize: int,
        names: Sequence[str | None],
        order: Callable[[int], FileOrder],
    ) -> None:
        self._key = key
        self.grid = grid
        self._itemsize = itemsize
        self._names = names
        self._order = order
        self._len = grid.num_cells
        # A planner asks for a chunk more than once.
        self._built: dict[int, SavedChunk] = {}

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, number: int) -> SavedChunk:  # type: ignore[override]
        chunk = self._built.get(number)
        if chunk is not None:
            return chunk
        if not 0 <= number < self._len:
            if -self._len <= number < 0:
                return self[number + self._len]
            raise IndexError(number)
        cell = self.grid.cell_at(number)
        offsets, sizes = self.grid.box(cell)
        file = self.grid.file_of(cell)
        begin = self._order(file).begin(self._key, number)
        end = begin + math.prod(sizes) * self._itemsize
        name = self._names[file]
        assert name is not None  # the order of a null file raises
        chunk = self._built[number] = SavedChunk(offsets, sizes, name, begin, end)
        return chunk

    def __iter__(self) -> Iterator[SavedChunk]:
        return (self[number] for number in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def candidates(self, target: Box) -> list[int]:
        """The numbers of the chunks that overlap ``target`` (a 0-d target: the one chunk)."""
        if not target[0]:
            return [0]
        return [self.grid.number_of(cell) for cell in self.grid.cells(*target)]
