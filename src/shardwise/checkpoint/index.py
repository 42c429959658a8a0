"""The checkpoint index: typed records, the version-2 encoder, and one strict decoder for
versions 1 and 2 (see ``docs/format.md``).

Pure: bytes in, records out, no I/O. :func:`decode_index` trusts nothing: it checks the seal,
every type, name, number, tiling and byte range before it returns, and every failure is a
:class:`~shardwise.errors.CheckpointFormatError` naming the key. Only what needs the files
themselves (their real size, their type) is left to the reader.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import xxhash

from shardwise.checkpoint import planner
from shardwise.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from shardwise.checkpoint.planner import SavedChunk
from shardwise.errors import CheckpointFormatError
from shardwise.metadata import (
    _DTYPES,
    _LAYOUTS,
    _MEMORY_FORMAT_NAMES,
    _MEMORY_FORMATS,
    TensorProperties,
    dtype_name,
)

__all__ = [
    "BLOCK_SIZE",
    "CHECKSUM_ALGORITHM",
    "DATA_DIR",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "MAX_INDEX_BYTES",
    "Index",
    "ObjectRecord",
    "TEXT_ENCODINGS",
    "SaveFacts",
    "TensorRecord",
    "block_checksums",
    "data_file_name",
    "decode_index",
    "decode_text",
    "encode_index",
    "is_data_file_name",
    "is_temporary_name",
    "load_json_value",
    "num_blocks",
    "seal",
]

#: Name of the index file; its presence marks a committed checkpoint.
INDEX_NAME = "shardwise.json"
#: Directory of the data files, relative to the checkpoint.
DATA_DIR = "data"
#: The version :func:`encode_index` writes.
FORMAT_VERSION = 2
# Version 2 with tied tensors (an ``aliases`` table): written only by saves that have some, so
# every other checkpoint stays readable by readers of version 2.
ALIASES_VERSION = 3
#: The block checksum (xxh3, 64 bits, hex). Chosen by measurement: see docs/format.md.
CHECKSUM_ALGORITHM = "xxh3_64"
#: Bytes per checksummed block. Chosen by measurement: see docs/format.md.
BLOCK_SIZE = 1 << 20
#: Readers refuse larger indexes (16 MiB describe a 1 TB checkpoint).
MAX_INDEX_BYTES = 1 << 30
# Bounds on what an index may declare: integers, dims, JSON nesting, block sizes.
_MAX_INT = 1 << 62
_MAX_DIMS = 64
_MAX_DEPTH = 64
_MIN_BLOCK, _MAX_BLOCK = 1 << 12, 1 << 30
# The safetensors header length prefix: no entry can start before it.
_FIRST_DATA_BYTE = 8

_FORMAT = "shardwise-checkpoint"
# A quantized tensor is not its bytes: its scale and zero point are not part of the format.
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})
_HEX = 16
_ENCODINGS = ("json", "pyjson", "bytes", "bytesio", "pickle")
#: Object encodings whose value is JSON text kept in the index (the others are blobs).
TEXT_ENCODINGS = ("json", "pyjson")
_SEAL_KEY = b'"index_checksum":"'
_SEAL_LENGTH = len(_SEAL_KEY) + _HEX + 2  # the key, 16 hex digits, '"}'
_DATA_FILE = re.compile(r"rank-[0-9]{5,9}\.[0-9a-f]{16}\.safetensors")
_TEMPORARY = re.compile(r"rank-[0-9]{5,9}\.[0-9a-f]{16}\.safetensors\.tmp")
_SAVE_ID = re.compile(r"[0-9a-f]{16}")
_HEX_DIGITS = re.compile(r"[0-9a-f]*")
# A \uD800-\uDFFF escape (an odd run of backslashes before "u"): version 2 is written with
# raw UTF-8, so such an escape can only be a lone surrogate, which no Python text can encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_V2_KEYS = (
    "format",
    "format_version",
    "save",
    "checksum",
    "files",
    "properties",
    "tensors",
    "objects",
    "index_checksum",
)
_V3_KEYS = (*_V2_KEYS[:-1], "aliases", "index_checksum")
_SAVE_KEYS = ("writer", "torch", "world_size", "save_id", "checkpoint_id")


# -- records ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SaveFacts:
    """Who wrote the checkpoint, and for which path."""

    writer: str
    torch: str
    world_size: int
    save_id: str
    checkpoint_id: str | None


@dataclass(slots=True)
class TensorRecord:
    """One saved tensor: its properties, global size and chunks (which tile it exactly).
    Treated as immutable (not frozen: see :class:`~shardwise.checkpoint.planner.SavedChunk`)."""

    fqn: str
    properties: TensorProperties
    size: tuple[int, ...]
    chunks: tuple[SavedChunk, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.properties.dtype


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    """One saved non-tensor value: JSON text kept in the index, or a blob in a data file."""

    fqn: str
    encoding: str
    text: str | None = None
    blob: SavedChunk | None = None


@dataclass(frozen=True, slots=True)
class Index:
    """A validated checkpoint index.

    Attributes:
        format_version: 1 or 2.
        block_size: Bytes per checksummed block; ``None`` in version 1 (one block per chunk).
        files: Every data file named, with its declared size (``None`` in version 1, where
            only the file itself knows).
        tensors: The tensor entries by key, in save order.
        objects: The other entries by key, in save order.
        save: Facts of the save (version 2; ``None`` in version 1).
        legacy: The parsed version-1 document (``None`` in version 2).
        aliases: Tied tensors (version 3): alias key -> the key whose tensor it is (the one
            first in the saved state dict). ``tensors`` holds each alias too, with its
            target's record (the same chunks), so that readers need not know about ties.
    """

    format_version: int
    block_size: int | None
    files: dict[str, int | None]
    tensors: dict[str, TensorRecord]
    objects: dict[str, ObjectRecord]
    save: SaveFacts | None = None
    legacy: Metadata | None = None
    aliases: dict[str, str] = field(default_factory=dict)

    def block_size_of(self, chunk: SavedChunk) -> int:
        """The block size of ``chunk``'s checksums (a version-1 chunk is a single block)."""
        return self.block_size if self.block_size is not None else max(chunk.nbytes, 1)

    def to_metadata(self) -> Metadata:
        """The index as DCP-style :class:`Metadata` (see ``docs/format.md``, *In memory*)."""
        if self.legacy is not None:
            return self.legacy
        assert self.save is not None
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage: dict[MetadataIndex, Any] = {}
        names = _metadata_names([*self.tensors, *self.objects])
        for key, tensor in self.tensors.items():
            fqn = names[key]
            entries[fqn] = TensorStorageMetadata(
                properties=tensor.properties,
                size=torch.Size(tensor.size),
                chunks=[
                    ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                    for c in tensor.chunks
                ],
            )
            for position, chunk in enumerate(tensor.chunks):
                index = MetadataIndex(fqn, torch.Size(chunk.offsets), position)
                storage[index] = _stored_info(chunk)
        for key, item in self.objects.items():
            fqn = names[key]
            entries[fqn] = BytesStorageMetadata()
            if item.blob is None:
                info: dict[str, Any] = {"encoding": item.encoding, "text": item.text}
            else:
                info = {"encoding": item.encoding, **_stored_info(item.blob)}
            storage[MetadataIndex(fqn)] = info
        return Metadata(
            state_dict_metadata=entries,
            planner_data={
                "writer": self.save.writer,
                "torch": self.save.torch,
                "world_size": self.save.world_size,
                "checksum_algorithm": CHECKSUM_ALGORITHM,
                "block_size": self.block_size,
            },
            storage_data=storage,
            storage_meta=StorageMeta(
                checkpoint_id=self.save.checkpoint_id, save_id=self.save.save_id
            ),
            version=str(self.format_version),
        )


def _metadata_names(keys: list[str]) -> dict[str, str]:
    """The key :class:`Metadata` gives each entry: its dotted key (as DCP names it), or, for
    the rare second entry of the same dotted key (``{0: x, "0": y}``), its internal key."""
    from shardwise.checkpoint.state_dict import display_key

    names: dict[str, str] = {}
    taken: set[str] = set()
    for key in keys:
        name = display_key(key)
        names[key] = key if name in taken else name
        taken.add(names[key])
    return names


def _stored_info(chunk: SavedChunk) -> dict[str, Any]:
    sums = chunk.checksums
    return {
        "file": chunk.file,
        "begin": chunk.begin,
        "end": chunk.end,
        "checksums": [sums[i : i + _HEX] for i in range(0, len(sums), _HEX)],
    }


# -- names and blocks -------------------------------------------------------------------------


def data_file_name(rank: int, save_id: str) -> str:
    """The data file of ``rank`` in save ``save_id``, relative to the checkpoint."""
    return f"{DATA_DIR}/rank-{rank:05d}.{save_id}.safetensors"


def is_data_file_name(name: str) -> bool:
    """Whether ``name`` (inside ``data/``) is a data file name the writer makes."""
    return _DATA_FILE.fullmatch(name) is not None


def is_temporary_name(name: str) -> bool:
    """Whether ``name`` (inside ``data/``) is the writer's temporary name for a data file."""
    return _TEMPORARY.fullmatch(name) is not None


def num_blocks(nbytes: int, block_size: int) -> int:
    """Blocks of ``nbytes`` bytes (an empty chunk has one block of zero bytes)."""
    return max(1, -(-nbytes // block_size))


def block_checksums(data: memoryview | bytes, block_size: int = BLOCK_SIZE) -> str:
    """The concatenated block checksums of ``data`` (one whole chunk)."""
    view = memoryview(data).cast("B")
    if not len(view):
        return str(xxhash.xxh3_64_hexdigest(b""))
    return "".join(
        xxhash.xxh3_64_hexdigest(view[start : start + block_size])
        for start in range(0, len(view), block_size)
    )


# -- encoding ---------------------------------------------------------------------------------


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: building an index allocates hundreds of thousands
    of small lists, which otherwise trigger full collections (measured: parsing the index of
    10,000 tensors took 98 ms with it, 11 ms without). Nothing built here forms cycles.
    ``save`` and ``load`` run whole under it too (10,000 small tensors: save 1.28 s -> 0.55 s,
    load 0.62 s -> 0.36 s); a nested pause leaves the collector as the outer one wants it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def encode_index(
    save: SaveFacts,
    files: Mapping[str, int],
    tensors: Iterable[TensorRecord],
    objects: Iterable[ObjectRecord],
    block_size: int = BLOCK_SIZE,
    aliases: Mapping[str, str] | None = None,
) -> bytes:
    """The sealed index of a checkpoint (see ``docs/format.md``): version 2, or version 3
    when there are ``aliases`` (alias key -> the tensor key it is tied to; the alias is not
    among ``tensors``)."""
    with paused_gc():
        return _encode(save, files, tensors, objects, block_size, aliases or {})


def build_index(
    save: SaveFacts,
    files: Mapping[str, int],
    tensors: Iterable[TensorRecord],
    objects: Iterable[ObjectRecord],
    aliases: Mapping[str, str] | None = None,
    block_size: int = BLOCK_SIZE,
) -> Index:
    """The :class:`Index` that :func:`decode_index` gives for :func:`encode_index` of the
    same arguments, built directly (a writer need not parse what it just wrote)."""
    records = {tensor.fqn: tensor for tensor in tensors}
    aliases = dict(aliases or {})
    for alias, target in sorted(aliases.items()):
        record = records[target]
        records[alias] = TensorRecord(alias, record.properties, record.size, record.chunks)
    return Index(
        ALIASES_VERSION if aliases else FORMAT_VERSION,
        block_size,
        dict(files),
        records,
        {item.fqn: item for item in objects},
        save=save,
        aliases=aliases,
    )


def _encode(
    save: SaveFacts,
    files: Mapping[str, int],
    tensors: Iterable[TensorRecord],
    objects: Iterable[ObjectRecord],
    block_size: int,
    aliases: Mapping[str, str],
) -> bytes:
    file_numbers = {name: number for number, name in enumerate(files)}
    property_numbers: dict[tuple[Any, ...], int] = {}
    numbers_by_properties: dict[tuple[Any, ...], int] = {}
    tensor_rows = []
    for tensor in tensors:
        p = tensor.properties
        raw = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        number = numbers_by_properties.get(raw, -1)
        if number < 0:
            row = (
                dtype_name(p.dtype),
                str(p.layout).removeprefix("torch."),
                p.requires_grad,
                _MEMORY_FORMAT_NAMES[p.memory_format],
                p.pin_memory,
            )
            number = property_numbers.setdefault(row, len(property_numbers))
            numbers_by_properties[raw] = number
        chunks = [
            [list(c.offsets), list(c.sizes), file_numbers[c.file], c.begin, c.checksums]
            for c in tensor.chunks
        ]
        tensor_rows.append([tensor.fqn, number, list(tensor.size), chunks])
    object_rows: list[list[Any]] = []
    for item in objects:
        if item.blob is None:
            object_rows.append([item.fqn, item.encoding, item.text])
        else:
            blob = item.blob
            stored = [file_numbers[blob.file], blob.begin, blob.nbytes, blob.checksums]
            object_rows.append([item.fqn, item.encoding, stored])
    document: dict[str, Any] = {
        "format": _FORMAT,
        "format_version": ALIASES_VERSION if aliases else FORMAT_VERSION,
        "save": {
            "writer": save.writer,
            "torch": save.torch,
            "world_size": save.world_size,
            "save_id": save.save_id,
            "checkpoint_id": save.checkpoint_id,
        },
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_size": block_size},
        "files": [[name, size] for name, size in files.items()],
        "properties": [list(row) for row in property_numbers],
        "tensors": tensor_rows,
        "objects": object_rows,
    }
    if aliases:
        document["aliases"] = [[alias, aliases[alias]] for alias in sorted(aliases)]
    return seal(document)


def seal(document: Mapping[str, Any]) -> bytes:
    """``document`` (a version-2 index without its last key) as compact JSON ending with its
    seal, ``"index_checksum":"<xxh3_64 of every byte before it>"}``."""
    # Raw UTF-8 (ensure_ascii=False): the reader then refuses every \uD8xx escape outright.
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    prefix = (text[:-1] + ",").encode()
    digest = xxhash.xxh3_64_hexdigest(prefix).encode()
    return prefix + _SEAL_KEY + digest + b'"}'


# -- decoding ---------------------------------------------------------------------------------


def _fail(message: str, key: str | None = None) -> NoReturn:
    raise CheckpointFormatError(message, key=key)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        _fail("the checkpoint index repeats a key inside one JSON object")
    return result


def _reject_constant(name: str) -> NoReturn:
    _fail(f"the checkpoint index contains {name}, which is not JSON")


def _parse(data: bytes | str, what: str, constants: bool = False) -> Any:
    """Strict JSON: UTF-8, no repeated keys, bounded nesting and digits, and no NaN or
    Infinity unless ``constants`` (stored values may hold them: ``float("inf")`` round-trips)."""
    try:
        # Decoded here, strictly: json.loads would take UTF-16 or UTF-32, a byte order mark,
        # and surrogates encoded in UTF-8.
        text = data.decode() if isinstance(data, bytes) else data
        if constants:
            return json.loads(text, object_pairs_hook=_unique_keys)
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except RecursionError:
        _fail(f"{what} is nested too deeply")
    # JSONDecodeError is a ValueError; so is an integer of more digits than Python converts.
    except (ValueError, UnicodeDecodeError) as err:
        _fail(f"{what} is not valid JSON: {err}")


def load_json_value(text: str, key: str) -> Any:
    """Decode a JSON value stored in the index, refusing nesting deeper than 64 levels."""
    value = _parse(text, "the stored JSON value", constants=True)
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > _MAX_DEPTH:
                _fail(f"the stored JSON value is nested deeper than {_MAX_DEPTH} levels", key)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return value


def decode_text(record: ObjectRecord) -> Any:
    """The value of an object kept in the index as JSON text (``json`` or ``pyjson``, whose
    tuples and non-string dict keys are tagged).

    Raises:
        CheckpointFormatError: The text is not JSON, is nested too deeply, or its tags are
            malformed (naming the key).
    """
    from shardwise.checkpoint._items import untag

    assert record.text is not None
    try:
        value = load_json_value(record.text, record.fqn)
        return untag(value) if record.encoding == "pyjson" else value
    except CheckpointFormatError as err:
        raise CheckpointFormatError(err.bare_message, key=record.fqn) from err
    except (ValueError, TypeError) as err:
        raise CheckpointFormatError(f"malformed tagged JSON value: {err}", key=record.fqn) from err


def _is_int(value: object) -> bool:
    return type(value) is int and 0 <= value < _MAX_INT  # type: ignore[operator]


def _int(value: object, what: str, key: str | None = None) -> int:
    if not _is_int(value):
        _fail(f"{what} must be an integer in [0, 2**62), got {value!r}", key)
    assert isinstance(value, int)
    return value


def _dims(value: object, what: str, key: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > _MAX_DIMS:
        _fail(f"{what} must be a list of at most {_MAX_DIMS} integers in [0, 2**62)", key)
    for v in value:  # a plain loop: the hottest check of a large index
        if type(v) is not int or not 0 <= v < _MAX_INT:
            _fail(f"{what} must be a list of at most {_MAX_DIMS} integers in [0, 2**62)", key)
    return tuple(value)


def _text(value: object, what: str, key: str | None = None) -> str:
    if not isinstance(value, str):
        _fail(f"{what} must be a string, got {type(value).__name__}", key)
    return value


def _row(value: object, length: int, what: str, key: str | None = None) -> list[Any]:
    if type(value) is not list or len(value) != length:
        _fail(f"{what} must be a list of {length} items", key)
    return value


class _Ranges:
    """Byte ranges per data file: checked to lie after the header, inside the file's declared
    size, and not to overlap (so the declared bytes fit the files)."""

    def __init__(self, files: dict[str, int | None]) -> None:
        self.files = files
        self._ranges: dict[str, list[tuple[int, int, str]]] = {name: [] for name in files}
        self._checksums: list[str] = []

    def add(self, chunk: SavedChunk, key: str) -> None:
        self._checksums.append(chunk.checksums)
        if chunk.begin < _FIRST_DATA_BYTE:
            _fail(f"a byte range starts at {chunk.begin}, inside the file's header", key)
        size = self.files[chunk.file]
        if size is not None and chunk.end > size:
            _fail(
                f"the byte range [{chunk.begin}, {chunk.end}) ends past the declared size "
                f"{size} of {chunk.file}",
                key,
            )
        if chunk.end > chunk.begin:
            self._ranges[chunk.file].append((chunk.begin, chunk.end, key))

    def check(self) -> None:
        if _HEX_DIGITS.fullmatch("".join(self._checksums)) is None:
            bad = next(s for s in self._checksums if _HEX_DIGITS.fullmatch(s) is None)
            _fail(f"malformed block checksums {bad[:40]!r}: expected lowercase hex digits")
        for name, ranges in self._ranges.items():
            ranges.sort()
            for (_, end, first), (begin, _, second) in itertools.pairwise(ranges):
                if begin < end:
                    _fail(f"the byte ranges of {first!r} and {second!r} overlap in {name}", second)


def _checked_tensor(
    fqn: str,
    properties: TensorProperties,
    size: tuple[int, ...],
    chunks: list[SavedChunk],
    block_size: int | None,
    ranges: _Ranges,
) -> TensorRecord:
    if properties.dtype in _QUANTIZED:
        _fail(
            f"{properties.dtype} is a quantized dtype, which a checkpoint cannot hold (its "
            "scale and zero point are not stored)",
            fqn,
        )
    itemsize = properties.dtype.itemsize
    if math.prod(size) * itemsize >= _MAX_INT:
        _fail(f"the size {list(size)} is too large", fqn)
    for chunk in chunks:
        expected = math.prod(chunk.sizes) * itemsize
        if chunk.nbytes != expected:
            _fail(
                f"the chunk at offsets {list(chunk.offsets)} has {chunk.nbytes} bytes stored, "
                f"{expected} expected for sizes {list(chunk.sizes)} of {properties.dtype}",
                fqn,
            )
        _check_checksums(chunk, block_size, fqn)
        ranges.add(chunk, fqn)
    try:
        planner.check_tiling(size, [(c.offsets, c.sizes) for c in chunks])
    except ValueError as err:
        _fail(f"the saved chunks do not tile the tensor of size {list(size)}: {err}", fqn)
    return TensorRecord(fqn, properties, size, tuple(chunks))


def _check_checksums(chunk: SavedChunk, block_size: int | None, key: str) -> None:
    """The checksum string has one 16-digit checksum per block (its digits are checked for
    all chunks at once by :meth:`_Ranges.check`)."""
    count = 1 if block_size is None else max(1, -(-chunk.nbytes // block_size))
    if len(chunk.checksums) != count * _HEX:
        _fail(f"malformed block checksums (expected {count} of 16 hex digits)", key)


_INT_SUFFIX = re.compile(r"[^\x00]*\x00(0|[1-9][0-9]{0,3})(,(0|[1-9][0-9]{0,3}))*")


_INT_PART = re.compile(r"-?(0|[1-9][0-9]{0,18})")


def _check_int_suffix(key: str) -> None:
    """A version-2 key with int parts: ``<dotted key>\x00<positions>``, the positions of
    the int parts in the ``.``-split key, increasing and inside it."""
    if _INT_SUFFIX.fullmatch(key) is None:
        _fail(f"malformed key {key!r}: a NUL may only introduce the positions of int parts")
    name, positions = key.split("\x00")
    numbers = [int(p) for p in positions.split(",")]
    segments = name.split(".")
    if numbers != sorted(set(numbers)) or numbers[-1] >= len(segments):
        _fail(f"malformed key {key!r}: int positions out of order or out of range")
    if any(_INT_PART.fullmatch(segments[n]) is None for n in numbers):
        _fail(f"malformed key {key!r}: a part marked as an int is not one")


def _check_text(value: str, what: str, key: str | None = None) -> None:
    try:
        value.encode()
    except UnicodeEncodeError:
        _fail(f"{what} holds a lone surrogate, which is not text", key)


def _has_surrogate_escape(data: bytes) -> bool:
    """Whether ``data`` holds a ``\\uD800``-``\\uDFFF`` escape: a match preceded by an even run
    of backslashes (a look-behind in the pattern made the search 100 times slower)."""
    for match in _SURROGATE_ESCAPE.finditer(data):
        start = match.start()
        run = 0
        while start - run > 0 and data[start - run - 1] == 0x5C:  # backslash
            run += 1
        if run % 2 == 0:
            return True
    return False


def decode_index(data: bytes) -> Index:
    """Read and validate a checkpoint index of format version 1 or 2.

    Raises:
        CheckpointFormatError: The index is corrupt (its seal does not match), malformed, of
            an unknown version, or describes chunks, names or byte ranges that cannot be
            right (see ``docs/format.md``, *Validation*).
    """
    if len(data) > MAX_INDEX_BYTES:
        _fail(f"the checkpoint index has {len(data)} bytes, more than a reader accepts")
    sealed = (
        len(data) >= _SEAL_LENGTH
        and data.endswith(b'"}')
        and data[-_SEAL_LENGTH : -_HEX - 2] == _SEAL_KEY
    )
    if sealed:
        prefix = data[:-_SEAL_LENGTH]
        if xxhash.xxh3_64_hexdigest(prefix).encode() != data[-_HEX - 2 : -2]:
            _fail(
                "the checkpoint index is corrupt: its checksum does not match its content (a "
                "changed or damaged byte)"
            )
    with paused_gc():
        return _decode(data, sealed)


def _decode(data: bytes, sealed: bool) -> Index:
    document = _parse(data, "the checkpoint index")
    if type(document) is not dict:
        _fail(f"a checkpoint index must be a JSON object, got {type(document).__name__}")
    if document.get("format") != _FORMAT:
        _fail(
            f"not a shardwise checkpoint index: format is {document.get('format')!r}, "
            f"expected {_FORMAT!r}"
        )
    version = document.get("format_version")
    if type(version) is int and version in (FORMAT_VERSION, ALIASES_VERSION):
        if not sealed:
            _fail("the checkpoint index is corrupt: its checksum (index_checksum) is missing")
        if b"\\u" in data and _has_surrogate_escape(data):
            _fail("the checkpoint index holds a lone surrogate, which is not text")
        return _decode_v2(document, version)
    if type(version) is int and version == 1:
        return _decode_v1(document)
    _fail(
        f"unsupported checkpoint format version {version!r}; this shardwise reads versions 1, "
        f"{FORMAT_VERSION} and {ALIASES_VERSION} (a newer shardwise may read it)"
    )


def _decode_v2(document: dict[str, Any], version: int) -> Index:
    expected = _V2_KEYS if version == FORMAT_VERSION else _V3_KEYS
    if tuple(document) != expected:
        _fail(
            f"the checkpoint index of version {version} must have exactly the keys "
            f"{list(expected)} in order"
        )
    save = document["save"]
    if type(save) is not dict or tuple(save) != _SAVE_KEYS:
        _fail(f"the checkpoint index's save facts must have the keys {list(_SAVE_KEYS)}")
    save_id = _text(save["save_id"], "save_id")
    if _SAVE_ID.fullmatch(save_id) is None:
        _fail(f"save_id must be 16 hex digits, got {save_id!r}")
    checkpoint_id = save["checkpoint_id"]
    if checkpoint_id is not None:
        _text(checkpoint_id, "checkpoint_id")
    world_size = _int(save["world_size"], "world_size")
    if world_size < 1:
        _fail("world_size must be at least 1")
    facts = SaveFacts(
        _text(save["writer"], "writer"),
        _text(save["torch"], "torch"),
        world_size,
        save_id,
        checkpoint_id,
    )
    checksum = document["checksum"]
    if type(checksum) is not dict or tuple(checksum) != ("algorithm", "block_size"):
        _fail("the checkpoint index's checksum must have the keys algorithm and block_size")
    if checksum["algorithm"] != CHECKSUM_ALGORITHM:
        _fail(
            f"unsupported checksum algorithm {checksum['algorithm']!r}; this shardwise uses "
            f"{CHECKSUM_ALGORITHM}"
        )
    block_size = _int(checksum["block_size"], "block_size")
    if not _MIN_BLOCK <= block_size <= _MAX_BLOCK:
        _fail(f"block_size {block_size} is outside [{_MIN_BLOCK}, {_MAX_BLOCK}]")

    file_rows = document["files"]
    if type(file_rows) is not list:
        _fail("files must be a list")
    files: dict[str, int | None] = {}
    names: list[str] = []
    for row in file_rows:
        name, size = _row(row, 2, "a files entry")
        name = _text(name, "a data file name")
        if not name.startswith(f"{DATA_DIR}/") or not is_data_file_name(name[5:]):
            _fail(f"{name!r} is not a data file name of this format (data/rank-*.safetensors)")
        if name in files:
            _fail(f"the data file {name!r} is listed twice")
        files[name] = _int(size, f"the size of {name}")
        names.append(name)

    property_rows = document["properties"]
    if type(property_rows) is not list:
        _fail("properties must be a list")
    properties = [_properties(row) for row in property_rows]

    ranges = _Ranges(files)
    tensors: dict[str, TensorRecord] = {}
    rows = document["tensors"]
    if type(rows) is not list:
        _fail("tensors must be a list")
    num_files, num_properties = len(names), len(properties)
    for row in rows:
        # The hottest loop of a reader (one pass per tensor of the checkpoint): checks are
        # written out rather than delegated, and a tensor of one whole chunk, the common
        # case, skips the general tiling check.
        fqn, number, size_row, chunk_rows = _row(row, 4, "a tensors entry")
        if type(fqn) is not str:
            _fail(f"a key must be a string, got {type(fqn).__name__}")
        if "\x00" in fqn:
            _check_int_suffix(fqn)
        if fqn in tensors:
            _fail("the key appears twice", fqn)
        if type(number) is not int or not 0 <= number < num_properties:
            _fail(f"property index {number!r} does not exist", fqn)
        props = properties[number]
        if props.dtype in _QUANTIZED:
            _fail(
                f"{props.dtype} is a quantized dtype, which a checkpoint cannot hold (its "
                "scale and zero point are not stored)",
                fqn,
            )
        itemsize = props.dtype.itemsize
        size = _dims(size_row, "size", fqn)
        if math.prod(size) * itemsize >= _MAX_INT:
            _fail(f"the size {list(size)} is too large", fqn)
        if type(chunk_rows) is not list:
            _fail("chunks must be a list", fqn)
        chunks = []
        for chunk_row in chunk_rows:
            offsets, sizes, file, begin, sums = _row(chunk_row, 5, "a chunk", fqn)
            if type(file) is not int or not 0 <= file < num_files:
                _fail(f"file index {file!r} does not exist", fqn)
            begin = _int(begin, "begin", fqn)
            offsets = _dims(offsets, "chunk offsets", fqn)
            sizes = _dims(sizes, "chunk sizes", fqn)
            nbytes = math.prod(sizes) * itemsize
            end = begin + nbytes
            if type(sums) is not str or end >= _MAX_INT:
                _fail("malformed chunk", fqn)
            if len(sums) != max(1, -(-nbytes // block_size)) * _HEX:
                _fail("malformed block checksums (one of 16 hex digits per block expected)", fqn)
            chunk = SavedChunk(offsets, sizes, names[file], begin, end, sums)
            ranges.add(chunk, fqn)
            chunks.append(chunk)
        only = chunks[0] if len(chunks) == 1 else None
        whole = (
            only is not None
            and only.sizes == size
            and len(only.offsets) == len(size)
            and not any(only.offsets)
        )
        if not whole:
            try:
                planner.check_tiling(size, [(c.offsets, c.sizes) for c in chunks])
            except ValueError as err:
                _fail(f"the saved chunks do not tile the tensor of size {list(size)}: {err}", fqn)
        tensors[fqn] = TensorRecord(fqn, props, size, tuple(chunks))

    objects: dict[str, ObjectRecord] = {}
    rows = document["objects"]
    if type(rows) is not list:
        _fail("objects must be a list")
    for row in rows:
        fqn, encoding, payload = _row(row, 3, "an objects entry")
        fqn = _text(fqn, "a key")
        if "\x00" in fqn:
            _check_int_suffix(fqn)
        if fqn in tensors or fqn in objects:
            _fail("the key appears twice", fqn)
        if encoding not in _ENCODINGS:
            _fail(f"unknown object encoding {encoding!r}", fqn)
        if encoding in TEXT_ENCODINGS:
            objects[fqn] = ObjectRecord(fqn, encoding, text=_text(payload, "a JSON value", fqn))
            continue
        file, begin, nbytes, sums = _row(payload, 4, "a stored object", fqn)
        if type(file) is not int or not 0 <= file < num_files:
            _fail(f"file index {file!r} does not exist", fqn)
        begin, nbytes = _int(begin, "begin", fqn), _int(nbytes, "nbytes", fqn)
        if type(sums) is not str or begin + nbytes >= _MAX_INT:
            _fail("malformed stored object", fqn)
        blob = SavedChunk((), (), names[file], begin, begin + nbytes, sums)
        _check_checksums(blob, block_size, fqn)
        ranges.add(blob, fqn)
        objects[fqn] = ObjectRecord(fqn, encoding, blob=blob)
    ranges.check()
    aliases = {} if version == FORMAT_VERSION else _aliases(document["aliases"], tensors, objects)
    for alias, target in aliases.items():  # after the range check: they share the bytes
        record = tensors[target]
        tensors[alias] = TensorRecord(alias, record.properties, record.size, record.chunks)
    return Index(version, block_size, files, tensors, objects, save=facts, aliases=aliases)


def _aliases(
    rows: object, tensors: dict[str, TensorRecord], objects: dict[str, ObjectRecord]
) -> dict[str, str]:
    """The validated ``aliases`` table: each alias a new key, each target a saved tensor."""
    if type(rows) is not list or not rows:
        _fail("aliases must be a non-empty list (version 3 is written only when there are some)")
    aliases: dict[str, str] = {}
    for row in rows:
        alias, target = _row(row, 2, "an aliases entry")
        alias = _text(alias, "a key")
        target = _text(target, "a key", alias)
        if "\x00" in alias:
            _check_int_suffix(alias)
        if alias in tensors or alias in objects or alias in aliases:
            _fail("the key appears twice", alias)
        if target not in tensors:
            _fail(f"it is tied to {target!r}, which is not a saved tensor", alias)
        aliases[alias] = target
    return aliases


def _properties(row: object) -> TensorProperties:
    dtype, layout, requires_grad, memory_format, pin_memory = _row(row, 5, "a properties entry")
    if (
        not isinstance(dtype, str)
        or dtype not in _DTYPES
        or not isinstance(layout, str)
        or layout not in _LAYOUTS
        or not isinstance(memory_format, str)
        or memory_format not in _MEMORY_FORMATS
        or type(requires_grad) is not bool
        or type(pin_memory) is not bool
    ):
        _fail(f"malformed or unknown tensor properties {row!r}")
    return TensorProperties(
        dtype=_DTYPES[dtype],
        layout=_LAYOUTS[layout],
        requires_grad=requires_grad,
        memory_format=_MEMORY_FORMATS[memory_format],
        pin_memory=pin_memory,
    )


# -- version 1 --------------------------------------------------------------------------------

# The fields of a chunk's and of a blob's storage info, sorted.
_V1_CHUNK_INFO = ("begin", "checksum", "end", "file")
_V1_BLOB_INFO = ("begin", "checksum", "encoding", "end", "file")


def _check_tree(document: object) -> None:
    """Every string of a parsed version-1 index is text, every integer lies in [0, 2**62),
    and nothing is nested deeper than 64 levels (version 2 has no free-form fields: it is
    checked field by field)."""
    stack = [(document, 1)]
    while stack:
        item, depth = stack.pop()
        if type(item) is str:
            _check_text(item, "a string of the checkpoint index")
        elif type(item) is int and not 0 <= item < _MAX_INT:
            _fail("the checkpoint index holds an integer outside [0, 2**62)")
        elif type(item) is list or type(item) is dict:
            if depth > _MAX_DEPTH:
                _fail(f"the checkpoint index is nested deeper than {_MAX_DEPTH} levels")
            if type(item) is dict:
                stack.extend((key, depth) for key in item)
                item = item.values()
            stack.extend((child, depth + 1) for child in item)


def _decode_v1(document: dict[str, Any]) -> Index:
    """A version-1 index (one JSON object per chunk, one checksum per chunk), held to the
    same rules as version 2; file sizes are checked when the files are opened."""
    _check_tree(document)
    try:
        metadata = Metadata.from_dict(document)
    except CheckpointFormatError:
        raise
    # The version-1 reader predates hostile-input checks; anything it trips on is malformed.
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, IndexError) as err:
        _fail(f"malformed checkpoint index: {type(err).__name__}: {err}")
    planner_data = metadata.planner_data
    algorithm = planner_data.get("checksum_algorithm") if type(planner_data) is dict else None
    if algorithm != CHECKSUM_ALGORITHM:
        _fail(
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
            _fail("the index has no storage info for a chunk", fqn)
        if tuple(sorted(info)) != fields:
            _fail(f"malformed storage info {info!r}", fqn)
        name = _text(info["file"], "a data file name", fqn)
        if not name.startswith(f"{DATA_DIR}/") or not is_data_file_name(name[5:]):
            _fail(f"{name!r} is not a data file name of this format", fqn)
        begin, end = _int(info["begin"], "begin", fqn), _int(info["end"], "end", fqn)
        if end < begin:
            _fail("a byte range ends before it begins", fqn)
        files.setdefault(name, None)
        return SavedChunk(offsets, sizes, name, begin, end, _text(info["checksum"], "checksum"))

    tensors: dict[str, TensorRecord] = {}
    objects: dict[str, ObjectRecord] = {}
    pending: list[tuple[str, TensorProperties, tuple[int, ...], list[SavedChunk]]] = []
    for fqn, entry in metadata.state_dict_metadata.items():
        if "\x00" in fqn:  # version 1 had no int parts: a NUL is malformed there
            _fail("malformed key: version 1 keys hold no NUL", fqn)
        if isinstance(entry, TensorStorageMetadata):
            size = tuple(entry.size)
            if len(size) > _MAX_DIMS or not all(_is_int(v) for v in size):
                _fail("size out of bounds", fqn)
            chunks = []
            for chunk in entry.chunks:
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                if not all(_is_int(v) for v in offsets + sizes):
                    _fail("chunk offsets or sizes out of bounds", fqn)
                info = info_of(MetadataIndex(fqn, chunk.offsets))
                chunks.append(chunk_of(fqn, info, offsets, sizes))
            pending.append((fqn, entry.properties, size, chunks))
            continue
        info = info_of(MetadataIndex(fqn))
        if type(info) is not dict or info.get("encoding") not in _ENCODINGS:
            _fail("the index has no valid storage info for it", fqn)
        encoding = info["encoding"]
        if encoding == "json":
            if tuple(sorted(info)) != ("encoding", "text"):
                _fail(f"malformed storage info {info!r}", fqn)
            objects[fqn] = ObjectRecord(
                fqn, encoding, text=_text(info["text"], "a JSON value", fqn)
            )
        else:
            blob = chunk_of(fqn, info, (), (), _V1_BLOB_INFO)
            objects[fqn] = ObjectRecord(fqn, encoding, blob=blob)
    if len(used) != len(infos):
        _fail("the checkpoint index holds storage info for a key or chunk it does not have")
    ranges = _Ranges(files)
    for fqn, properties, size, chunks in pending:
        tensors[fqn] = _checked_tensor(fqn, properties, size, chunks, None, ranges)
    for fqn, item in objects.items():
        if item.blob is not None:
            _check_checksums(item.blob, None, fqn)
            ranges.add(item.blob, fqn)
    ranges.check()
    return Index(1, None, files, tensors, objects, legacy=metadata)
