"""The rules of the JSON bodies of the checkpoint metadata classes, apart from the classes.

Readers reject what breaks them with :class:`~shardwise.errors.CheckpointFormatError`; writers
refuse it too (``TypeError`` for a value of the wrong type).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from shardwise._codec import check_keys, strict_json
from shardwise.errors import CheckpointFormatError, MetadataFormatError

__all__ = [
    "INDEX_FORMAT",
    "INDEX_VERSION",
    "check_chunk_bounds",
    "check_json_value",
    "check_same_ndim",
    "format_errors",
    "in_entry",
    "index_body",
    "load_json",
    "optional_str",
    "plain_ints",
    "size_of",
    "storage_info_to_json",
]

#: Value of the ``format`` field of a ``Metadata`` document.
INDEX_FORMAT = "shardwise-checkpoint"
#: Version of the document ``Metadata.to_json`` writes; ``Metadata.from_json`` rejects others.
INDEX_VERSION = 1
# The keys of a ``Metadata`` document, in the order written.
_INDEX_KEYS = (
    "format",
    "format_version",
    "version",
    "storage_meta",
    "planner_data",
    "storage_data",
    "state_dict_metadata",
)


@contextlib.contextmanager
def format_errors() -> Iterator[None]:
    """Report the shared JSON helpers' MetadataFormatError as a CheckpointFormatError."""
    try:
        yield
    except CheckpointFormatError:
        raise
    except MetadataFormatError as err:
        raise CheckpointFormatError(str(err)) from err


@contextlib.contextmanager
def in_entry(fqn: str) -> Iterator[None]:
    """Name the entry ``fqn`` in errors raised while reading or writing it."""
    try:
        yield
    except CheckpointFormatError as err:
        raise CheckpointFormatError(str(err), key=fqn) from err


def size_of(values: list[int], what: str) -> torch.Size:
    """``values`` (ints read from JSON) as a ``torch.Size``, refused if any is negative."""
    return torch.Size(plain_ints(values, what))


def plain_ints(values: Sequence[int], what: str) -> list[int]:
    """``values`` as a list of non-negative ints: what the JSON readers accept."""
    result = [int(v) for v in values]
    if any(v < 0 for v in result):
        raise CheckpointFormatError(f"{what} must not be negative, got {result}")
    return result


def check_same_ndim(offsets: Sequence[int], sizes: Sequence[int]) -> None:
    """A chunk's offsets and sizes have one entry per dim each."""
    if len(offsets) != len(sizes):
        raise CheckpointFormatError(
            f"ChunkStorageMetadata offsets {list(offsets)} and sizes {list(sizes)} have "
            "different lengths"
        )


def check_chunk_bounds(
    size: Sequence[int], chunks: Iterable[tuple[Sequence[int], Sequence[int]]]
) -> None:
    """Every chunk ``(offsets, sizes)`` has the dims of ``size`` and, unless empty, lies in it."""
    for offsets, sizes in chunks:
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise CheckpointFormatError(
                f"chunk at offsets {list(offsets)} with sizes {list(sizes)} does not have the "
                f"{len(size)} dims of a tensor of size {list(size)}"
            )
        if math.prod(sizes) == 0:
            continue  # zero-volume chunks are exempt from bounds, as in ShardMetadata
        for dim, (offset, length, extent) in enumerate(zip(offsets, sizes, size, strict=True)):
            if offset + length > extent:
                raise CheckpointFormatError(
                    f"chunk at offsets {list(offsets)} with sizes {list(sizes)} exceeds dim "
                    f"{dim} of a tensor of size {list(size)}"
                )


def check_json_value(value: object, where: str) -> None:
    """Refuse a value that JSON would not give back unchanged (a tuple, NaN, a non-str key...),
    naming the path to the first such part (``where['a'][0]: ...``)."""
    found = _problem(value)
    if found is not None:
        path, message = found
        raise TypeError(f"{where}{''.join(reversed(path))}: {message}")


def _problem(value: object) -> tuple[list[str], str] | None:
    """The path to the first part JSON would change (innermost step first) and what is wrong
    with it; the path is built only on failure, so a good value costs no strings."""
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else ([], f"{value!r} has no JSON form")
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _problem(item)
            if found is not None:
                found[0].append(f"[{i}]")
                return found
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return [], f"JSON object keys must be strings, got {key!r}"
            found = _problem(item)
            if found is not None:
                found[0].append(f"[{key!r}]")
                return found
        return None
    return [], (
        f"{type(value).__name__} is not JSON-able (use None, bool, int, float, str, list or "
        "dict with str keys)"
    )


def load_json(text: str | bytes, what: str) -> Any:
    """``text`` parsed as strict JSON (:func:`~shardwise._codec.strict_json`); ``what`` names
    it in errors."""
    try:
        return strict_json(text, what)
    except ValueError as err:
        raise CheckpointFormatError(str(err)) from None


def optional_str(value: object, what: str) -> str | None:
    """``value`` read from JSON, which must be a string or null."""
    if value is not None and not isinstance(value, str):
        raise CheckpointFormatError(f"{what} must be a string or null, got {value!r}")
    return value


def storage_info_to_json(info: object, where: str) -> Any:
    """A storage info of ``Metadata.storage_data`` as JSON: a JSON dict, or its ``to_dict()``."""
    to_dict = getattr(info, "to_dict", None)
    value = to_dict() if callable(to_dict) else info
    if not isinstance(value, dict):
        raise TypeError(
            f"{where}: storage info must be a dict or have a to_dict() method, got "
            f"{type(info).__name__}"
        )
    check_json_value(value, where)
    return value


def index_body(data: object) -> Mapping[str, Any]:
    """The fields of a parsed ``Metadata`` document, once its format, version and keys are right.

    Raises:
        CheckpointFormatError: Not a shardwise checkpoint index, an unsupported format
            version, or a missing or unknown key.
    """
    if not isinstance(data, Mapping):
        raise CheckpointFormatError(
            f"a checkpoint index must be a JSON object, got {type(data).__name__}"
        )
    if data.get("format") != INDEX_FORMAT:
        raise CheckpointFormatError(
            f"not a shardwise checkpoint index: format is {data.get('format')!r}, "
            f"expected {INDEX_FORMAT!r}"
        )
    version = data.get("format_version")
    # Checked before the other fields: a later version may have other fields.
    if type(version) is not int or version != INDEX_VERSION:
        raise CheckpointFormatError(
            f"unsupported checkpoint format version {version!r}; this shardwise reads "
            f"version {INDEX_VERSION} (a newer shardwise may read it)"
        )
    with format_errors():
        return check_keys(data, _INDEX_KEYS, "checkpoint index")
