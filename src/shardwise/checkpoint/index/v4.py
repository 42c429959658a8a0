"""Version 4 of the index: tensors described by layouts (``grid``, ``whole``, ``chunks``)
and block checksums per data file instead of per chunk (see ``docs/format.md``, *Version 4*).

Its size grows with keys and files, not with chunks: 1,024 ranks x 10,000 FSDP-sharded
tensors is 1.8 MiB instead of 443 MiB (``docs/design/scale.md``). A writer uses it only above
``TUNING.layout_index_chunks`` chunks (:mod:`shardwise.checkpoint.tuning`); readers read it
always.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise._boxes import origin
from shardwise.checkpoint.index.checks import (
    HEX_DIGITS,
    Ranges,
    check_chunks_tile,
    dims_of,
    fail,
    int_of,
    row_of,
    text_of,
)
from shardwise.checkpoint.index.encode import PropertyTable, document_of, object_rows, seal
from shardwise.checkpoint.index.fields import (
    decode_aliases,
    decode_checksum,
    decode_file_name,
    decode_objects,
    decode_properties,
    decode_save_facts,
    decode_tensor_head,
    expected_keys,
)
from shardwise.checkpoint.index.layouts import FileOrder, Grid, LayoutChunks
from shardwise.checkpoint.index.names import (
    BLOCK_SIZE,
    CHECKSUM_ALGORITHM,
    FIRST_DATA_BYTE,
    HEX,
    LAYOUT_VERSION,
    MAX_INT,
    num_blocks,
    paused_gc,
)
from shardwise.checkpoint.index.records import Index, ObjectRecord, SaveFacts, TensorRecord
from shardwise.checkpoint.planner import SavedChunk
from shardwise.metadata import TensorProperties

__all__ = ["FileFacts", "FileOrders", "LayoutRecord", "decode_v4", "encode_v4"]

_CHECKSUM_KEYS = ("algorithm", "block_size", "scope")


@dataclass(frozen=True, slots=True)
class FileFacts:
    """A data file as version 4 records it.

    Attributes:
        size: Its size in bytes.
        data_start: The first byte of its data section (after the safetensors header).
        checksums: The block checksums of ``[data_start, size)``, concatenated.
    """

    size: int
    data_start: int
    checksums: str


@dataclass(slots=True)
class LayoutRecord:
    """A tensor as a version-4 writer describes it: a :class:`Grid` (file numbers are
    positions in the index's ``files``), or its chunks with their byte ranges (one chunk that
    is the whole tensor is written as a ``whole`` layout; checksums are not used). Treated as
    immutable; not frozen, which costs a fifth of a microsecond per field on construction,
    per tensor."""

    fqn: str
    properties: TensorProperties
    size: tuple[int, ...]
    layout: Grid | Sequence[SavedChunk]


def encode_v4(
    save: SaveFacts,
    files: Mapping[str, FileFacts],
    tensors: Iterable[LayoutRecord],
    objects: Iterable[ObjectRecord],
    block_size: int = BLOCK_SIZE,
    aliases: Mapping[str, str] | None = None,
) -> bytes:
    """The sealed version-4 index (see ``docs/format.md``, *Version 4*): ``files`` in the
    order their numbers refer to; grid cells packed in each file as :class:`FileOrder`
    says, the other entries at the begins they carry."""
    with paused_gc():
        numbers = {name: number for number, name in enumerate(files)}
        properties = PropertyTable()
        rows = []
        last: tuple[TensorProperties | None, int] = (None, -1)  # most rows share the last's
        for tensor in tensors:
            if tensor.properties is not last[0]:
                last = (tensor.properties, properties.number(tensor.properties))
            rows.append([tensor.fqn, last[1], list(tensor.size), _layout_row(tensor, numbers)])
        document = document_of(
            LAYOUT_VERSION,
            save,
            {"algorithm": CHECKSUM_ALGORITHM, "block_size": block_size, "scope": "file"},
            [[name, f.size, f.data_start, f.checksums] for name, f in files.items()],
            properties,
            rows,
            object_rows(objects, numbers, with_checksums=False),
            aliases or {},
        )
        return seal(document)


def _layout_row(tensor: LayoutRecord, numbers: Mapping[str, int]) -> list[Any]:
    layout = tensor.layout
    if isinstance(layout, Grid):
        return ["grid", list(layout.steps), [layout.first, *layout.strides]]
    if len(layout) == 1 and layout[0].sizes == tensor.size and not any(layout[0].offsets):
        return ["whole", numbers[layout[0].file], layout[0].begin]
    return [
        "chunks",
        [[list(c.offsets), list(c.sizes), numbers[c.file], c.begin] for c in layout],
    ]


class FileOrders:
    """The :class:`FileOrder` of each data file of a version-4 index, computed the first time
    a chunk of the file is asked for (O(tensors) per file: only the files a reader reads)."""

    __slots__ = ("_ends", "_grids", "_names", "_orders", "_starts")

    def __init__(
        self,
        grids: list[tuple[str, Grid, int]],
        names: list[str],
        starts: Mapping[str, int],
        ends: Mapping[str, int],
    ) -> None:
        self._grids = grids
        self._names = names
        self._starts = starts
        self._ends = ends
        self._orders: dict[int, FileOrder] = {}

    def __call__(self, file: int) -> FileOrder:
        order = self._orders.get(file)
        if order is None:
            name = self._names[file]
            try:
                order = FileOrder(self._grids, file, self._starts[name], self._ends[name])
            except ValueError as err:
                fail(f"the grid cells of {name} are not packed as its size says: {err}")
            self._orders[file] = order
        return order


def decode_v4(document: dict[str, Any]) -> Index:
    """A parsed, sealed version-4 index, every field checked (see ``docs/format.md``,
    *Validation*); the packing of grid cells is checked per file when a chunk of it is
    first asked for (:class:`FileOrders`)."""
    expected = expected_keys(with_aliases="aliases" in document)
    if tuple(document) != expected:
        fail(
            f"the checkpoint index of version {LAYOUT_VERSION} must have exactly the keys "
            f"{list(expected)} in order"
        )
    facts = decode_save_facts(document["save"])
    checksum = decode_checksum(document["checksum"], _CHECKSUM_KEYS)
    if checksum["scope"] != "file":
        fail(f"unsupported checksum scope {checksum['scope']!r}; version 4 has 'file'")
    block_size: int = checksum["block_size"]

    files, names, starts, sums = _files(document["files"], block_size)
    properties = decode_properties(document["properties"])
    ranges = Ranges(files, starts)
    tensors: dict[str, TensorRecord] = {}
    grids: list[tuple[str, Grid, int]] = []
    ends: dict[str, int] = {}  # filled once every range is known
    orders = FileOrders(grids, names, starts, ends)
    rows = document["tensors"]
    if type(rows) is not list:
        fail("tensors must be a list")
    grid_bytes = 0
    known_grids: dict[tuple[Any, ...], Grid] = {}  # a model repeats a few shapes
    for row in rows:
        fqn, props, size, layout = decode_tensor_head(row, properties, tensors)
        itemsize = props.dtype.itemsize
        kind = layout[0] if type(layout) is list and layout else None
        chunks: Sequence[SavedChunk]
        if kind == "grid":
            grid = _known_grid(layout, size, len(names), fqn, known_grids)
            grids.append((fqn, grid, itemsize))
            grid_bytes += math.prod(size) * itemsize
            chunks = LayoutChunks(fqn, grid, itemsize, names, orders)
        elif kind == "whole":
            chunks = (_whole(layout, size, itemsize, names, ranges, fqn),)
        elif kind == "chunks":
            _, chunk_rows = row_of(layout, 2, "a chunks layout", fqn)
            if type(chunk_rows) is not list:
                fail("chunks must be a list", fqn)
            chunks = tuple(_chunk_row(r, itemsize, names, fqn) for r in chunk_rows)
            for chunk in chunks:
                ranges.add(chunk, fqn)
            check_chunks_tile(fqn, size, list(chunks))
        else:
            fail("a layout must be a list starting with 'grid', 'whole' or 'chunks'", fqn)
        tensors[fqn] = TensorRecord(fqn, props, size, chunks)

    objects = decode_objects(
        document["objects"], tensors, names, block_size, ranges, with_checksums=False
    )
    ranges.check()
    data_bytes = sum(files[name] or 0 for name in names) - sum(starts.values())
    if grid_bytes + ranges.total() > data_bytes:
        fail(
            f"the index describes {grid_bytes + ranges.total()} bytes of tensors and objects, "
            f"more than the {data_bytes} bytes of data its files declare"
        )
    for name in names:
        first = ranges.first_begin(name)
        ends[name] = (files[name] or 0) if first is None else first
    aliases = {}
    if "aliases" in document:
        aliases = decode_aliases(document["aliases"], tensors, objects)
    return Index(
        LAYOUT_VERSION,
        block_size,
        files,
        tensors,
        objects,
        save=facts,
        aliases=aliases,
        data_starts=starts,
        file_checksums=sums,
    )


def _files(
    rows: object, block_size: int
) -> tuple[dict[str, int | None], list[str], dict[str, int], dict[str, str]]:
    """The ``files`` rows: ``[name, size, data_start, block checksums of the data]``."""
    if type(rows) is not list:
        fail("files must be a list")
    files: dict[str, int | None] = {}
    names: list[str] = []
    starts: dict[str, int] = {}
    sums: dict[str, str] = {}
    for row in rows:
        name, size, start, checksums = row_of(row, 4, "a files entry")
        name = decode_file_name(name, files)
        size = int_of(size, f"the size of {name}")
        start = int_of(start, f"the data start of {name}")
        if not FIRST_DATA_BYTE <= start <= size:
            fail(f"the data of {name} starts at {start}, outside [{FIRST_DATA_BYTE}, {size}]")
        checksums = text_of(checksums, f"the block checksums of {name}")
        if len(checksums) != num_blocks(size - start, block_size) * HEX:
            fail(
                f"malformed block checksums of {name} (expected "
                f"{num_blocks(size - start, block_size)} of 16 hex digits)"
            )
        if HEX_DIGITS.fullmatch(checksums) is None:
            fail(f"malformed block checksums of {name}: expected lowercase hex digits")
        files[name], starts[name], sums[name] = size, start, checksums
        names.append(name)
    return files, names, starts, sums


def _known_grid(
    layout: list[Any],
    size: tuple[int, ...],
    num_files: int,
    fqn: str,
    known: dict[tuple[Any, ...], Grid],
) -> Grid:
    """:func:`_grid`, answered from ``known`` for a layout of only ints that an earlier row
    of this index gave with the same size (a model's tensors repeat a few shapes: 8,000 rows
    hold a few dozen distinct grids). What :func:`_grid` refuses is never in ``known``; ints
    are checked by type first, so that ``True`` or ``3.0`` (equal to ``1`` and ``3`` as keys)
    never find a grid."""
    if len(layout) == 3:
        _, steps, placement = layout
        if (
            type(steps) is list
            and type(placement) is list
            and all([type(value) is int for value in steps])
            and all([type(value) is int for value in placement])
        ):
            key = (size, tuple(steps), tuple(placement))
            grid = known.get(key)
            if grid is None:
                grid = known[key] = _grid(layout, size, num_files, fqn)
            return grid
    return _grid(layout, size, num_files, fqn)


def _grid(layout: list[Any], size: tuple[int, ...], num_files: int, fqn: str) -> Grid:
    """A ``["grid", steps, [first, strides...]]`` layout of a tensor of ``size``."""
    _, steps, placement = row_of(layout, 3, "a grid layout", fqn)
    steps = dims_of(steps, "grid steps", fqn)
    if len(steps) != len(size) or not all(steps):
        fail(f"a grid needs one step >= 1 per dim of the size {list(size)}", fqn)
    if type(placement) is not list or len(placement) != len(size) + 1:
        fail("a grid's files must be [first, one stride per dim]", fqn)
    first, *strides = (int_of(v, "a grid file number", fqn) for v in placement)
    grid = Grid(size, steps, first, tuple(strides))
    if grid.num_cells > num_files:
        # A writer's grid has one cell per rank that holds a piece. The bound keeps a reader's
        # work per file O(tensors) whatever sizes the index declares.
        fail(f"a grid of {grid.num_cells} cells has more cells than there are files", fqn)
    if grid.last_file >= num_files:
        fail(f"the grid's cells reach file {grid.last_file}, which does not exist", fqn)
    return grid


def _chunk(
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    file: object,
    begin: object,
    itemsize: int,
    names: list[str],
    fqn: str,
) -> SavedChunk:
    if type(file) is not int or not 0 <= file < len(names):
        fail(f"file index {file!r} does not exist", fqn)
    begin = int_of(begin, "begin", fqn)
    end = begin + math.prod(sizes) * itemsize
    if end >= MAX_INT:
        fail("malformed chunk", fqn)
    return SavedChunk(offsets, sizes, names[file], begin, end, "")


def _whole(
    layout: list[Any],
    size: tuple[int, ...],
    itemsize: int,
    names: list[str],
    ranges: Ranges,
    fqn: str,
) -> SavedChunk:
    """A ``["whole", file, begin]`` layout's one chunk, its byte range added to ``ranges``.
    The hot path of a reader of many small tensors: the checks of :func:`_chunk` and
    :meth:`Ranges.add` written out for a well-formed row, which they then run for any
    other to raise."""
    if len(layout) == 3:
        _, file, begin = layout
        if type(file) is int and 0 <= file < len(names) and type(begin) is int and begin >= 0:
            end = begin + math.prod(size) * itemsize
            name = names[file]
            if ranges.add_range(name, begin, end, fqn):
                return SavedChunk(origin(len(size)), size, name, begin, end, "")
    _, file, begin = row_of(layout, 3, "a whole layout", fqn)
    chunk = _chunk(tuple(0 for _ in size), size, file, begin, itemsize, names, fqn)
    ranges.add(chunk, fqn)
    # Unreachable while the two agree; a reader still refuses the row, as a format error.
    fail("malformed whole layout", fqn)


def _chunk_row(row: object, itemsize: int, names: list[str], fqn: str) -> SavedChunk:
    offsets, sizes, file, begin = row_of(row, 4, "a chunk", fqn)
    offsets = dims_of(offsets, "chunk offsets", fqn)
    sizes = dims_of(sizes, "chunk sizes", fqn)
    return _chunk(offsets, sizes, file, begin, itemsize, names, fqn)
