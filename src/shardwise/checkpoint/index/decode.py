"""The strict decoder: :func:`decode_index` reads every version (1 to 4) and trusts nothing.

It checks the seal first, then every type, name, number, tiling and byte range, and returns
records; every failure is a :class:`~shardwise.errors.CheckpointFormatError` naming the key.
Only what needs the files themselves (their real size, their type) is left to the reader.
Version 2 and 3 rows are decoded here, version 4 layouts in :mod:`.v4`, version 1 in
:mod:`.legacy`.
"""

from __future__ import annotations

import math
from typing import Any

import xxhash

from shardwise.checkpoint.index.checks import (
    Ranges,
    check_chunks_tile,
    dims_of,
    fail,
    has_surrogate_escape,
    int_of,
    parse_json,
    row_of,
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
)
from shardwise.checkpoint.index.legacy import decode_v1
from shardwise.checkpoint.index.names import (
    ALIASES_VERSION,
    FORMAT,
    FORMAT_VERSION,
    HEX,
    LAYOUT_VERSION,
    MAX_DIMS,
    MAX_INDEX_BYTES,
    MAX_INT,
    SEAL_KEY,
    SEAL_LENGTH,
    paused_gc,
)
from shardwise.checkpoint.index.records import Index, TensorRecord
from shardwise.checkpoint.index.v4 import decode_v4
from shardwise.checkpoint.planner import SavedChunk

__all__ = ["decode_index"]


def decode_index(data: bytes) -> Index:
    """Read and validate a checkpoint index of format version 1 to 4.

    Raises:
        CheckpointFormatError: The index is corrupt (its seal does not match), malformed, of
            an unknown version, or describes chunks, names or byte ranges that cannot be
            right (see ``docs/format.md``, *Validation*).
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
        return _decode(data, sealed)


def _decode(data: bytes, sealed: bool) -> Index:
    document = parse_json(data, "the checkpoint index")
    if type(document) is not dict:
        fail(f"a checkpoint index must be a JSON object, got {type(document).__name__}")
    if document.get("format") != FORMAT:
        fail(
            f"not a shardwise checkpoint index: format is {document.get('format')!r}, "
            f"expected {FORMAT!r}"
        )
    version = document.get("format_version")
    if type(version) is int and version in (FORMAT_VERSION, ALIASES_VERSION, LAYOUT_VERSION):
        if not sealed:
            fail("the checkpoint index is corrupt: its checksum (index_checksum) is missing")
        if b"\\u" in data and has_surrogate_escape(data):
            fail("the checkpoint index holds a lone surrogate, which is not text")
        if version == LAYOUT_VERSION:
            return decode_v4(document)
        return _decode_v2(document, version)
    if type(version) is int and version == 1:
        return decode_v1(document)
    fail(
        f"unsupported checkpoint format version {version!r}; this shardwise reads versions 1, "
        f"{FORMAT_VERSION}, {ALIASES_VERSION} and {LAYOUT_VERSION} (a newer shardwise may "
        "read it)"
    )


def _decode_v2(document: dict[str, Any], version: int) -> Index:
    expected = expected_keys(with_aliases=version == ALIASES_VERSION)
    if tuple(document) != expected:
        fail(
            f"the checkpoint index of version {version} must have exactly the keys "
            f"{list(expected)} in order"
        )
    facts = decode_save_facts(document["save"])
    block_size = decode_checksum(document["checksum"], ("algorithm", "block_size"))["block_size"]

    file_rows = document["files"]
    if type(file_rows) is not list:
        fail("files must be a list")
    files: dict[str, int | None] = {}
    names: list[str] = []
    for row in file_rows:
        name, size = row_of(row, 2, "a files entry")
        name = decode_file_name(name, files)
        files[name] = int_of(size, f"the size of {name}")
        names.append(name)
    properties = decode_properties(document["properties"])

    ranges = Ranges(files)
    tensors: dict[str, TensorRecord] = {}
    rows = document["tensors"]
    if type(rows) is not list:
        fail("tensors must be a list")
    for row in rows:
        fqn, props, size, chunk_rows = decode_tensor_head(row, properties, tensors)
        itemsize = props.dtype.itemsize
        if type(chunk_rows) is not list:
            fail("chunks must be a list", fqn)
        chunks = _plain_chunks(chunk_rows, names, itemsize, block_size)
        if chunks is None:  # a row is not as the writer writes it: find and name the fault
            chunks = _chunks_one_by_one(fqn, chunk_rows, names, itemsize, block_size, ranges)
        else:
            ranges.add_all(chunks, fqn)
        check_chunks_tile(fqn, size, chunks)
        tensors[fqn] = TensorRecord(fqn, props, size, tuple(chunks))

    objects = decode_objects(
        document["objects"], tensors, names, block_size, ranges, with_checksums=True
    )
    ranges.check()
    aliases = {}
    if version == ALIASES_VERSION:
        aliases = decode_aliases(document["aliases"], tensors, objects)
    return Index(version, block_size, files, tensors, objects, save=facts, aliases=aliases)


def _plain_chunks(
    rows: list[Any], names: list[str], itemsize: int, block_size: int
) -> list[SavedChunk] | None:
    """The chunks of a tensor's ``rows`` when every row is well formed, else ``None`` (and
    :func:`_chunks_one_by_one` finds the first fault and words it).

    The hottest loop of a reader, once per chunk of the checkpoint: it makes every check of
    :func:`_chunks_one_by_one` but its byte ranges (left to the caller, in the same order),
    written out without a call per field, and without side effects, so that failing here
    changes nothing."""
    chunks = []
    num_files = len(names)
    for row in rows:
        if type(row) is not list or len(row) != 5:
            return None
        offsets, sizes, file, begin, sums = row
        if (
            type(file) is not int
            or type(begin) is not int
            or type(offsets) is not list
            or type(sizes) is not list
            or type(sums) is not str
            or not 0 <= file < num_files
            or not 0 <= begin < MAX_INT
            or len(offsets) > MAX_DIMS
            or len(sizes) > MAX_DIMS
        ):
            return None
        for value in offsets:
            if type(value) is not int or not 0 <= value < MAX_INT:
                return None
        for value in sizes:
            if type(value) is not int or not 0 <= value < MAX_INT:
                return None
        nbytes = math.prod(sizes) * itemsize
        end = begin + nbytes
        blocks = 1 if nbytes <= block_size else -(-nbytes // block_size)
        if end >= MAX_INT or len(sums) != blocks * HEX:
            return None
        chunks.append(SavedChunk(tuple(offsets), tuple(sizes), names[file], begin, end, sums))
    return chunks


def _chunks_one_by_one(
    fqn: str,
    rows: list[Any],
    names: list[str],
    itemsize: int,
    block_size: int,
    ranges: Ranges,
) -> list[SavedChunk]:
    """The chunks of a tensor's ``rows``, each row checked field by field and its byte range
    added to ``ranges`` in turn: the first fault raises, naming what is wrong."""
    chunks = []
    for row in rows:
        offsets, sizes, file, begin, sums = row_of(row, 5, "a chunk", fqn)
        if type(file) is not int or not 0 <= file < len(names):
            fail(f"file index {file!r} does not exist", fqn)
        begin = int_of(begin, "begin", fqn)
        offsets = dims_of(offsets, "chunk offsets", fqn)
        sizes = dims_of(sizes, "chunk sizes", fqn)
        nbytes = math.prod(sizes) * itemsize
        end = begin + nbytes
        if type(sums) is not str or end >= MAX_INT:
            fail("malformed chunk", fqn)
        if len(sums) != max(1, -(-nbytes // block_size)) * HEX:
            fail("malformed block checksums (one of 16 hex digits per block expected)", fqn)
        chunk = SavedChunk(offsets, sizes, names[file], begin, end, sums)
        ranges.add(chunk, fqn)
        chunks.append(chunk)
    return chunks
