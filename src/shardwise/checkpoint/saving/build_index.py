"""The coordinator's index (``docs/format.md``, *Writing the index*), built from the plan's
layouts and each rank's file facts in O(keys + files + entries outside grids), never
enumerating a grid's cells."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any, NamedTuple

from shardwise._boxes import origin
from shardwise.checkpoint.entries.items import ObjectValue
from shardwise.checkpoint.index import (
    TEXT_ENCODINGS,
    FileFacts,
    Index,
    LayoutRecord,
    ObjectRecord,
    SaveFacts,
    TensorRecord,
    decode_index,
    encode_index,
)
from shardwise.checkpoint.index.data_file import bytes_key, chunk_key
from shardwise.checkpoint.index.layouts import Grid, LayoutChunks
from shardwise.checkpoint.index.records import SavedChunk
from shardwise.checkpoint.planning.tables import CoordinatorPlan
from shardwise.errors import CheckpointError
from shardwise.metadata import TensorProperties

__all__ = ["build_index"]


class _DataFile(NamedTuple):
    """The ``"file"`` of a rank's file facts: ``[name, size]`` in their JSON."""

    name: str
    size: int


def _data_file(part: Mapping[str, Any]) -> _DataFile:
    return _DataFile(*part["file"])


def _named_facts(part: Mapping[str, Any]) -> tuple[str, FileFacts] | None:
    """A rank's data file by name (``None``: the rank wrote none)."""
    if "file" not in part:
        return None
    file = _data_file(part)
    return file.name, FileFacts(file.size, part["data_start"], part["checksums"])


def build_index(
    planned: CoordinatorPlan,
    objects: Mapping[str, ObjectValue],
    written: Sequence[Mapping[str, Any]],
    facts: SaveFacts,
    base: Mapping[str, FileFacts] | None = None,
) -> tuple[bytes, Index]:
    """The sealed index of this save and the index it reads back as.

    Args:
        objects: The coordinator's objects (blobs are in its file).
        written: Each rank's file facts (:func:`~.writer.write_data_file`), in group-rank order;
            in an incremental save also its chunks' ``digests`` and ``references``.
        facts: Who wrote the checkpoint.
        base: An incremental save's (version 5): the facts of every data file of the
            checkpoint it builds on, by the name the new index gives them (``{}``: none).

    Raises:
        CheckpointError: The index does not read back as built, or the ranks' files do not
            hold the grid cells the plan gives them (a bug, never committed).
    """
    plan = planned.plan
    incremental = base is not None
    files = [_named_facts(part) for part in written]
    where: dict[str, tuple[str, int]] = {}
    digests: dict[str, str] = {}
    for part in written:
        for key, begin in part.get("begins", {}).items():
            where[key] = (_data_file(part).name, begin)
        for key, (file, begin) in part.get("references", {}).items():
            where[key] = (file, begin)
        digests.update(part.get("digests", {}))
    if base is not None:
        used = sorted({file for file, _ in where.values()}.difference(e[0] for e in files if e))
        files += [(name, base[name]) for name in used]
    tensor_digests: dict[str, str] = {}

    def stored(
        key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], nbytes: int
    ) -> SavedChunk:
        file, begin = where[key]
        return SavedChunk(offsets, sizes, file, begin, begin + nbytes)

    records = []
    properties: dict[tuple[Any, ...], TensorProperties] = {}  # few distinct ones
    # Consecutive rows mostly share properties: comparing two small dicts beats the lookup.
    last: tuple[dict[str, Any] | None, TensorProperties | None] = (None, None)
    grid_bytes = 0
    aliases, grids, whole = planned.aliases, plan.grids, plan.whole
    for key, row in plan.rows.items():
        if key in aliases:
            continue
        layout: Grid | tuple[SavedChunk, ...]
        grid = grids.get(key)
        if grid is not None and not incremental:
            layout = grid
            grid_bytes += math.prod(row.size) * row.itemsize
        else:
            if grid is not None:  # an incremental index lists every chunk
                boxes = [grid.box(grid.cell_at(n)) for n in range(grid.num_cells)]
            elif key in whole:
                boxes = [(origin(len(row.size)), row.size)]
            else:
                boxes = sorted(box for box, _ in plan.chunks[key])
            layout = tuple(
                stored(chunk_key(key, o), o, s, math.prod(s) * row.itemsize) for o, s in boxes
            )
            if incremental:
                tensor_digests[key] = "".join(digests[chunk_key(key, o)] for o, _ in boxes)
        if row.properties == last[0]:
            props = last[1]
        else:
            known = tuple(row.properties.items())
            props = properties.get(known)
            if props is None:
                props = properties[known] = TensorProperties.from_dict(row.properties)
            last = (row.properties, props)
        assert props is not None
        records.append(LayoutRecord(key, props, row.size, layout))
    records.sort(key=attrgetter("fqn"))
    object_records = []
    for fqn, value in objects.items():
        if value.encoding in TEXT_ENCODINGS:
            object_records.append(ObjectRecord(fqn, value.encoding, text=value.payload.decode()))
        else:
            blob = stored(bytes_key(fqn), (), (), len(value.payload))
            object_records.append(ObjectRecord(fqn, value.encoding, blob=blob))
    object_records.sort(key=attrgetter("fqn"))
    if sum(part.get("grid_bytes", 0) for part in written) != grid_bytes:
        raise CheckpointError(
            "the data files of this save do not hold the grid cells its plan gives them"
        )
    data = encode_index(
        facts,
        files,
        records,
        object_records,
        aliases=planned.aliases,
        digests=tensor_digests if incremental else None,
    )
    index = decode_index(data)
    _check_read_back(index, files, records, object_records, planned.aliases, written)
    if index.digests != tensor_digests:
        raise CheckpointError("the index of this save does not read back as built")
    return data, index


def _check_read_back(
    index: Index,
    files: Sequence[tuple[str, FileFacts] | None],
    records: Sequence[LayoutRecord],
    objects: Sequence[ObjectRecord],
    aliases: Mapping[str, str],
    written: Sequence[Mapping[str, Any]],
) -> None:
    """What is committed must read back as built (the decoder validated the rest; a grid by its
    rule), and each file's grid cells must end where its other entries begin, as a reader checks."""
    named = dict(entry for entry in files if entry is not None)
    same = (
        index.files == {name: facts.size for name, facts in named.items()}
        and index.data_starts == {name: facts.data_start for name, facts in named.items()}
        and index.file_checksums == {name: facts.checksums for name, facts in named.items()}
        and index.aliases == dict(aliases)
        and index.objects == {record.fqn: record for record in objects}
        and len(index.tensors) == len(records) + len(aliases)
    )
    equal: set[tuple[int, int]] = set()
    same = same and all(_same(index.tensors.get(record.fqn), record, equal) for record in records)
    for part in written:
        if "file" in part:
            begins = part["begins"].values()
            end = min(begins) if begins else _data_file(part).size
            same = same and part["data_start"] + part["grid_bytes"] == end
    if not same:
        raise CheckpointError("the index of this save does not read back as built")


def _same(found: TensorRecord | None, record: LayoutRecord, equal: set[tuple[int, int]]) -> bool:
    """``found`` (decoded) is ``record`` (built). ``equal`` holds the pairs of properties
    found equal: few distinct objects on each side, so each pair is compared once."""
    if found is None or found.size != record.size:
        return False
    pair = (id(found.properties), id(record.properties))
    if pair not in equal:
        if found.properties != record.properties:
            return False
        equal.add(pair)
    if isinstance(record.layout, Grid):
        return isinstance(found.chunks, LayoutChunks) and found.chunks.grid == record.layout
    return tuple(found.chunks) == tuple(record.layout)
