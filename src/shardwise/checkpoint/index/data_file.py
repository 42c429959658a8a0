"""The on-disk format of checkpoint data files: safetensors files (``docs/format.md``, *Data
files*). Readers take byte ranges from the index, never from a header; :func:`parse_header`
and :func:`compare_header` let ``shardwise verify`` check every header against the index."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from shardwise._codec import strict_json
from shardwise.checkpoint.entries.pyjson import compact
from shardwise.checkpoint.index.names import MAX_DIMS, MAX_INT, creatable

__all__ = [
    "ALIGNMENT",
    "FileEntry",
    "HeaderEntry",
    "bytes_key",
    "chunk_key",
    "compare_header",
    "header_entry",
    "header_length",
    "layout_file",
    "parse_header",
    "safetensors_dtype",
    "torch_dtype",
]

#: The data section of every data file starts at a multiple of this many bytes.
ALIGNMENT = 64
#: The largest header safetensors reads (its own limit, 100 MB).
MAX_HEADER_BYTES = 100_000_000

# safetensors' dtype codes; any other dtype is stored as raw bytes ("U8"), the index has it.
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
_CODE_DTYPES = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}
_CODE_SIZES = {code: dtype.itemsize for dtype, code in _SAFETENSORS_DTYPES.items()}
_LENGTH_BYTES = 8
_METADATA_KEY = "__metadata__"
_ENTRY_FIELDS = ("data_offsets", "dtype", "shape")
_ORIGIN_SUFFIXES: dict[int, str] = {}  # chunk_key's suffix of an origin, by number of dims


def safetensors_dtype(dtype: torch.dtype) -> str | None:
    """The safetensors code of ``dtype``, or ``None`` when it has none (stored as bytes)."""
    return _SAFETENSORS_DTYPES.get(dtype)


def torch_dtype(code: str) -> torch.dtype:
    """The dtype of safetensors code ``code`` (one :func:`parse_header` accepts)."""
    return _CODE_DTYPES[code]


def chunk_key(fqn: str, offsets: Sequence[int]) -> str:
    """The data-file entry key of the chunk of ``fqn`` at ``offsets``."""
    if not any(offsets):  # the whole tensor, or the first chunk: a suffix made once
        suffix = _ORIGIN_SUFFIXES.get(len(offsets))
        if suffix is None:
            suffix = _ORIGIN_SUFFIXES[len(offsets)] = "@" + ",".join("0" * len(offsets))
        return fqn + suffix
    return f"{fqn}@{','.join([str(int(o)) for o in offsets])}"


def bytes_key(fqn: str) -> str:
    """The data-file entry key of the byte blob of ``fqn``."""
    return f"{fqn}@bytes"


@dataclass(slots=True)
class FileEntry:
    """One entry to write: its key, dtype, shape and size in bytes (treated as immutable; not
    frozen, which costs a fifth of a microsecond per field on construction, per entry)."""

    key: str
    dtype: torch.dtype | None  # None: raw bytes
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class FileLayout:
    """Where every entry of a data file lands: the padded header bytes (length prefix
    included), each entry's absolute ``(begin, end)`` in the file, and the file size."""

    header: bytes
    ranges: tuple[tuple[int, int], ...]
    size: int


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One entry of a safetensors header: key, dtype code (``"F32"``, ``"U8"``, ...), shape,
    and ``[begin, end)`` counted from the start of the file (not of the data section)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class Header:
    """A checked safetensors header: its length ``N`` (the data starts at ``8 + N``), its
    ``__metadata__`` if any, and its entries by key, in header order."""

    length: int
    metadata: dict[str, str] | None
    entries: dict[str, HeaderEntry]


def header_entry(entry: FileEntry, begin: int) -> HeaderEntry:
    """The header entry of ``entry`` at absolute byte ``begin`` (raw bytes: ``U8 [nbytes]``)."""
    code = None if entry.dtype is None else safetensors_dtype(entry.dtype)
    shape = (entry.nbytes,) if code is None else tuple(entry.shape)
    return HeaderEntry(entry.key, code or "U8", shape, begin, begin + entry.nbytes)


def layout_file(entries: Sequence[FileEntry], metadata: dict[str, str]) -> FileLayout:
    """Lay out a safetensors file holding ``entries`` in the given order."""
    header: dict[str, object] = {_METADATA_KEY: metadata}
    position = 0
    relative = []
    codes = _SAFETENSORS_DTYPES
    # header_entry written out (tuples for lists: orjson writes them alike): a cost per entry.
    for entry in entries:
        end = position + entry.nbytes
        span = (position, end)
        code = None if entry.dtype is None else codes.get(entry.dtype)
        shape = entry.shape if type(entry.shape) is tuple else tuple(entry.shape)
        if code is None:
            code, shape = "U8", (entry.nbytes,)
        header[entry.key] = {"dtype": code, "shape": shape, "data_offsets": span}
        relative.append(span)
        position = end
    text = compact(header)
    padding = (-(_LENGTH_BYTES + len(text))) % ALIGNMENT
    text += b" " * padding
    start = _LENGTH_BYTES + len(text)
    return FileLayout(
        header=struct.pack("<Q", len(text)) + text,
        ranges=tuple([(start + begin, start + end) for begin, end in relative]),
        size=start + position,
    )


def _invalid(message: str) -> NoReturn:
    raise ValueError(message)


def header_length(prefix: bytes | bytearray | memoryview, file_size: int) -> int:
    """The header length ``N`` stored in the first 8 bytes of a file of ``file_size`` bytes.

    Raises:
        ValueError: The file is too short for the prefix, or ``N`` runs past the end of the
            file or exceeds :data:`MAX_HEADER_BYTES`.
    """
    if file_size < _LENGTH_BYTES or len(prefix) < _LENGTH_BYTES:
        _invalid(f"the file has {file_size} bytes, too few for the 8-byte header length")
    (length,) = struct.unpack("<Q", bytes(prefix[:_LENGTH_BYTES]))
    if length > MAX_HEADER_BYTES:
        _invalid(
            f"the header length {length} is larger than the {MAX_HEADER_BYTES} bytes "
            "safetensors accepts"
        )
    if length > file_size - _LENGTH_BYTES:
        _invalid(f"the header length {length} runs past the end of the file ({file_size} bytes)")
    return int(length)


def _is_int(value: object) -> bool:
    return type(value) is int and 0 <= value < MAX_INT


def _entry(key: str, value: object, data_start: int) -> HeaderEntry:
    if type(value) is not dict or sorted(value) != list(_ENTRY_FIELDS):
        _invalid(
            f"entry {key!r} must be an object with exactly the keys dtype, shape, data_offsets"
        )
    code, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(code, str) or code not in _CODE_SIZES:
        _invalid(f"entry {key!r} has the unknown dtype {code!r}")
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(map(_is_int, shape)):
        _invalid(f"entry {key!r} has a malformed shape {shape!r}")
    if not creatable(shape, _CODE_SIZES[code]):
        _invalid(f"entry {key!r} has the shape {shape}, which no tensor of {code} has")
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or not all(map(_is_int, offsets))
        or offsets[0] > offsets[1]
    ):
        _invalid(f"entry {key!r} has malformed data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * _CODE_SIZES[code]
    if end - begin != expected:
        _invalid(
            f"entry {key!r} has data_offsets {offsets} ({end - begin} bytes), but shape "
            f"{shape} of {code} needs {expected}"
        )
    return HeaderEntry(key, code, tuple(shape), data_start + begin, data_start + end)


def parse_header(data: bytes | bytearray | memoryview, file_size: int) -> Header:
    """Parse and check the safetensors header in ``data``, the first bytes (at least prefix
    and header) of a file of ``file_size`` bytes: what safetensors checks, and more (a bounded
    length; a UTF-8 JSON object starting with ``{``, no repeated keys; string ``__metadata__``;
    entries of exactly a known ``dtype``, a ``shape`` and ``data_offsets`` that agree, packed
    without holes or overlaps from the data section's start to the file's end).

    Raises:
        ValueError: Any of that does not hold (the message says which and where).
    """
    length = header_length(data, file_size)
    data_start = _LENGTH_BYTES + length
    if len(data) < data_start:
        _invalid(f"only {len(data)} of the header's {data_start} bytes were given")
    raw = bytes(data[_LENGTH_BYTES:data_start])
    if not raw.startswith(b"{"):
        _invalid("the header does not start with '{'")
    document = strict_json(raw, "the header")
    if type(document) is not dict:
        _invalid(f"the header must be a JSON object, got {type(document).__name__}")
    metadata = document.get(_METADATA_KEY)
    if _METADATA_KEY in document and (
        type(metadata) is not dict or not all(isinstance(v, str) for v in metadata.values())
    ):
        _invalid("the header's __metadata__ must map strings to strings")
    entries = {k: _entry(k, v, data_start) for k, v in document.items() if k != _METADATA_KEY}
    position = data_start
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            gap = "a hole before it" if entry.begin > position else "it overlaps the one before"
            _invalid(
                f"entry {entry.key!r} starts at data offset {entry.begin - data_start}, where "
                f"the entries before it end at {position - data_start}: {gap}"
            )
        position = entry.end
    if position != file_size:
        _invalid(
            f"the entries end at byte {position} of the file, but the file has {file_size} bytes"
        )
    return Header(length, metadata, entries)


def compare_header(
    header: Header, expected: Iterable[HeaderEntry], *, referenced: bool = False
) -> list[str]:
    """How ``header`` disagrees with the entries the index places in its file (empty when it
    agrees): entries missing or not in the index, and differing dtypes, shapes or offsets.
    ``referenced``: the file is a sibling checkpoint's, of which the index reads some entries
    (the others are not its business)."""
    problems = []
    wanted: dict[str, HeaderEntry] = {}
    for entry in expected:
        if entry.key in wanted:
            problems.append(f"the index places two entries named {entry.key!r} in this file")
        wanted[entry.key] = entry
    for key, want in wanted.items():
        have = header.entries.get(key)
        if have is None:
            problems.append(f"entry {key!r} is missing")
            continue
        if have.dtype != want.dtype:
            problems.append(f"entry {key!r} has dtype {have.dtype}, the index says {want.dtype}")
        if have.shape != want.shape:
            problems.append(
                f"entry {key!r} has shape {list(have.shape)}, the index says {list(want.shape)}"
            )
        if (have.begin, have.end) != (want.begin, want.end):
            problems.append(
                f"entry {key!r} holds bytes {have.begin}-{have.end} of the file, the index "
                f"says {want.begin}-{want.end}"
            )
    if not referenced:
        problems.extend(
            f"entry {key!r} is not in the index" for key in header.entries if key not in wanted
        )
    return problems
