"""The writer's side of the index: the sealed bytes (:func:`encode_index`) of a save's records."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, astuple, dataclass, field
from typing import Any

import xxhash

from shardwise._codec import MEMORY_FORMAT_NAMES, dtype_name
from shardwise.checkpoint.entries.pyjson import compact
from shardwise.checkpoint.index.layouts import Grid
from shardwise.checkpoint.index.names import (
    BLOCK_SIZE,
    CHECKSUM_ALGORITHM,
    FORMAT,
    FORMAT_VERSION,
    INCREMENTAL_VERSION,
    SEAL_KEY,
    paused_gc,
)
from shardwise.checkpoint.index.records import ObjectRecord, SavedChunk, SaveFacts
from shardwise.metadata import TensorProperties

__all__ = ["FileFacts", "LayoutRecord", "PropertyTable", "encode_index", "seal"]


@dataclass(frozen=True, slots=True)
class FileFacts:
    """A data file as the index records it: its size, the first byte of its data section
    (after the safetensors header), and the block checksums of ``[data_start, size)``."""

    size: int
    data_start: int
    checksums: str


@dataclass(slots=True)
class LayoutRecord:
    """A tensor as a writer describes it: a :class:`Grid` (of file numbers in ``files``), or
    its chunks (one whole-tensor chunk is a ``whole`` layout; checksums are not used). Treated
    as immutable; not frozen, which costs a fifth of a microsecond per field, per tensor."""

    fqn: str
    properties: TensorProperties
    size: tuple[int, ...]
    layout: Grid | Sequence[SavedChunk]


def encode_index(
    save: SaveFacts,
    files: Sequence[tuple[str, FileFacts] | None],
    tensors: Iterable[LayoutRecord],
    objects: Iterable[ObjectRecord],
    block_size: int = BLOCK_SIZE,
    aliases: Mapping[str, str] | None = None,
    digests: Mapping[str, str] | None = None,
) -> bytes:
    """The sealed index (see ``docs/format.md``): ``files`` by number (``None``: a rank that
    wrote no file); grid cells packed in each file as :class:`~.layouts.FileOrder` says, the
    other entries at their begins; ``aliases`` (alias -> tied tensor key) not in ``tensors``.
    With ``digests`` (tensor key -> its chunks' digests, in their order), an incremental index
    (version 5): chunk layouts only, and files that may name sibling checkpoints' files."""
    with paused_gc():
        numbers = {entry[0]: number for number, entry in enumerate(files) if entry is not None}
        properties = PropertyTable()
        rows = []
        digest_rows = []
        last: tuple[TensorProperties | None, int] = (None, -1)  # most rows share the last's
        for tensor in tensors:
            if digests is not None:
                assert not isinstance(tensor.layout, Grid), "an incremental index has no grids"
                digest_rows.append(digests[tensor.fqn])
            if tensor.properties is not last[0]:
                last = (tensor.properties, properties.number(tensor.properties))
            rows.append([tensor.fqn, last[1], list(tensor.size), _layout_row(tensor, numbers)])
        file_rows = [None if entry is None else [entry[0], *astuple(entry[1])] for entry in files]
        checksum = {"algorithm": CHECKSUM_ALGORITHM, "block_size": block_size, "scope": "file"}
        document: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION if digests is None else INCREMENTAL_VERSION,
            "save": asdict(save),
            "checksum": checksum,
            "files": file_rows,
            "properties": properties.table(),
            "tensors": rows,
            "objects": _object_rows(objects, numbers),
        }
        if aliases:
            document["aliases"] = [[alias, aliases[alias]] for alias in sorted(aliases)]
        if digests is not None:
            document["digests"] = digest_rows
        return seal(document)


def _layout_row(tensor: LayoutRecord, numbers: Mapping[str, int]) -> list[Any]:
    layout = tensor.layout
    if isinstance(layout, Grid):
        return ["grid", list(layout.steps), [layout.first, *layout.strides]]
    if len(layout) == 1 and layout[0].sizes == tensor.size and not any(layout[0].offsets):
        return ["whole", numbers[layout[0].file], layout[0].begin]
    return ["chunks", [[list(c.offsets), list(c.sizes), numbers[c.file], c.begin] for c in layout]]


def _object_rows(objects: Iterable[ObjectRecord], numbers: Mapping[str, int]) -> list[list[Any]]:
    """The ``objects`` rows: JSON text, or a blob ``[file, begin, nbytes]``."""
    rows: list[list[Any]] = []
    for item in objects:
        blob = item.blob
        payload = item.text if blob is None else [numbers[blob.file], blob.begin, blob.nbytes]
        rows.append([item.fqn, item.encoding, payload])
    return rows


@dataclass(slots=True)
class PropertyTable:
    """The ``properties`` table being built: one row per distinct tensor properties."""

    rows: dict[tuple[Any, ...], int] = field(default_factory=dict)
    _by_properties: dict[tuple[Any, ...], int] = field(default_factory=dict)

    def number(self, p: TensorProperties) -> int:
        """The row number of ``p`` (added when new)."""
        raw = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        number = self._by_properties.get(raw, -1)
        if number < 0:
            row = (
                dtype_name(p.dtype),
                str(p.layout).removeprefix("torch."),
                p.requires_grad,
                MEMORY_FORMAT_NAMES[p.memory_format],
                p.pin_memory,
            )
            number = self.rows.setdefault(row, len(self.rows))
            self._by_properties[raw] = number
        return number

    def table(self) -> list[list[Any]]:
        return [list(row) for row in self.rows]


def seal(document: Mapping[str, Any]) -> bytes:
    """``document`` (an index without its last key) as compact JSON ending with its seal,
    ``"index_checksum":"<xxh3_64 of every byte before it>"}``."""
    # Raw UTF-8: the reader then refuses every \uD8xx escape outright.
    text = compact(document)
    prefix = text[:-1] + b","
    digest = xxhash.xxh3_64_hexdigest(prefix).encode()
    return prefix + SEAL_KEY + digest + b'"}'
