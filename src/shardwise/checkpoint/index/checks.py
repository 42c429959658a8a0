"""The strict checks the index decoder shares: JSON parsing, field types, byte ranges per
file, tensor tiling, and keys; each failure a :class:`~shardwise.errors.CheckpointFormatError`."""

from __future__ import annotations

import itertools
import re
from typing import Any, NoReturn

from shardwise._codec import strict_json
from shardwise.checkpoint.entries.pyjson import check_plain, json_depth, untag
from shardwise.checkpoint.index.names import MAX_DEPTH, MAX_DIMS, MAX_INT
from shardwise.checkpoint.index.records import ObjectRecord, SavedChunk
from shardwise.checkpoint.index.tiling import check_tiling
from shardwise.errors import CheckpointFormatError

__all__ = ["decode_text", "fail", "load_json_value"]

HEX_DIGITS = re.compile(r"[0-9a-f]*")
# A \uD800-\uDFFF escape (an odd run of backslashes before "u"): the index is written with
# raw UTF-8, so such an escape can only be a lone surrogate, which no Python text can encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_INT_SUFFIX = re.compile(r"[^\x00]*\x00(0|[1-9][0-9]{0,3})(,(0|[1-9][0-9]{0,3}))*")
_INT_PART = re.compile(r"-?(0|[1-9][0-9]{0,18})")


def fail(message: str, key: str | None = None) -> NoReturn:
    raise CheckpointFormatError(message, key=key)


def parse_json(data: bytes | str, what: str, constants: bool = False) -> Any:
    """Strict JSON (:func:`~shardwise._codec.strict_json`): UTF-8, no repeated keys, bounded
    nesting and digits, and no NaN or Infinity unless ``constants`` (stored values may hold
    them: ``float("inf")`` round-trips)."""
    try:
        return strict_json(data, what, constants=constants)
    except ValueError as err:
        fail(str(err))


def load_json_value(text: str, key: str) -> Any:
    """Decode a JSON value stored in the index, refusing nesting deeper than 64 levels."""
    value = parse_json(text, "the stored JSON value", constants=True)
    if json_depth(value) > MAX_DEPTH:
        fail(f"the stored JSON value is nested deeper than {MAX_DEPTH} levels", key)
    return value


def decode_text(record: ObjectRecord, like: object = None) -> Any:
    """The value of an object kept in the index as JSON text (``json``, or ``pyjson`` and
    ``pyjson2``, which tag Python values). A named tuple takes the class of the one at its
    place in ``like``, the value it replaces, when the names agree (``pyjson.untag``).

    Raises:
        CheckpointFormatError: The text is not JSON, is nested too deeply, or its tags are
            malformed (naming the key).
    """
    assert record.text is not None
    try:
        value = load_json_value(record.text, record.fqn)
        if record.encoding == "json":
            check_plain(value)
            return value
        return untag(value, extended=record.encoding == "pyjson2", like=like)
    except CheckpointFormatError as err:
        raise CheckpointFormatError(err.bare_message, key=record.fqn) from err
    except (ValueError, TypeError, OverflowError) as err:
        raise CheckpointFormatError(f"stored JSON value: {err}", key=record.fqn) from err


def int_of(value: object, what: str, key: str | None = None) -> int:
    if type(value) is not int or not 0 <= value < MAX_INT:
        fail(f"{what} must be an integer in [0, 2**62), got {value!r}", key)
    return value


def dims_of(value: object, what: str, key: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > MAX_DIMS:
        fail(f"{what} must be a list of at most {MAX_DIMS} integers in [0, 2**62)", key)
    for v in value:  # a plain loop: the hottest check of a large index
        if type(v) is not int or not 0 <= v < MAX_INT:
            fail(f"{what} must be a list of at most {MAX_DIMS} integers in [0, 2**62)", key)
    return tuple(value)


def text_of(value: object, what: str, key: str | None = None) -> str:
    if not isinstance(value, str):
        fail(f"{what} must be a string, got {type(value).__name__}", key)
    return value


def row_of(value: object, length: int, what: str, key: str | None = None) -> list[Any]:
    if type(value) is not list or len(value) != length:
        fail(f"{what} must be a list of {length} items", key)
    return value


class Ranges:
    """Byte ranges per data file, checked to lie in the file's data section and not to overlap."""

    def __init__(self, files: dict[str, int], starts: dict[str, int]) -> None:
        self.files = files
        self._starts = starts
        self._ranges: dict[str, list[tuple[int, int, str]]] = {name: [] for name in files}

    def add(self, chunk: SavedChunk, key: str) -> None:
        """Add the byte range of ``chunk`` (a file of the index)."""
        if chunk.begin < self._starts[chunk.file]:
            fail(f"a byte range starts at {chunk.begin}, inside the file's header", key)
        size = self.files[chunk.file]
        if chunk.end > size:
            fail(
                f"the byte range [{chunk.begin}, {chunk.end}) ends past the declared size "
                f"{size} of {chunk.file}",
                key,
            )
        if chunk.end > chunk.begin:
            self._ranges[chunk.file].append((chunk.begin, chunk.end, key))

    def add_range(self, file: str, begin: int, end: int, key: str) -> bool:
        """:meth:`add` for ``[begin, end)`` of ``file`` (``0 <= begin <= end``) without
        raising: False, nothing added, where :meth:`add` would raise (for the message)."""
        if end >= MAX_INT or begin < self._starts[file] or end > self.files[file]:
            return False
        if end > begin:
            self._ranges[file].append((begin, end, key))
        return True

    def check(self) -> None:
        """No two ranges of a file overlap."""
        for name, ranges in self._ranges.items():
            ranges.sort()
            for (_, end, first), (begin, _, second) in itertools.pairwise(ranges):
                if begin < end:
                    fail(f"the byte ranges of {first!r} and {second!r} overlap in {name}", second)

    def first_begin(self, name: str) -> int | None:
        """The first byte of the first non-empty range in ``name`` (after :meth:`check`)."""
        ranges = self._ranges[name]
        return ranges[0][0] if ranges else None

    def total(self) -> int:
        """The bytes of every range."""
        return sum(end - begin for ranges in self._ranges.values() for begin, end, _ in ranges)


def check_chunks_tile(fqn: str, size: tuple[int, ...], chunks: list[SavedChunk]) -> None:
    """The chunks of ``fqn`` tile a tensor of ``size`` exactly (a whole chunk: no full check)."""
    only = chunks[0] if len(chunks) == 1 else None
    if only is None or only.sizes != size or len(only.offsets) != len(size) or any(only.offsets):
        try:
            check_tiling(size, [(c.offsets, c.sizes) for c in chunks])
        except ValueError as err:
            fail(f"the saved chunks do not tile the tensor of size {list(size)}: {err}", fqn)


def check_int_suffix(key: str) -> None:
    """A key with int parts: ``<dotted key>\x00<positions>``, the positions of the int parts
    in the ``.``-split key, increasing and inside it."""
    if _INT_SUFFIX.fullmatch(key) is None:
        fail(f"malformed key {key!r}: a NUL may only introduce the positions of int parts")
    name, positions = key.split("\x00")
    numbers = [int(p) for p in positions.split(",")]
    segments = name.split(".")
    if numbers != sorted(set(numbers)) or numbers[-1] >= len(segments):
        fail(f"malformed key {key!r}: int positions out of order or out of range")
    if any(_INT_PART.fullmatch(segments[n]) is None for n in numbers):
        fail(f"malformed key {key!r}: a part marked as an int is not one")


def has_surrogate_escape(data: bytes) -> bool:
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
