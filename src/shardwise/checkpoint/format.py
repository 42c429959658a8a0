"""The on-disk format of checkpoint data files: safetensors files (see ``docs/format.md``).

A data file is ``<8-byte little-endian header length><JSON header><data>``. The header maps
each entry key to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
start of the data section) and carries ``__metadata__``. The header is padded with spaces so
the data section starts on a 64-byte boundary; entries are packed without holes, as the
safetensors reader requires. Entry keys are ``<fqn>@<offsets joined by ",">`` for tensor
chunks and ``<fqn>@bytes`` for byte blobs.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ALIGNMENT",
    "FileEntry",
    "FileLayout",
    "bytes_key",
    "chunk_key",
    "layout_file",
    "safetensors_dtype",
]

#: The data section of every data file starts at a multiple of this many bytes.
ALIGNMENT = 64

# safetensors' dtype codes. Dtypes it has no code for are stored as raw bytes ("U8"); the
# index records the real dtype, so shardwise reads them back exactly.
_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


def safetensors_dtype(dtype: torch.dtype) -> str | None:
    """The safetensors code of ``dtype``, or ``None`` when it has none (stored as bytes)."""
    return _SAFETENSORS_DTYPES.get(dtype)


def chunk_key(fqn: str, offsets: Sequence[int]) -> str:
    """The data-file entry key of the chunk of ``fqn`` at ``offsets``."""
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def bytes_key(fqn: str) -> str:
    """The data-file entry key of the byte blob of ``fqn``."""
    return f"{fqn}@bytes"


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One entry to write: its key, dtype, shape and size in bytes."""

    key: str
    dtype: torch.dtype | None  # None: raw bytes
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class FileLayout:
    """Where every entry of a data file lands.

    Attributes:
        header: The complete header bytes (length prefix included), padded for alignment.
        ranges: Per entry, absolute ``(begin, end)`` byte offsets in the file.
        size: The total file size.
    """

    header: bytes
    ranges: tuple[tuple[int, int], ...]
    size: int


def layout_file(entries: Sequence[FileEntry], metadata: dict[str, str]) -> FileLayout:
    """Lay out a safetensors file holding ``entries`` in the given order."""
    header: dict[str, object] = {"__metadata__": metadata}
    position = 0
    relative = []
    for entry in entries:
        code = None if entry.dtype is None else safetensors_dtype(entry.dtype)
        shape: list[int] = list(entry.shape) if code is not None else [entry.nbytes]
        header[entry.key] = {
            "dtype": code or "U8",
            "shape": shape,
            "data_offsets": [position, position + entry.nbytes],
        }
        relative.append((position, position + entry.nbytes))
        position += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    padding = (-(8 + len(text))) % ALIGNMENT
    text += b" " * padding
    start = 8 + len(text)
    return FileLayout(
        header=struct.pack("<Q", len(text)) + text,
        ranges=tuple((start + begin, start + end) for begin, end in relative),
        size=start + position,
    )
