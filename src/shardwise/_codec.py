"""The JSON codec of shardwise's metadata: name tables for torch's enums and strict readers.

Shared by the metadata of sharded tensors (:mod:`shardwise.metadata`) and the checkpoint
index (:mod:`shardwise.checkpoint`), so that both spell a dtype, a layout and a memory format
the same way and reject malformed input with the same :class:`MetadataFormatError` messages.
Pure: imports only torch and the error classes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardwise._json import strict_json
from shardwise.errors import MetadataFormatError

__all__ = [
    "DTYPES",
    "JSON_VERSION",
    "LAYOUTS",
    "MEMORY_FORMATS",
    "MEMORY_FORMAT_NAMES",
    "check_bool",
    "check_keys",
    "dtype_from_name",
    "dtype_name",
    "int_list",
    "lookup",
    "strict_json",
    "unwrap",
    "wrap",
]

#: Version of the JSON form written by :func:`wrap`; :func:`unwrap` rejects any other.
JSON_VERSION = 1

# Every dtype torch exposes is listed under its canonical name (``str(dtype)`` without
# ``torch.``), so aliases such as ``torch.float`` map to one name.
DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}
LAYOUTS: dict[str, torch.layout] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.layout)
}
MEMORY_FORMATS: dict[str, torch.memory_format] = {
    name: value
    for name, value in vars(torch).items()
    if isinstance(value, torch.memory_format) and name != "legacy_contiguous_format"
}
MEMORY_FORMAT_NAMES: dict[torch.memory_format, str] = {
    value: name for name, value in MEMORY_FORMATS.items()
}


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical JSON name of ``dtype`` (``torch.float`` → ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> torch.dtype:
    """The dtype called ``name`` in the JSON form; :class:`MetadataFormatError` if unknown."""
    if not isinstance(name, str) or name not in DTYPES:
        raise MetadataFormatError(f"unknown dtype name {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def lookup(table: Mapping[str, Any], name: object, what: str) -> Any:
    """``table[name]``, or :class:`MetadataFormatError` naming ``what`` and the known names."""
    if not isinstance(name, str) or name not in table:
        raise MetadataFormatError(f"unknown {what} {name!r}; expected one of {sorted(table)}")
    return table[name]


def check_keys(data: object, required: Sequence[str], what: str) -> Mapping[str, Any]:
    """``data`` as a mapping with exactly the keys ``required`` (no unknown, none missing)."""
    if not isinstance(data, Mapping):
        raise MetadataFormatError(f"{what} must be a JSON object, got {type(data).__name__}")
    keys = set(data)
    unknown = keys - set(required)
    if unknown:
        raise MetadataFormatError(f"unknown keys {sorted(unknown)} in {what}")
    missing = [key for key in required if key not in keys]
    if missing:
        raise MetadataFormatError(f"missing keys {missing} in {what}")
    return data


def int_list(value: object, what: str) -> list[int]:
    """``value`` as a list of integers (``bool`` is not one)."""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise MetadataFormatError(f"{what} must be a list of integers, got {value!r}")
    return list(value)


def check_bool(value: object, what: str) -> bool:
    """``value`` if it is ``true`` or ``false``."""
    if not isinstance(value, bool):
        raise MetadataFormatError(f"{what} must be true or false, got {value!r}")
    return value


def wrap(kind: str, body: dict[str, Any]) -> str:
    """The versioned JSON document of ``body``: ``{"kind", "version", "value"}``."""
    return json.dumps({"kind": kind, "version": JSON_VERSION, "value": body}, sort_keys=True)


def unwrap(text: str | bytes, kind: str) -> Any:
    """The ``value`` of a document written by :func:`wrap` for ``kind``, checked strictly."""
    try:
        document = strict_json(text, f"{kind} JSON")
    except ValueError as err:
        raise MetadataFormatError(str(err)) from None
    document = check_keys(document, ("kind", "version", "value"), f"{kind} JSON document")
    if document["kind"] != kind:
        raise MetadataFormatError(f"expected a {kind} JSON document, got kind {document['kind']!r}")
    version = document["version"]
    # ``true == 1`` and ``1.0 == 1`` in Python: only the integer itself is version 1.
    if type(version) is not int or version != JSON_VERSION:
        raise MetadataFormatError(
            f"unsupported {kind} JSON version {version!r}; "
            f"this shardwise reads version {JSON_VERSION}"
        )
    return document["value"]
