"""Version 1 of the index (the first release): one JSON object per chunk and one checksum per
chunk, read through :class:`~shardwise.checkpoint.metadata.Metadata` and held to the same
rules as the later versions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise.checkpoint.index.checks import (
    Ranges,
    check_checksums,
    check_text,
    checked_tensor,
    fail,
    int_of,
    is_int,
    text_of,
)
from shardwise.checkpoint.index.names import (
    CHECKSUM_ALGORITHM,
    DATA_DIR,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_INT,
    is_data_file_name,
)
from shardwise.checkpoint.index.records import Index, ObjectRecord, TensorRecord
from shardwise.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from shardwise.checkpoint.planner import SavedChunk
from shardwise.errors import CheckpointFormatError
from shardwise.metadata import TensorProperties

__all__ = ["decode_v1"]

# The fields of a chunk's and of a blob's storage info, sorted.
_V1_CHUNK_INFO = ("begin", "checksum", "end", "file")
# Version 1 kept JSON values as text and bytes, BytesIO and pickles as blobs (tagged JSON came
# with version 2).
_V1_ENCODINGS = ("json", "bytes", "bytesio", "pickle")
_V1_BLOB_INFO = ("begin", "checksum", "encoding", "end", "file")


def _check_tree(document: object) -> None:
    """Every string of a parsed version-1 index is text, every integer lies in [0, 2**62),
    and nothing is nested deeper than 64 levels (version 2 has no free-form fields: it is
    checked field by field)."""
    stack = [(document, 1)]
    while stack:
        item, depth = stack.pop()
        if type(item) is str:
            check_text(item, "a string of the checkpoint index")
        elif type(item) is int and not 0 <= item < MAX_INT:
            fail("the checkpoint index holds an integer outside [0, 2**62)")
        elif type(item) is list or type(item) is dict:
            if depth > MAX_DEPTH:
                fail(f"the checkpoint index is nested deeper than {MAX_DEPTH} levels")
            if type(item) is dict:
                stack.extend((key, depth) for key in item)
                item = item.values()
            stack.extend((child, depth + 1) for child in item)


def decode_v1(document: dict[str, Any]) -> Index:
    """A version-1 index (one JSON object per chunk, one checksum per chunk), held to the
    same rules as version 2; file sizes are checked when the files are opened."""
    _check_tree(document)
    try:
        metadata = Metadata.from_dict(document)
    except CheckpointFormatError:
        raise
    # The version-1 reader predates hostile-input checks; anything it trips on is malformed.
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, IndexError) as err:
        fail(f"malformed checkpoint index: {type(err).__name__}: {err}")
    planner_data = metadata.planner_data
    algorithm = planner_data.get("checksum_algorithm") if type(planner_data) is dict else None
    if algorithm != CHECKSUM_ALGORITHM:
        fail(
            f"unsupported checksum algorithm {algorithm!r}; this shardwise uses "
            f"{CHECKSUM_ALGORITHM}"
        )
    infos: Mapping[MetadataIndex, Any] = metadata.storage_data or {}
    used: set[MetadataIndex] = set()
    files: dict[str, int | None] = {}

    def info_of(key: MetadataIndex) -> Any:
        used.add(key)
        return infos.get(key)

    def chunk_of(
        fqn: str,
        info: object,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        fields: tuple[str, ...] = _V1_CHUNK_INFO,
    ) -> SavedChunk:
        if type(info) is not dict:
            fail("the index has no storage info for a chunk", fqn)
        if tuple(sorted(info)) != fields:
            fail(f"malformed storage info {info!r}", fqn)
        name = text_of(info["file"], "a data file name", fqn)
        if not name.startswith(f"{DATA_DIR}/") or not is_data_file_name(name[5:]):
            fail(f"{name!r} is not a data file name of this format", fqn)
        begin, end = int_of(info["begin"], "begin", fqn), int_of(info["end"], "end", fqn)
        if end < begin:
            fail("a byte range ends before it begins", fqn)
        files.setdefault(name, None)
        return SavedChunk(offsets, sizes, name, begin, end, text_of(info["checksum"], "checksum"))

    tensors: dict[str, TensorRecord] = {}
    objects: dict[str, ObjectRecord] = {}
    pending: list[tuple[str, TensorProperties, tuple[int, ...], list[SavedChunk]]] = []
    for fqn, entry in metadata.state_dict_metadata.items():
        if "\x00" in fqn:  # version 1 had no int parts: a NUL is malformed there
            fail("malformed key: version 1 keys hold no NUL", fqn)
        if isinstance(entry, TensorStorageMetadata):
            size = tuple(entry.size)
            if len(size) > MAX_DIMS or not all(is_int(v) for v in size):
                fail("size out of bounds", fqn)
            chunks = []
            for chunk in entry.chunks:
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                if not all(is_int(v) for v in offsets + sizes):
                    fail("chunk offsets or sizes out of bounds", fqn)
                info = info_of(MetadataIndex(fqn, chunk.offsets))
                chunks.append(chunk_of(fqn, info, offsets, sizes))
            pending.append((fqn, entry.properties, size, chunks))
            continue
        info = info_of(MetadataIndex(fqn))
        if type(info) is not dict or info.get("encoding") not in _V1_ENCODINGS:
            fail("the index has no valid storage info for it", fqn)
        encoding = info["encoding"]
        if encoding == "json":
            if tuple(sorted(info)) != ("encoding", "text"):
                fail(f"malformed storage info {info!r}", fqn)
            objects[fqn] = ObjectRecord(
                fqn, encoding, text=text_of(info["text"], "a JSON value", fqn)
            )
        else:
            blob = chunk_of(fqn, info, (), (), _V1_BLOB_INFO)
            objects[fqn] = ObjectRecord(fqn, encoding, blob=blob)
    if len(used) != len(infos):
        fail("the checkpoint index holds storage info for a key or chunk it does not have")
    ranges = Ranges(files)
    for fqn, properties, size, chunks in pending:
        tensors[fqn] = checked_tensor(fqn, properties, size, chunks, None, ranges)
    for fqn, item in objects.items():
        if item.blob is not None:
            check_checksums(item.blob, None, fqn)
            ranges.add(item.blob, fqn)
    ranges.check()
    return Index(1, None, files, tensors, objects, legacy=metadata)
