"""The strict decoder: :func:`decode_index` reads an index and trusts nothing.

It checks the seal, then every type, name, number, layout, tiling and byte range; every
failure is a :class:`~shardwise.errors.CheckpointFormatError` naming the key. Left to the
reader: what needs the files (their real size and type), and the packing of a file's grid
cells, checked when a chunk of it is first needed (:class:`FileOrders`: O(tensors) per file
read, not O(chunks) per reader).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from shardwise._boxes import origin
from shardwise.checkpoint.index.checks import (
    HEX_DIGITS,
    Ranges,
    check_chunks_tile,
    dims_of,
    fail,
    has_surrogate_escape,
    int_of,
    parse_json,
    row_of,
    text_of,
)
from shardwise.checkpoint.index.fields import (
    decode_aliases,
    decode_checksum,
    decode_file_name,
    decode_objects,
    decode_properties,
    decode_save_facts,
    decode_tensor_head,
    expected_keys,
    file_of,
)
from shardwise.checkpoint.index.layouts import FileOrder, Grid, LayoutChunks, file_cells
from shardwise.checkpoint.index.names import (
    FIRST_DATA_BYTE,
    FORMAT,
    FORMAT_VERSION,
    HEX,
    MAX_INDEX_BYTES,
    MAX_INT,
    SEAL_KEY,
    SEAL_LENGTH,
    num_blocks,
    paused_gc,
)
from shardwise.checkpoint.index.records import Index, TensorRecord
from shardwise.checkpoint.planning.planner import SavedChunk

__all__ = ["FileOrders", "decode_index"]


def decode_index(data: bytes) -> Index:
    """Read and validate a checkpoint index.

    Raises:
        CheckpointFormatError: The index is corrupt (its seal does not match or is missing),
            malformed, of a version this shardwise does not read, or describes layouts,
            names or byte ranges that cannot be right (see ``docs/format.md``,
            *Validation*).
    """
    if len(data) > MAX_INDEX_BYTES:
        fail(f"the checkpoint index has {len(data)} bytes, more than a reader accepts")
    sealed = (
        len(data) >= SEAL_LENGTH
        and data.endswith(b'"}')
        and data[-SEAL_LENGTH : -HEX - 2] == SEAL_KEY
    )
    if sealed:
        prefix = data[:-SEAL_LENGTH]
        if xxhash.xxh3_64_hexdigest(prefix).encode() != data[-HEX - 2 : -2]:
            fail(
                "the checkpoint index is corrupt: its checksum does not match its content (a "
                "changed or damaged byte)"
            )
    with paused_gc():
        document = parse_json(data, "the checkpoint index")
        if type(document) is not dict:
            fail(f"a checkpoint index must be a JSON object, got {type(document).__name__}")
        if document.get("format") != FORMAT:
            fail(
                f"not a shardwise checkpoint index: format is {document.get('format')!r}, "
                f"expected {FORMAT!r}"
            )
        # Checked first: another version may have other fields (docs/format.md, *Versioning*).
        version = document.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:
            fail(
                f"unsupported checkpoint format version {version!r}; this shardwise reads "
                f"version {FORMAT_VERSION} (a newer shardwise may read it)"
            )
        if not sealed:
            fail("the checkpoint index is corrupt: its checksum (index_checksum) is missing")
        if b"\\u" in data and has_surrogate_escape(data):
            fail("the checkpoint index holds a lone surrogate, which is not text")
        return _decode(document)


@dataclass(slots=True, eq=False)
class FileOrders:
    """The :class:`FileOrder` of each data file, computed when a chunk of the file is first
    asked for (only the files a reader reads). A grid cell in a ``null`` file is refused then."""

    grids: list[tuple[str, Grid, int]]
    names: Sequence[str | None]
    starts: Mapping[str, int]
    ends: Mapping[str, int]
    _orders: dict[int, FileOrder] = field(default_factory=dict, init=False)

    def __call__(self, file: int) -> FileOrder:
        order = self._orders.get(file)
        if order is None:
            name = self.names[file]
            if name is None:
                key = next(file_cells(self.grids, file), (None,))[0]  # the grid that asks
                fail(f"a grid cell is in file {file}, a rank that wrote no data file (null)", key)
            try:
                order = FileOrder(self.grids, file, self.starts[name], self.ends[name])
            except ValueError as err:
                fail(f"the grid cells of {name} are not packed as its size says: {err}")
            self._orders[file] = order
        return order


def _decode(document: dict[str, Any]) -> Index:
    """A parsed, sealed index of this version, every field checked (but grid cell packing)."""
    expected = expected_keys(with_aliases="aliases" in document)
    if tuple(document) != expected:
        fail(f"the checkpoint index must have exactly the keys {list(expected)} in order")
    facts = decode_save_facts(document["save"])
    block_size = decode_checksum(document["checksum"])

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
            grid = _known_grid(layout, size, names, fqn, known_grids)
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

    objects = decode_objects(document["objects"], tensors, names, ranges)
    ranges.check()
    data_bytes = sum(files.values()) - sum(starts.values())
    if grid_bytes + ranges.total() > data_bytes:
        fail(
            f"the index describes {grid_bytes + ranges.total()} bytes of tensors and objects, "
            f"more than the {data_bytes} bytes of data its files declare"
        )
    for name, nbytes in files.items():
        first = ranges.first_begin(name)
        ends[name] = nbytes if first is None else first
    aliases = {}
    if "aliases" in document:
        aliases = decode_aliases(document["aliases"], tensors, objects)
    return Index(FORMAT_VERSION, block_size, files, tensors, objects, facts, aliases, starts, sums)


def _files(
    rows: object, block_size: int
) -> tuple[dict[str, int], list[str | None], dict[str, int], dict[str, str]]:
    """The ``files`` rows: ``[name, size, data_start, block checksums of the data]``, or
    ``null`` for a rank that wrote no data file. Returns the files, the name of each file
    number (``None`` for a null), and the data start and checksums of each file."""
    if type(rows) is not list:
        fail("files must be a list")
    files: dict[str, int] = {}
    names: list[str | None] = []
    starts: dict[str, int] = {}
    sums: dict[str, str] = {}
    for row in rows:
        if row is None:
            names.append(None)
            continue
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
    names: Sequence[str | None],
    fqn: str,
    known: dict[tuple[Any, ...], Grid],
) -> Grid:
    """:func:`_grid`, from ``known`` for an all-int layout an earlier row gave with the same
    size (8,000 rows of a model hold a few dozen distinct grids). Ints are checked by type
    first, so that ``True`` or ``3.0`` (equal to ``1`` and ``3`` as keys) find no grid."""
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
                grid = known[key] = _grid(layout, size, names, fqn)
            return grid
    return _grid(layout, size, names, fqn)


def _grid(layout: list[Any], size: tuple[int, ...], names: Sequence[str | None], fqn: str) -> Grid:
    """A ``["grid", steps, [first, strides...]]`` layout of a tensor of ``size``."""
    _, steps, placement = row_of(layout, 3, "a grid layout", fqn)
    steps = dims_of(steps, "grid steps", fqn)
    if len(steps) != len(size) or not all(steps):
        fail(f"a grid needs one step >= 1 per dim of the size {list(size)}", fqn)
    if type(placement) is not list or len(placement) != len(size) + 1:
        fail("a grid's files must be [first, one stride per dim]", fqn)
    first, *strides = (int_of(v, "a grid file number", fqn) for v in placement)
    grid = Grid(size, steps, first, tuple(strides))
    if grid.num_cells > len(names):
        # A writer's grid has one cell per rank that holds a piece. The bound keeps a reader's
        # work per file O(tensors) whatever sizes the index declares.
        fail(f"a grid of {grid.num_cells} cells has more cells than there are files", fqn)
    if grid.last_file >= len(names):
        fail(f"the grid's cells reach file {grid.last_file}, which does not exist", fqn)
    if names[grid.first] is None or names[grid.last_file] is None:
        # Cells between are checked with the packing of their file (FileOrders).
        fail("a grid cell is in a file of a rank that wrote no data file (null)", fqn)
    return grid


def _chunk(
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    file: object,
    begin: object,
    itemsize: int,
    names: Sequence[str | None],
    fqn: str,
) -> SavedChunk:
    name = file_of(file, names, fqn)
    begin = int_of(begin, "begin", fqn)
    end = begin + math.prod(sizes) * itemsize
    if end >= MAX_INT:
        fail("malformed chunk", fqn)
    return SavedChunk(offsets, sizes, name, begin, end)


def _whole(
    layout: list[Any],
    size: tuple[int, ...],
    itemsize: int,
    names: Sequence[str | None],
    ranges: Ranges,
    fqn: str,
) -> SavedChunk:
    """A ``["whole", file, begin]`` layout's one chunk, its byte range added to ``ranges``.
    A reader's hot path: the checks of :func:`_chunk` and :meth:`Ranges.add` written out for
    a well-formed row; any other runs them to raise."""
    if len(layout) == 3:
        _, file, begin = layout
        if type(file) is int and 0 <= file < len(names) and type(begin) is int and begin >= 0:
            end = begin + math.prod(size) * itemsize
            name = names[file]
            if name is not None and ranges.add_range(name, begin, end, fqn):
                return SavedChunk(origin(len(size)), size, name, begin, end)
    _, file, begin = row_of(layout, 3, "a whole layout", fqn)
    chunk = _chunk(tuple(0 for _ in size), size, file, begin, itemsize, names, fqn)
    ranges.add(chunk, fqn)
    # Unreachable while the two agree; a reader still refuses the row, as a format error.
    fail("malformed whole layout", fqn)


def _chunk_row(row: object, itemsize: int, names: Sequence[str | None], fqn: str) -> SavedChunk:
    offsets, sizes, file, begin = row_of(row, 4, "a chunk", fqn)
    offsets = dims_of(offsets, "chunk offsets", fqn)
    sizes = dims_of(sizes, "chunk sizes", fqn)
    return _chunk(offsets, sizes, file, begin, itemsize, names, fqn)
