"""The one strict JSON reader for every document read from a file or another process.

Needs neither torch nor the rest of shardwise, so the command line's argument parsing can use
it before anything heavy is imported."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["strict_json"]


class _RefusedError(ValueError):
    """A fault :func:`strict_json` found while parsing (its message is final)."""


def strict_json(
    data: str | bytes | bytearray | memoryview, what: str, *, constants: bool = False
) -> Any:
    """``data`` parsed as strict JSON, ``what`` naming it in errors: one parser for every
    JSON document read from a file or another process.

    Bytes must be UTF-8 (decoded here, strictly: ``json.loads`` would also take UTF-16, UTF-32
    and a byte order mark); no object repeats a key (parsers keep either value); no NaN or
    Infinity unless ``constants`` (stored Python values may hold them); nesting deeper than
    the parser's recursion limit, and integers of more digits than Python converts, are
    refused rather than raised as ``RecursionError``.

    Raises:
        ValueError: Saying which of that does not hold, starting with ``what``.
    """
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} is not UTF-8 text, so it is not valid JSON ({err})") from None

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(pairs)
        if len(result) == len(pairs):
            return result
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RefusedError(f"{what} repeats the key {key!r} in one JSON object")
            seen.add(key)
        raise AssertionError("unreachable: fewer keys than pairs")

    def constant(name: str) -> Any:
        raise _RefusedError(f"{what} contains {name}, which is not JSON")

    hook = None if constants else constant
    try:
        return json.loads(text, object_pairs_hook=unique, parse_constant=hook)
    except _RefusedError:
        raise
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None
    # JSONDecodeError is a ValueError; so is an integer of more digits than Python converts.
    except ValueError as err:
        raise ValueError(f"{what} is not valid JSON: {err}") from None
