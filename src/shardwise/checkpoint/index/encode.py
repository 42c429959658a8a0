"""The writer's side of the index: the sealed bytes of versions 2 and 3
(:func:`encode_index`), and the :class:`Index` a writer holds without parsing what it wrote
(:func:`build_index`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import xxhash

from shardwise._codec import MEMORY_FORMAT_NAMES, dtype_name
from shardwise.checkpoint._json import compact
from shardwise.checkpoint.index.names import (
    ALIASES_VERSION,
    BLOCK_SIZE,
    CHECKSUM_ALGORITHM,
    FORMAT,
    FORMAT_VERSION,
    SEAL_KEY,
    paused_gc,
)
from shardwise.checkpoint.index.records import Index, ObjectRecord, SaveFacts, TensorRecord
from shardwise.metadata import TensorProperties

__all__ = ["PropertyTable", "build_index", "document_of", "encode_index", "object_rows", "seal"]


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


class PropertyTable:
    """The ``properties`` table being built: one row per distinct tensor properties."""

    __slots__ = ("_by_properties", "rows")

    def __init__(self) -> None:
        self.rows: dict[tuple[Any, ...], int] = {}
        self._by_properties: dict[tuple[Any, ...], int] = {}

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


def document_of(
    version: int,
    save: SaveFacts,
    checksum: dict[str, Any],
    files: list[list[Any]],
    properties: PropertyTable,
    tensors: list[list[Any]],
    objects: list[list[Any]],
    aliases: Mapping[str, str],
) -> dict[str, Any]:
    """An index document of versions 2-4 without its seal (keys in the format's order)."""
    document: dict[str, Any] = {
        "format": FORMAT,
        "format_version": version,
        "save": {
            "writer": save.writer,
            "torch": save.torch,
            "world_size": save.world_size,
            "save_id": save.save_id,
            "checkpoint_id": save.checkpoint_id,
        },
        "checksum": checksum,
        "files": files,
        "properties": properties.table(),
        "tensors": tensors,
        "objects": objects,
    }
    if aliases:
        document["aliases"] = [[alias, aliases[alias]] for alias in sorted(aliases)]
    return document


def object_rows(
    objects: Iterable[ObjectRecord], file_numbers: Mapping[str, int], *, with_checksums: bool
) -> list[list[Any]]:
    """The ``objects`` rows (a blob's checksums only when they are per chunk)."""
    rows: list[list[Any]] = []
    for item in objects:
        if item.blob is None:
            rows.append([item.fqn, item.encoding, item.text])
            continue
        blob = item.blob
        stored: list[Any] = [file_numbers[blob.file], blob.begin, blob.nbytes]
        if with_checksums:
            stored.append(blob.checksums)
        rows.append([item.fqn, item.encoding, stored])
    return rows


def _encode(
    save: SaveFacts,
    files: Mapping[str, int],
    tensors: Iterable[TensorRecord],
    objects: Iterable[ObjectRecord],
    block_size: int,
    aliases: Mapping[str, str],
) -> bytes:
    file_numbers = {name: number for number, name in enumerate(files)}
    properties = PropertyTable()
    tensor_rows = []
    for tensor in tensors:
        chunks = [
            [list(c.offsets), list(c.sizes), file_numbers[c.file], c.begin, c.checksums]
            for c in tensor.chunks
        ]
        tensor_rows.append(
            [tensor.fqn, properties.number(tensor.properties), list(tensor.size), chunks]
        )
    document = document_of(
        ALIASES_VERSION if aliases else FORMAT_VERSION,
        save,
        {"algorithm": CHECKSUM_ALGORITHM, "block_size": block_size},
        [[name, size] for name, size in files.items()],
        properties,
        tensor_rows,
        object_rows(objects, file_numbers, with_checksums=True),
        aliases,
    )
    return seal(document)


def seal(document: Mapping[str, Any]) -> bytes:
    """``document`` (a version-2 index without its last key) as compact JSON ending with its
    seal, ``"index_checksum":"<xxh3_64 of every byte before it>"}``."""
    # Raw UTF-8: the reader then refuses every \uD8xx escape outright.
    text = compact(document)
    prefix = text[:-1] + b","
    digest = xxhash.xxh3_64_hexdigest(prefix).encode()
    return prefix + SEAL_KEY + digest + b'"}'
