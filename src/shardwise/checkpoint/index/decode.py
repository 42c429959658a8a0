"""The strict decoder: :func:`decode_index` reads an index and trusts nothing (its checks:
``docs/format.md``, *Validation*). Left to the reader: what needs the files (their real size
and type), and the packing of a file's grid cells, checked when a chunk of it is first needed
(:class:`FileOrders`: O(tensors) per file read, not O(chunks) per reader)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from shardwise._boxes import origin
from shardwise._codec import DTYPES, LAYOUTS, MEMORY_FORMATS
from shardwise.checkpoint.index.checks import (
    HEX_DIGITS,
    Ranges,
    check_chunks_tile,
    check_int_suffix,
    dims_of,
    fail,
    has_surrogate_escape,
    int_of,
    parse_json,
    row_of,
    text_of,
)
from shardwise.checkpoint.index.layouts import FileOrder, Grid, LayoutChunks, file_cells
from shardwise.checkpoint.index.names import (
    CHECKSUM_ALGORITHM,
    DATA_DIR,
    DIGEST_HEX,
    ENCODINGS,
    FIRST_DATA_BYTE,
    FORMAT,
    FORMAT_VERSION,
    HEX,
    INCREMENTAL_VERSION,
    MAX_BLOCK,
    MAX_DIMS,
    MAX_INDEX_BYTES,
    MAX_INT,
    MIN_BLOCK,
    PORTABLE_RULE,
    QUANTIZED,
    SEAL_KEY,
    SEAL_LENGTH,
    TEXT_ENCODINGS,
    UNSUPPORTED_VERSION,
    VERSIONS,
    creatable,
    is_data_file_name,
    num_blocks,
    parse_reference,
    paused_gc,
)
from shardwise.checkpoint.index.records import (
    Index,
    ObjectRecord,
    SavedChunk,
    SaveFacts,
    TensorRecord,
)
from shardwise.errors import CheckpointVersionError
from shardwise.metadata import TensorProperties

__all__ = ["FileOrders", "decode_index"]

_SAVE_KEYS = ("writer", "torch", "world_size", "save_id", "checkpoint_id")
_SAVE_ID = re.compile(r"[0-9a-f]{16}")
_CHECKSUM_KEYS = ("algorithm", "block_size", "scope")
_KEYS = ("format", "format_version", "save", "checksum", "files", "properties", "tensors")


def decode_index(data: bytes) -> Index:
    """Read and validate a checkpoint index.

    Raises:
        CheckpointFormatError: The index is corrupt (its seal does not match or is missing),
            malformed, of a version this shardwise does not read, or describes layouts, names
            or byte ranges that cannot be right (see ``docs/format.md``, *Validation*).
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
        if type(version) is not int or version not in VERSIONS:
            raise CheckpointVersionError(
                f"{UNSUPPORTED_VERSION} {version!r}; this shardwise reads "
                f"version {FORMAT_VERSION} and version {INCREMENTAL_VERSION} (incremental "
                "checkpoints) (a newer shardwise may read it)"
            )
        if not sealed:
            fail("the checkpoint index is corrupt: its checksum (index_checksum) is missing")
        if b"\\u" in data and has_surrogate_escape(data):
            fail("the checkpoint index holds a lone surrogate, which is not text")
        return _decode(document, version)


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


def _decode(document: dict[str, Any], version: int) -> Index:
    """A parsed, sealed index of ``version``, every field checked (but grid cell packing)."""
    incremental = version == INCREMENTAL_VERSION
    ties = ("aliases",) if "aliases" in document else ()  # an index with ties, before the seal
    digests_key = ("digests",) if incremental else ()
    expected = (*_KEYS, "objects", *ties, *digests_key, "index_checksum")
    if tuple(document) != expected:
        fail(f"the checkpoint index must have exactly the keys {list(expected)} in order")
    facts = _save_facts(document["save"])
    block_size = _block_size(document["checksum"])

    files, names, starts, sums = _files(document["files"], block_size, incremental)
    properties = _properties(document["properties"])
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
        fqn, props, size, layout = _tensor_head(row, properties, tensors)
        itemsize = props.dtype.itemsize
        kind = layout[0] if type(layout) is list and layout else None
        chunks: Sequence[SavedChunk]
        if kind == "grid" and incremental:
            fail("an incremental index (version 5) lists chunks: it has no grid layouts", fqn)
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

    objects = _objects(document["objects"], tensors, names, ranges)
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
    digests = _digests(document["digests"], tensors) if incremental else {}
    aliases = _aliases(document["aliases"], tensors, objects) if "aliases" in document else {}
    return Index(
        version, block_size, files, tensors, objects, facts, aliases, starts, sums, digests
    )


def _files(
    rows: object, block_size: int, references: bool
) -> tuple[dict[str, int], list[str | None], dict[str, int], dict[str, str]]:
    """The ``files`` rows (``[name, size, data_start, block checksums]``, or ``null``): each
    file's size, each file number's name (``None`` for a null), data starts and checksums.
    With ``references`` (version 5), a name may be a sibling checkpoint's data file."""
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
        name = _file_name(name, files, references)
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
    name = _file_of(file, names, fqn)
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
    """A ``["whole", file, begin]`` layout's one chunk, its range added to ``ranges``. Hot path:
    :func:`_chunk`'s and :meth:`Ranges.add`'s checks inlined; a bad row runs them to raise."""
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


def _save_facts(save: object) -> SaveFacts:
    """The ``save`` object: writer, torch, world size, save id, checkpoint id."""
    if type(save) is not dict or tuple(save) != _SAVE_KEYS:
        fail(f"the checkpoint index's save facts must have the keys {list(_SAVE_KEYS)}")
    save_id = text_of(save["save_id"], "save_id")
    if _SAVE_ID.fullmatch(save_id) is None:
        fail(f"save_id must be 16 hex digits, got {save_id!r}")
    checkpoint_id = save["checkpoint_id"]
    if checkpoint_id is not None:
        text_of(checkpoint_id, "checkpoint_id")
    world_size = int_of(save["world_size"], "world_size")
    if world_size < 1:
        fail("world_size must be at least 1")
    return SaveFacts(
        text_of(save["writer"], "writer"),
        text_of(save["torch"], "torch"),
        world_size,
        save_id,
        checkpoint_id,
    )


def _block_size(checksum: object) -> int:
    """The ``checksum`` object's block size, bounded; its keys, algorithm and scope checked."""
    if type(checksum) is not dict or tuple(checksum) != _CHECKSUM_KEYS:
        fail(f"the checkpoint index's checksum must have the keys {', '.join(_CHECKSUM_KEYS)}")
    if checksum["algorithm"] != CHECKSUM_ALGORITHM:
        fail(
            f"unsupported checksum algorithm {checksum['algorithm']!r}; this shardwise uses "
            f"{CHECKSUM_ALGORITHM}"
        )
    block_size = int_of(checksum["block_size"], "block_size")
    if not MIN_BLOCK <= block_size <= MAX_BLOCK:
        fail(f"block_size {block_size} is outside [{MIN_BLOCK}, {MAX_BLOCK}]")
    if checksum["scope"] != "file":
        fail(f"unsupported checksum scope {checksum['scope']!r}; this version has 'file'")
    return block_size


def _file_name(name: object, files: Mapping[str, int], references: bool) -> str:
    """A data file's name: the writer's pattern (or, with ``references``, a sibling
    checkpoint's data file, ``../<checkpoint>/data/rank-*.safetensors``), not listed before."""
    name = text_of(name, "a data file name")
    own = name.startswith(f"{DATA_DIR}/") and is_data_file_name(name[len(DATA_DIR) + 1 :])
    if not own and not (references and parse_reference(name) is not None):
        also = (
            f", or ../<checkpoint>/data/rank-*.safetensors, <checkpoint> {PORTABLE_RULE}"
            if references
            else ""
        )
        fail(f"{name!r} is not a data file name of this format (data/rank-*.safetensors{also})")
    if name in files:
        fail(f"the data file {name!r} is listed twice")
    return name


def _properties(rows: object) -> list[TensorProperties]:
    """The ``properties`` table: known dtype, layout and memory-format names, two booleans."""
    if type(rows) is not list:
        fail("properties must be a list")
    table = []
    for row in rows:
        dtype, layout, requires_grad, memory_format, pin_memory = row_of(
            row, 5, "a properties entry"
        )
        if (
            not isinstance(dtype, str)
            or dtype not in DTYPES
            or not isinstance(layout, str)
            or layout not in LAYOUTS
            or not isinstance(memory_format, str)
            or memory_format not in MEMORY_FORMATS
            or type(requires_grad) is not bool
            or type(pin_memory) is not bool
        ):
            fail(f"malformed or unknown tensor properties {row!r}")
        table.append(
            TensorProperties(
                dtype=DTYPES[dtype],
                layout=LAYOUTS[layout],
                requires_grad=requires_grad,
                memory_format=MEMORY_FORMATS[memory_format],
                pin_memory=pin_memory,
            )
        )
    return table


def _tensor_head(
    row: object, properties: list[TensorProperties], seen: Mapping[str, object]
) -> tuple[str, TensorProperties, tuple[int, ...], Any]:
    """A ``tensors`` row's new key, properties and size, checked, and its raw layout (hot path)."""
    if type(row) is list and len(row) == 4:
        fqn, number, size_row, last = row
    else:
        fqn, number, size_row, last = row_of(row, 4, "a tensors entry")  # raises
    if type(fqn) is not str:
        fail(f"a key must be a string, got {type(fqn).__name__}")
    if "\x00" in fqn:
        check_int_suffix(fqn)
    if fqn in seen:
        fail("the key appears twice", fqn)
    if type(number) is not int or not 0 <= number < len(properties):
        fail(f"property index {number!r} does not exist", fqn)
    props = properties[number]
    if props.dtype in QUANTIZED:
        fail(
            f"{props.dtype} is a quantized dtype, which a checkpoint cannot hold (its "
            "scale and zero point are not stored)",
            fqn,
        )
    if type(size_row) is not list or len(size_row) > MAX_DIMS:
        dims_of(size_row, "size", fqn)  # raises, naming the fault
    for dim in size_row:  # dims_of written out
        if type(dim) is not int or not 0 <= dim < MAX_INT:
            dims_of(size_row, "size", fqn)
    if not creatable(size_row, props.dtype.itemsize):
        fail(f"the size {size_row} is too large: no tensor of {props.dtype} has it", fqn)
    return fqn, props, tuple(size_row), last


def _file_of(number: object, names: Sequence[str | None], key: str) -> str:
    """The name of file ``number`` of the index, which must exist and hold something."""
    if type(number) is not int or not 0 <= number < len(names):
        fail(f"file index {number!r} does not exist", key)
    name = names[number]
    if name is None:
        fail(f"file index {number} names a rank that wrote no data file (null)", key)
    return name


def _objects(
    rows: object, tensors: dict[str, TensorRecord], names: Sequence[str | None], ranges: Ranges
) -> dict[str, ObjectRecord]:
    """The ``objects`` rows: JSON text, or a blob ``[file, begin, nbytes]``."""
    objects: dict[str, ObjectRecord] = {}
    if type(rows) is not list:
        fail("objects must be a list")
    for row in rows:
        fqn, encoding, payload = row_of(row, 3, "an objects entry")
        fqn = text_of(fqn, "a key")
        if "\x00" in fqn:
            check_int_suffix(fqn)
        if fqn in tensors or fqn in objects:
            fail("the key appears twice", fqn)
        if encoding not in ENCODINGS:
            fail(f"unknown object encoding {encoding!r}", fqn)
        if encoding in TEXT_ENCODINGS:
            objects[fqn] = ObjectRecord(fqn, encoding, text=text_of(payload, "a JSON value", fqn))
            continue
        file, begin, nbytes = row_of(payload, 3, "a stored object", fqn)
        name = _file_of(file, names, fqn)
        begin, nbytes = int_of(begin, "begin", fqn), int_of(nbytes, "nbytes", fqn)
        if begin + nbytes >= MAX_INT:
            fail("malformed stored object", fqn)
        blob = SavedChunk((), (), name, begin, begin + nbytes)
        ranges.add(blob, fqn)
        objects[fqn] = ObjectRecord(fqn, encoding, blob=blob)
    return objects


def _digests(rows: object, tensors: Mapping[str, TensorRecord]) -> dict[str, str]:
    """The ``digests`` list (version 5): per ``tensors`` row, in order, the xxh3_128 of each of
    its chunks as 32 lowercase hex digits, concatenated."""
    if type(rows) is not list or len(rows) != len(tensors):
        fail("digests must be a list of one string per tensors entry")
    digests: dict[str, str] = {}
    for (fqn, record), row in zip(tensors.items(), rows, strict=True):
        text = text_of(row, "the chunk digests", fqn)
        if len(text) != DIGEST_HEX * len(record.chunks) or HEX_DIGITS.fullmatch(text) is None:
            fail(
                f"malformed chunk digests (expected {len(record.chunks)} of {DIGEST_HEX} "
                "lowercase hex digits)",
                fqn,
            )
        digests[fqn] = text
    return digests


def _aliases(
    rows: object, tensors: dict[str, TensorRecord], objects: dict[str, ObjectRecord]
) -> dict[str, str]:
    """The validated ``aliases``: each alias a new key, added to ``tensors`` with the record of
    its target, a saved tensor (called once byte ranges are checked: the two share bytes)."""
    if type(rows) is not list or not rows:
        fail("aliases must be a non-empty list (an index without ties has no aliases key)")
    aliases: dict[str, str] = {}
    for row in rows:
        alias, target = row_of(row, 2, "an aliases entry")
        alias = text_of(alias, "a key")
        target = text_of(target, "a key", alias)
        if "\x00" in alias:
            check_int_suffix(alias)
        if alias in tensors or alias in objects or alias in aliases:
            fail("the key appears twice", alias)
        if target not in tensors:
            fail(f"it is tied to {target!r}, which is not a saved tensor", alias)
        aliases[alias] = target
    for alias, target in aliases.items():
        record = tensors[target]
        tensors[alias] = TensorRecord(alias, record.properties, record.size, record.chunks)
    return aliases
