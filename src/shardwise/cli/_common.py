"""What the commands share that needs neither torch nor the checkpoint code: exit codes, the
usage error, the text of keys and counts, ``--json`` output and ``--storage-options``. (The
commands' view of a checkpoint is in :mod:`~shardwise.cli._checkpoint`; which exception ends
in which exit code is :func:`shardwise.cli._app.exit_code`.)"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from shardwise._json import strict_json

#: Success.
EXIT_OK = 0
#: ``verify`` found a problem, or ``diff`` a difference.
EXIT_FAILED = 1
#: Bad usage: an argparse error, or an option value refused once the command runs.
EXIT_USAGE = 2
#: Invalid or corrupt input: no checkpoint there, a malformed index, a corrupt block, a DCP
#: directory that cannot be converted safely, ...
EXIT_INPUT = 3
#: The storage failed: no credentials, an unreachable endpoint, permission denied, a full disk.
EXIT_STORAGE = 4

# How many keys a problem line names before it says "and N more".
_MAX_NAMED_KEYS = 5


class UsageError(Exception):
    """An option value a command refuses once it runs (a ``--prefix`` no key has, a
    ``--config`` that is not a JSON object): exit code 2, as argparse's own usage errors."""


def print_json(value: object, indent: int | None = None) -> None:
    """``value`` as one strict JSON document on stdout (NaN and infinities refused: a
    command's JSON holds none)."""
    print(json.dumps(value, indent=indent, allow_nan=False))


def _count(number: int, noun: str, plural: str | None = None) -> str:
    """``"1 tensor"``, ``"2 tensors"``, ``"2 entries"`` (with ``plural="entries"``)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def _keys_text(keys: Sequence[str]) -> str:
    named = ", ".join(repr(key) for key in keys[:_MAX_NAMED_KEYS])
    rest = len(keys) - _MAX_NAMED_KEYS
    return f"{named} and {rest} more" if rest > 0 else named


def _printable(text: str) -> str:
    """``text`` as it is when printable, else its escaped repr: a checkpoint's keys and
    strings come from strangers, and must not break lines or drive the terminal."""
    return text if text.isprintable() else repr(text)


def parse_storage_options(text: str) -> dict[str, Any]:
    """The ``--storage-options`` value: a JSON object, given to fsspec as ``storage_options``.

    Raises:
        ValueError: ``text`` is not JSON, or not a JSON object.
    """
    try:
        value = strict_json(text, "--storage-options")
    except ValueError as err:
        raise ValueError(f"invalid JSON {text[:80]!r}: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{text!r} is a JSON {type(value).__name__}, not an object: give fsspec's "
            """storage options as an object, e.g. '{"anon": true}'"""
        )
    return value
