"""The fields of the index, each decoded and checked (see ``docs/format.md``, *Validation*);
tensor layouts are decoded in :mod:`.decode`."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from shardwise._codec import DTYPES, LAYOUTS, MEMORY_FORMATS
from shardwise.checkpoint.index.checks import (
    Ranges,
    check_int_suffix,
    dims_of,
    fail,
    int_of,
    row_of,
    text_of,
)
from shardwise.checkpoint.index.names import (
    CHECKSUM_ALGORITHM,
    DATA_DIR,
    ENCODINGS,
    MAX_BLOCK,
    MAX_DIMS,
    MAX_INT,
    MIN_BLOCK,
    QUANTIZED,
    TEXT_ENCODINGS,
    is_data_file_name,
)
from shardwise.checkpoint.index.records import ObjectRecord, SaveFacts, TensorRecord
from shardwise.checkpoint.planning.planner import SavedChunk
from shardwise.metadata import TensorProperties

__all__ = [
    "decode_aliases",
    "decode_checksum",
    "decode_file_name",
    "decode_objects",
    "decode_properties",
    "decode_save_facts",
    "decode_tensor_head",
    "expected_keys",
]

_SAVE_KEYS = ("writer", "torch", "world_size", "save_id", "checkpoint_id")
_SAVE_ID = re.compile(r"[0-9a-f]{16}")
_CHECKSUM_KEYS = ("algorithm", "block_size", "scope")
_KEYS = ("format", "format_version", "save", "checksum", "files", "properties", "tensors")


def expected_keys(with_aliases: bool) -> tuple[str, ...]:
    """The keys of an index, in order (``aliases``, when there are ties, before the seal)."""
    return (*_KEYS, "objects", *(["aliases"] if with_aliases else []), "index_checksum")


def decode_save_facts(save: object) -> SaveFacts:
    """The ``save`` object: writer, torch, world size, save id, checkpoint id."""
    if type(save) is not dict or tuple(save) != _SAVE_KEYS:
        fail(f"the checkpoint index's save facts must have the keys {list(_SAVE_KEYS)}")
    save_id = text_of(save["save_id"], "save_id")
    if _SAVE_ID.fullmatch(save_id) is None:
        fail(f"save_id must be 16 hex digits, got {save_id!r}")
    checkpoint_id = save["checkpoint_id"]
    if checkpoint_id is not None:
        text_of(checkpoint_id, "checkpoint_id")
    world_size = int_of(save["world_size"], "world_size")
    if world_size < 1:
        fail("world_size must be at least 1")
    return SaveFacts(
        text_of(save["writer"], "writer"),
        text_of(save["torch"], "torch"),
        world_size,
        save_id,
        checkpoint_id,
    )


def decode_checksum(checksum: object) -> int:
    """The ``checksum`` object's block size, bounded; its keys, algorithm and scope checked."""
    keys = _CHECKSUM_KEYS
    if type(checksum) is not dict or tuple(checksum) != keys:
        fail(f"the checkpoint index's checksum must have the keys {', '.join(keys)}")
    if checksum["algorithm"] != CHECKSUM_ALGORITHM:
        fail(
            f"unsupported checksum algorithm {checksum['algorithm']!r}; this shardwise uses "
            f"{CHECKSUM_ALGORITHM}"
        )
    block_size = int_of(checksum["block_size"], "block_size")
    if not MIN_BLOCK <= block_size <= MAX_BLOCK:
        fail(f"block_size {block_size} is outside [{MIN_BLOCK}, {MAX_BLOCK}]")
    if checksum["scope"] != "file":
        fail(f"unsupported checksum scope {checksum['scope']!r}; this version has 'file'")
    return block_size


def decode_file_name(name: object, files: Mapping[str, int]) -> str:
    """A data file's name: the writer's pattern, not listed before."""
    name = text_of(name, "a data file name")
    if not name.startswith(f"{DATA_DIR}/") or not is_data_file_name(name[5:]):
        fail(f"{name!r} is not a data file name of this format (data/rank-*.safetensors)")
    if name in files:
        fail(f"the data file {name!r} is listed twice")
    return name


def decode_properties(rows: object) -> list[TensorProperties]:
    """The ``properties`` table: rows of known dtype, layout and memory-format names, and two
    booleans."""
    if type(rows) is not list:
        fail("properties must be a list")
    table = []
    for row in rows:
        dtype, layout, requires_grad, memory_format, pin_memory = row_of(
            row, 5, "a properties entry"
        )
        if (
            not isinstance(dtype, str)
            or dtype not in DTYPES
            or not isinstance(layout, str)
            or layout not in LAYOUTS
            or not isinstance(memory_format, str)
            or memory_format not in MEMORY_FORMATS
            or type(requires_grad) is not bool
            or type(pin_memory) is not bool
        ):
            fail(f"malformed or unknown tensor properties {row!r}")
        table.append(
            TensorProperties(
                dtype=DTYPES[dtype],
                layout=LAYOUTS[layout],
                requires_grad=requires_grad,
                memory_format=MEMORY_FORMATS[memory_format],
                pin_memory=pin_memory,
            )
        )
    return table


def decode_tensor_head(
    row: object, properties: list[TensorProperties], seen: Mapping[str, object]
) -> tuple[str, TensorProperties, tuple[int, ...], Any]:
    """A ``tensors`` row's key, properties and size, checked (the key new to ``seen``), and
    its last field (chunks or layout), unchecked. The hot path of a reader: checks written
    out."""
    if type(row) is list and len(row) == 4:
        fqn, number, size_row, last = row
    else:
        fqn, number, size_row, last = row_of(row, 4, "a tensors entry")  # raises
    if type(fqn) is not str:
        fail(f"a key must be a string, got {type(fqn).__name__}")
    if "\x00" in fqn:
        check_int_suffix(fqn)
    if fqn in seen:
        fail("the key appears twice", fqn)
    if type(number) is not int or not 0 <= number < len(properties):
        fail(f"property index {number!r} does not exist", fqn)
    props = properties[number]
    if props.dtype in QUANTIZED:
        fail(
            f"{props.dtype} is a quantized dtype, which a checkpoint cannot hold (its "
            "scale and zero point are not stored)",
            fqn,
        )
    if type(size_row) is not list or len(size_row) > MAX_DIMS:
        dims_of(size_row, "size", fqn)  # raises, naming the fault
    for dim in size_row:  # dims_of written out
        if type(dim) is not int or not 0 <= dim < MAX_INT:
            dims_of(size_row, "size", fqn)
    if math.prod(size_row) * props.dtype.itemsize >= MAX_INT:
        fail(f"the size {size_row} is too large", fqn)
    return fqn, props, tuple(size_row), last


def file_of(number: object, names: Sequence[str | None], key: str) -> str:
    """The name of file ``number`` of the index, which must exist and hold something."""
    if type(number) is not int or not 0 <= number < len(names):
        fail(f"file index {number!r} does not exist", key)
    name = names[number]
    if name is None:
        fail(f"file index {number} names a rank that wrote no data file (null)", key)
    return name


def decode_objects(
    rows: object,
    tensors: dict[str, TensorRecord],
    names: Sequence[str | None],
    ranges: Ranges,
) -> dict[str, ObjectRecord]:
    """The ``objects`` rows: JSON text, or a blob ``[file, begin, nbytes]`` (its checksums
    are its file's)."""
    objects: dict[str, ObjectRecord] = {}
    if type(rows) is not list:
        fail("objects must be a list")
    for row in rows:
        fqn, encoding, payload = row_of(row, 3, "an objects entry")
        fqn = text_of(fqn, "a key")
        if "\x00" in fqn:
            check_int_suffix(fqn)
        if fqn in tensors or fqn in objects:
            fail("the key appears twice", fqn)
        if encoding not in ENCODINGS:
            fail(f"unknown object encoding {encoding!r}", fqn)
        if encoding in TEXT_ENCODINGS:
            objects[fqn] = ObjectRecord(fqn, encoding, text=text_of(payload, "a JSON value", fqn))
            continue
        file, begin, nbytes = row_of(payload, 3, "a stored object", fqn)
        name = file_of(file, names, fqn)
        begin, nbytes = int_of(begin, "begin", fqn), int_of(nbytes, "nbytes", fqn)
        if begin + nbytes >= MAX_INT:
            fail("malformed stored object", fqn)
        blob = SavedChunk((), (), name, begin, begin + nbytes)
        ranges.add(blob, fqn)
        objects[fqn] = ObjectRecord(fqn, encoding, blob=blob)
    return objects


def decode_aliases(
    rows: object, tensors: dict[str, TensorRecord], objects: dict[str, ObjectRecord]
) -> dict[str, str]:
    """The validated ``aliases`` table: each alias a new key, each target a saved tensor.
    Each alias is added to ``tensors`` with its target's record (call after the byte ranges
    are checked: they share the bytes)."""
    if type(rows) is not list or not rows:
        fail("aliases must be a non-empty list (an index without ties has no aliases key)")
    aliases: dict[str, str] = {}
    for row in rows:
        alias, target = row_of(row, 2, "an aliases entry")
        alias = text_of(alias, "a key")
        target = text_of(target, "a key", alias)
        if "\x00" in alias:
            check_int_suffix(alias)
        if alias in tensors or alias in objects or alias in aliases:
            fail("the key appears twice", alias)
        if target not in tensors:
            fail(f"it is tied to {target!r}, which is not a saved tensor", alias)
        aliases[alias] = target
    for alias, target in aliases.items():
        record = tensors[target]
        tensors[alias] = TensorRecord(alias, record.properties, record.size, record.chunks)
    return aliases
