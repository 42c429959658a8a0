"""What DCP's metadata states (storage ranges, tensor chunks), checked before anything is read."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardwise.checkpoint.dcp_import._unpickle import (
    DCPChunk,
    DCPIndex,
    DCPMetadata,
    DCPProperties,
    DCPStorageInfo,
    DCPTensorEntry,
)
from shardwise.checkpoint.index.names import MAX_INT, PORTABLE_RULE, creatable, is_portable_name
from shardwise.errors import DCPImportError
from shardwise.metadata import ShardMetadata
from shardwise.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)

__all__ = ["DCPRange", "DCPTensorPlan", "dcp_storage", "error", "plan_tensor"]

# Bound of every offset, length and size: no file or tensor comes close, and sums of a few of
# them stay far from any C integer limit.
# Bound of a tensor's dims (no real tensor comes close): a chunk's work grows with them.
_MAX_DIMS = 1024

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def shown(value: object) -> str:
    """A short repr of a value from the metadata, however large or deep."""
    return _REPR.repr(tuple(value) if isinstance(value, torch.Size) else value)


def _relative_path_problem(path: str) -> str | None:
    """Why ``path`` is not a relative path of portable components (DCP writes
    ``__0_0.distcp``; ``index.names.is_portable_name``), or None."""
    if not path:
        return "it is empty"
    if "\0" in path:
        return "it contains a NUL character"
    if path.startswith("/"):
        return "it is absolute"
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "it has an empty, '.' or '..' component"
    odd = next((part for part in parts if not is_portable_name(part)), None)
    if odd is not None:
        return f"its component {odd!r} is not a portable file name ({PORTABLE_RULE})"
    return None


def error(fqn: str, message: str, file: str) -> DCPImportError:
    """The error about the value of ``fqn``: ``'key': message``."""
    return DCPImportError(f"{fqn!r}: {message}", file=file)


def _bounded_ints(value: object) -> tuple[int, ...] | None:
    """``value`` as a tuple of ints in ``[0, MAX_INT)`` (bools are not ints here), or None."""
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMS:
        return None
    if not all(type(v) is int and 0 <= v < MAX_INT for v in value):
        return None
    return tuple(value)


def _bounded_int(value: object) -> bool:
    return type(value) is int and 0 <= value < MAX_INT


@dataclass(frozen=True, slots=True)
class DCPRange:
    """Where DCP stored one item: ``length`` bytes at ``offset`` of ``file`` (a checked path)."""

    fqn: str
    file: str
    offset: int
    length: int


StorageKey = tuple[str, tuple[int, ...] | None]


def dcp_storage(metadata: DCPMetadata, metadata_path: str) -> dict[StorageKey, DCPRange]:
    storage = metadata.get("storage_data")
    if not isinstance(storage, dict):
        raise DCPImportError(
            "malformed DCP metadata: storage_data is not a dict", file=metadata_path
        )
    ranges = {}
    for key, info in storage.items():
        if not isinstance(key, DCPIndex) or not isinstance(info, DCPStorageInfo):
            raise DCPImportError(
                "this DCP checkpoint was not written by FileSystemWriter (unknown storage_data)",
                file=metadata_path,
            )
        fqn, offset = key.get("fqn"), key.get("offset")
        if not isinstance(fqn, str):
            raise DCPImportError(
                f"malformed DCP metadata: a storage key fqn is {shown(fqn)}", file=metadata_path
            )
        transforms = info.get("transform_descriptors")
        if transforms:
            raise error(
                fqn,
                f"its storage uses transforms {shown(transforms)} (e.g. compression), which "
                "convert-dcp does not support",
                metadata_path,
            )
        file, start, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if not isinstance(file, str) or not _bounded_int(start) or not _bounded_int(length):
            raise error(
                fqn,
                f"malformed DCP metadata: its storage is at relative_path {shown(file)}, "
                f"offset {shown(start)}, length {shown(length)} (expected a path and "
                f"integers in [0, 2**62))",
                metadata_path,
            )
        problem = _relative_path_problem(file)
        if problem is not None:
            raise error(
                fqn,
                f"its storage path {file!r} is not a plain path inside the checkpoint "
                f"directory: {problem}",
                metadata_path,
            )
        index = None if offset is None else _bounded_ints(offset)
        if offset is not None and index is None:
            raise error(
                fqn, f"malformed DCP metadata: a storage offset is {shown(offset)}", metadata_path
            )
        ranges[(fqn, index)] = DCPRange(fqn, file, start, length)
    return ranges


@dataclass(frozen=True, slots=True)
class DCPChunkPlan:
    """A non-empty chunk of a tensor and where its payload is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    where: DCPRange


@dataclass(frozen=True, slots=True)
class DCPTensorPlan:
    """A tensor entry, checked: its chunks tile it, and each chunk's bytes fit in its range."""

    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[DCPChunkPlan, ...]
    requires_grad: bool


def plan_tensor(
    fqn: str, entry: DCPTensorEntry, ranges: Mapping[StorageKey, DCPRange], metadata_path: str
) -> DCPTensorPlan:
    def malformed(what: str) -> DCPImportError:
        return error(fqn, f"malformed DCP metadata: {what}", metadata_path)

    properties = entry.get("properties")
    dtype = properties.get("dtype") if isinstance(properties, DCPProperties) else None
    if not isinstance(dtype, torch.dtype):
        raise malformed("it has no dtype")
    size = _bounded_ints(entry.get("size"))
    if size is None:
        raise malformed(
            f"its size is {shown(entry.get('size'))} (expected at most {_MAX_DIMS} integers "
            "in [0, 2**62))"
        )
    if not creatable(size, dtype.itemsize):
        raise malformed(f"its size {list(size)} is too large: no tensor of {dtype} has it")
    chunks = entry.get("chunks")
    if not isinstance(chunks, list) or not all(isinstance(c, DCPChunk) for c in chunks):
        raise malformed(f"its chunks are {shown(chunks)}")
    planned = []
    for chunk in chunks:
        offsets, sizes = _bounded_ints(chunk.get("offsets")), _bounded_ints(chunk.get("sizes"))
        if offsets is None or sizes is None or not len(offsets) == len(sizes) == len(size):
            raise malformed(
                f"a chunk has offsets {shown(chunk.get('offsets'))} and sizes "
                f"{shown(chunk.get('sizes'))} (expected {len(size)} integers in [0, 2**62) each)"
            )
        if math.prod(sizes) == 0:
            continue  # holds no elements: nothing to place, nothing to read
        where = ranges.get((fqn, offsets))
        if where is None:
            raise error(fqn, f"no storage for the chunk at offsets {list(offsets)}", metadata_path)
        nbytes = math.prod(sizes) * dtype.itemsize
        if nbytes > where.length:
            raise error(
                fqn,
                f"the chunk at offsets {list(offsets)} holds {nbytes} bytes of {dtype}, more "
                f"than its {where.length}-byte storage range",
                metadata_path,
            )
        planned.append(DCPChunkPlan(offsets, sizes, where))
    _check_tiling(fqn, size, planned, metadata_path)
    requires_grad = properties.get("requires_grad") is True
    return DCPTensorPlan(dtype, size, tuple(planned), requires_grad)


def _check_tiling(
    fqn: str, size: tuple[int, ...], chunks: list[DCPChunkPlan], metadata_path: str
) -> None:
    """Check that the non-empty chunks tile a tensor of ``size``: inside it, covering it, no two
    sharing an element (counting elements is not enough: an overlap leaves a gap uninitialized)."""
    if not chunks:
        if math.prod(size) == 0:
            return
        raise error(fqn, f"its DCP chunks hold no elements of its size {list(size)}", metadata_path)
    boxes = [ShardMetadata(list(chunk.offsets), list(chunk.sizes)) for chunk in chunks]
    try:
        validate_non_overlapping_shards_metadata(boxes)
        check_tensor(boxes, list(size))
    except ValueError as err:
        raise error(
            fqn, f"its DCP chunks do not tile its size {list(size)}: {err}", metadata_path
        ) from err
