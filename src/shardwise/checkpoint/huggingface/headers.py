"""The tensors of a Hugging Face model directory, told by its safetensors headers and its
index, pure and hostile-input safe: every header is checked (a bounded length, UTF-8 JSON, a
known dtype, a shape whose bytes are what ``data_offsets`` spans, entries packed inside the
file without holes or overlaps: :func:`~shardwise.checkpoint.index.data_file.parse_header`)
and agreed with the index before any tensor byte is read or memory allocated for one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from shardwise.checkpoint.huggingface.files import is_unicode_text
from shardwise.checkpoint.index.data_file import (
    MAX_HEADER_BYTES,
    Header,
    header_length,
    parse_header,
    torch_dtype,
)
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.errors import CheckpointFormatError

__all__ = ["LENGTH_BYTES", "MAX_HEADERS_BYTES", "Catalog", "StoredTensor", "catalog", "length_of"]

#: Bytes of a safetensors file before its JSON header: the header's length.
LENGTH_BYTES = 8
#: The most header bytes a directory may have, all files together (each file's own limit is
#: safetensors' 100 MB; the headers of a model of thousands of tensors take a few MiB).
MAX_HEADERS_BYTES = MAX_HEADER_BYTES


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor of the directory: bytes ``[begin, end)`` of weight file ``file``, C order."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    def chunk(self) -> SavedChunk:
        """The tensor as the one saved chunk a read plan covers it with."""
        return SavedChunk((0,) * len(self.shape), self.shape, self.file, self.begin, self.end)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class Catalog:
    """The checked tensors of a directory by name, and the size of each weight file."""

    tensors: dict[str, StoredTensor]
    sizes: dict[str, int]


def length_of(prefix: bytes, size: int, shown: str) -> int:
    """The header length in the first :data:`LENGTH_BYTES` of a file of ``size`` bytes.

    Raises:
        CheckpointFormatError: Too short a file, or a length past its end or over the limit.
    """
    try:
        return header_length(prefix, size)
    except ValueError as err:
        raise CheckpointFormatError(f"not a safetensors file: {err}", file=shown) from err


def catalog(
    headers: Mapping[str, tuple[bytes, int]],
    weight_map: Mapping[str, str] | None,
    shown: Callable[[str], str],
) -> Catalog:
    """The tensors of the weight files ``headers`` (name -> the file's first bytes, its length
    prefix and header, and the file's size), checked against ``weight_map`` (the index's, when
    there is one: it must place exactly the tensors the headers hold, each where it is).
    ``shown(name)``: a file's name as errors show it.

    Raises:
        CheckpointFormatError: A malformed header, a tensor in two files, or an index that
            disagrees with the headers (naming the tensor and the file).
    """
    tensors: dict[str, StoredTensor] = {}
    total = 0
    for file, (data, size) in headers.items():
        total += len(data)
        if total > MAX_HEADERS_BYTES + LENGTH_BYTES * len(headers):
            raise CheckpointFormatError(
                f"the headers of the weight files take more than {MAX_HEADERS_BYTES} bytes",
                file=shown(file),
            )
        try:
            header = parse_header(data, size)
            _check_portable(header, data)
        except ValueError as err:
            raise CheckpointFormatError(
                f"not a valid safetensors file: {err}", file=shown(file)
            ) from err
        for name, entry in header.entries.items():
            if name in tensors:
                raise CheckpointFormatError(
                    f"two weight files hold this tensor: {tensors[name].file!r} and {file!r}",
                    key=name,
                    file=shown(file),
                )
            tensors[name] = StoredTensor(
                name, file, torch_dtype(entry.dtype), entry.shape, entry.begin, entry.end
            )
    if weight_map is not None:
        _agree(tensors, weight_map, shown)
    return Catalog(tensors, {file: size for file, (_, size) in headers.items()})


def _check_portable(header: Header, data: bytes) -> None:
    """Refuse what :func:`parse_header` reads but the safetensors library (and torch) cannot:
    a name or metadata string with a lone surrogate (a ``\\ud800`` escape: not Unicode text),
    a shape of no elements whose other dims overflow 64 bits (no tensor has it), and the
    number ``-0`` (a float to other JSON readers).

    Raises:
        ValueError: Saying which.
    """
    texts = [*header.entries, *(header.metadata or {}).keys(), *(header.metadata or {}).values()]
    for text in texts:
        if not is_unicode_text(text):
            raise ValueError(f"the header holds {text!r}, which is not Unicode text")
    for name, entry in header.entries.items():
        if math.prod(dim for dim in entry.shape if dim) > _MAX_ELEMENTS:
            raise ValueError(
                f"entry {name!r} has the shape {list(entry.shape)}, whose dims overflow 64 bits"
            )
    raw = data[LENGTH_BYTES : LENGTH_BYTES + header.length]
    if b"-0" in raw:  # rare outside strings (dates in metadata): then parsed again, to tell
        json.loads(raw.decode("utf-8"), parse_int=_unsigned)


_MAX_ELEMENTS = (1 << 63) - 1


def _unsigned(text: str) -> int:
    if text.startswith("-"):
        raise ValueError(f"the header has the number {text}, which JSON readers take for a float")
    return int(text)


def _agree(
    tensors: Mapping[str, StoredTensor], weight_map: Mapping[str, str], shown: Callable[[str], str]
) -> None:
    """Refuse an index that places a tensor elsewhere than the headers, or misses one."""
    for name, file in weight_map.items():
        stored = tensors.get(name)
        if stored is None or stored.file != file:
            where = "no weight file" if stored is None else repr(stored.file)
            raise CheckpointFormatError(
                f"the index places this tensor in {file!r}, but {where} holds it",
                key=name,
                file=shown(file),
            )
    for name, stored in tensors.items():
        if name not in weight_map:
            raise CheckpointFormatError(
                "this weight file holds the tensor, but the index does not name it",
                key=name,
                file=shown(stored.file),
            )
