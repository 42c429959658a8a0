"""What the commands share: exit codes, output and progress helpers, and a reader of committed
shardwise checkpoints that checks every byte it returns against the index's checksums."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from shardwise.checkpoint import (
    BytesStorageMetadata,
    CheckpointDataError,
    CheckpointFormatError,
    ChecksumError,
    TensorStorageMetadata,
    read_metadata,
)
from shardwise.checkpoint.metadata import MetadataIndex
from shardwise.checkpoint.storage import Storage, open_storage

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2

# How many keys a problem line names before it says "and N more".
_MAX_NAMED_KEYS = 5


def _progress(total: int, description: str, unit: str = "B") -> Any:
    """A tqdm bar on stderr, shown only when stderr is a terminal."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        desc=description,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )


def _human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _count(number: int, noun: str, plural: str | None = None) -> str:
    """``"1 tensor"``, ``"2 tensors"``, ``"2 entries"`` (with ``plural="entries"``)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _keys_text(keys: Sequence[str]) -> str:
    named = ", ".join(repr(key) for key in keys[:_MAX_NAMED_KEYS])
    rest = len(keys) - _MAX_NAMED_KEYS
    return f"{named} and {rest} more" if rest > 0 else named


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class _Stored:
    """Where one tensor chunk or object blob lives, as the index records it."""

    fqn: str
    file: str
    begin: int
    end: int
    checksum: str
    offsets: tuple[int, ...] | None  # None for an object blob
    sizes: tuple[int, ...] | None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def describe(self) -> str:
        where = "object" if self.offsets is None else f"chunk at offsets {list(self.offsets)}"
        return f"key {self.fqn!r} {where} in {self.file}"


def _stored(
    fqn: str,
    info: object,
    offsets: tuple[int, ...] | None = None,
    sizes: tuple[int, ...] | None = None,
) -> _Stored:
    """The storage info ``info`` of ``fqn``, checked for the fields and types it needs."""
    if not isinstance(info, Mapping):
        raise CheckpointFormatError("the index has no storage info for it", key=fqn)
    file, begin, end, checksum = (info.get(name) for name in ("file", "begin", "end", "checksum"))
    if (
        not isinstance(file, str)
        or type(begin) is not int
        or type(end) is not int
        or not isinstance(checksum, str)
        or not 0 <= begin <= end
    ):
        raise CheckpointFormatError(
            f"malformed storage info {dict(info)!r}: expected file, begin <= end and checksum",
            key=fqn,
        )
    return _Stored(fqn, file, begin, end, checksum, offsets, sizes)


class _Checkpoint:
    """A committed shardwise checkpoint opened for reading (index parsed once)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.storage: Storage = open_storage(path)
        self.metadata = read_metadata(path)
        self.checksum_algorithm = (self.metadata.planner_data or {}).get("checksum_algorithm")
        data = self.metadata.storage_data
        self._infos: Mapping[MetadataIndex, Any] = data if isinstance(data, Mapping) else {}
        self._file_sizes: dict[str, int] = {}

    @property
    def entries(self) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
        return self.metadata.state_dict_metadata

    def kind(self, fqn: str) -> str:
        """``"tensor"``, or the encoding of an object (``json``, ``bytes``, ...)."""
        if isinstance(self.entries[fqn], TensorStorageMetadata):
            return "tensor"
        info = self._infos.get(MetadataIndex(fqn))
        encoding = info.get("encoding") if isinstance(info, Mapping) else None
        return encoding if isinstance(encoding, str) else "object"

    def chunks(self, fqn: str) -> list[_Stored]:
        entry = self.entries[fqn]
        assert isinstance(entry, TensorStorageMetadata)
        return [
            _stored(
                fqn,
                self._infos.get(MetadataIndex(fqn, chunk.offsets)),
                tuple(chunk.offsets),
                tuple(chunk.sizes),
            )
            for chunk in entry.chunks
        ]

    def object_info(self, fqn: str) -> Mapping[str, Any]:
        info = self._infos.get(MetadataIndex(fqn))
        if not isinstance(info, Mapping) or not isinstance(info.get("encoding"), str):
            raise CheckpointFormatError("the index has no storage info for it", key=fqn)
        return info

    def object_blob(self, fqn: str) -> _Stored | None:
        """Where the object ``fqn`` is stored; None for a JSON value kept in the index."""
        info = self.object_info(fqn)
        if info["encoding"] == "json":
            if not isinstance(info.get("text"), str):
                raise CheckpointFormatError("a JSON entry without its text", key=fqn)
            return None
        return _stored(fqn, info)

    def file_path(self, name: str) -> str:
        return self.storage.join(*name.split("/"))

    def file_size(self, name: str) -> int | None:
        """Size of data file ``name``, or None when it is missing."""
        if name not in self._file_sizes:
            path = self.file_path(name)
            if not self.storage.exists(path):
                return None
            self._file_sizes[name] = self.storage.size(path)
        return self._file_sizes[name]

    def read_into(self, item: _Stored, buffer: memoryview) -> None:
        """Read ``item``'s bytes into ``buffer`` and check their checksum."""
        path = self.file_path(item.file)
        size = self.file_size(item.file)
        if size is None:
            raise CheckpointDataError("data file is missing", key=item.fqn, file=path)
        if item.end > size:
            raise CheckpointDataError(
                f"data file is truncated: it has {size} bytes, the index says it holds bytes "
                f"up to {item.end}",
                key=item.fqn,
                file=path,
            )
        count = self.storage.read_into(path, item.begin, buffer)
        if count != item.nbytes:
            raise CheckpointDataError(
                f"data file is truncated: read {count} of {item.nbytes} bytes",
                key=item.fqn,
                file=path,
            )
        actual = xxhash.xxh3_64_hexdigest(buffer)
        if actual != item.checksum:
            raise ChecksumError(
                f"checksum mismatch: expected {item.checksum}, got {actual}",
                key=item.fqn,
                file=path,
            )

    def tensor(self, fqn: str) -> torch.Tensor:
        """The whole tensor ``fqn`` as one CPU tensor, every chunk checksum verified."""
        entry = self.entries[fqn]
        assert isinstance(entry, TensorStorageMetadata)
        dtype = entry.properties.dtype
        result = torch.empty(tuple(entry.size), dtype=dtype)
        itemsize = result.element_size()
        covered = 0
        for item in self.chunks(fqn):
            assert item.offsets is not None and item.sizes is not None
            count = math.prod(item.sizes)
            if count == 0:
                continue
            if item.nbytes != count * itemsize:
                raise CheckpointFormatError(
                    f"the chunk at offsets {list(item.offsets)} has {item.nbytes} bytes stored, "
                    f"{count * itemsize} expected",
                    key=fqn,
                )
            raw = torch.empty(item.nbytes, dtype=torch.uint8)
            self.read_into(item, _byte_view(raw))
            region = result
            for dim, (offset, length) in enumerate(zip(item.offsets, item.sizes, strict=True)):
                region = region.narrow(dim, offset, length)
            region.copy_(raw.view(dtype).view(item.sizes))
            covered += count
        if covered != result.numel():
            raise CheckpointFormatError(
                f"the saved chunks cover {covered} of the tensor's {result.numel()} elements",
                key=fqn,
            )
        return result

    def object_payload(self, fqn: str) -> bytes:
        """The stored bytes of object ``fqn`` (the JSON text for a JSON value); never decoded,
        so a pickled entry is compared, not run."""
        item = self.object_blob(fqn)
        if item is None:
            return str(self.object_info(fqn)["text"]).encode()
        data = bytearray(item.nbytes)
        self.read_into(item, memoryview(data))
        return bytes(data)


def _open_checkpoint(path: str) -> _Checkpoint:
    # read_metadata refuses indexes whose checksum algorithm is not the xxh3_64 used here.
    return _Checkpoint(path)
