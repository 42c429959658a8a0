"""DCP's payloads (``torch.save`` archives) decoded without pickled code; object values bounded."""

from __future__ import annotations

import contextlib
import io
import pickle
import struct
import warnings
import zipfile
from collections.abc import Iterable
from typing import Any

import torch

from shardwise.checkpoint.dcp_import._plan import error

__all__ = ["MALFORMED", "decode_dcp_object", "first_line", "torch_load"]

# A malformed pickle fails in an unpickler in many ways; each means "unreadable input".
MALFORMED = (
    pickle.UnpicklingError,
    EOFError,
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    OverflowError,
    struct.error,
)

_ZIP_MAGIC = b"PK\x03\x04"
# Object values nest at most this deep (saving them as JSON recurses once per level).
_MAX_OBJECT_DEPTH = 100
# An object value may expand to at most this many times its payload's size: a pickle can share
# one part from many places (dict keys do, legitimately); a chain of shared lists grows 2**n.
_MAX_OBJECT_EXPANSION = 16

# The records that close a zip archive, as torch.save writes them (always with zip64 ones).
_ZIP_END = struct.Struct("<4s4H2LH")  # signature, disks, entries, directory size, offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, offset of the zip64 end, disks
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")  # ..., directory size and offset last
_ZIP_END_SIGNATURE = b"PK\x05\x06"
_ZIP64_LOCATOR_SIGNATURE = b"PK\x06\x07"
_ZIP64_END_SIGNATURE = b"PK\x06\x06"


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, or its type's name if it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _archive_problem(payload: bytes) -> str | None:
    """Why ``torch.load`` could allocate more than ``payload`` holds, or None.

    torch's reader allocates each record's size as the central directory states it, before
    inflating it, so a small compressed record could claim gigabytes. Python's ``zipfile``
    reads the same central directory as torch's (miniz) only if it sits right before the end
    records, as torch.save writes it; that layout is required, then uncompressed records that
    together fit in the payload.
    """
    end = len(payload) - _ZIP_END.size
    if end < 0 or not payload.startswith(_ZIP_END_SIGNATURE, end):
        return "it does not end with a zip end record"
    *_, directory_size, directory_offset, comment_size = _ZIP_END.unpack_from(payload, end)
    if comment_size:
        return "its zip end record has a comment"
    records_start = end
    locator = end - _ZIP64_LOCATOR.size
    if locator >= 0 and payload.startswith(_ZIP64_LOCATOR_SIGNATURE, locator):
        zip64_end = _ZIP64_LOCATOR.unpack_from(payload, locator)[2]
        if zip64_end != locator - _ZIP64_END.size or not payload.startswith(
            _ZIP64_END_SIGNATURE, zip64_end
        ):
            return "its zip64 end record is not right before its locator"
        *_, directory_size, directory_offset = _ZIP64_END.unpack_from(payload, zip64_end)
        records_start = zip64_end
    if directory_offset + directory_size != records_start:
        return "its central directory is not right before its end records"
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            members = archive.infolist()
    except (
        zipfile.BadZipFile,
        NotImplementedError,  # a record needs a newer zip version
        ValueError,
        EOFError,
        OSError,
        struct.error,
    ) as err:
        return f"unreadable zip archive: {first_line(err)}"
    total = 0
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED or member.compress_size != member.file_size:
            return f"its record {member.filename!r} is compressed"
        total += member.file_size
    if total > len(payload):
        return f"its records claim {total} bytes, more than its {len(payload)}"
    return None


def torch_load(payload: bytes, fqn: str, path: str, safe: Iterable[type] = ()) -> Any:
    """Decode a ``torch.save`` payload with ``weights_only=True`` (no code runs)."""
    problem = _archive_problem(payload)
    if problem is not None:
        raise error(fqn, f"its DCP payload is not a torch.save archive ({problem})", path)
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    context = safe_globals(list(safe)) if safe_globals is not None else contextlib.nullcontext()
    try:
        # torch warns about odd payloads (another pickle protocol) and then reads them or
        # fails; either way the warning is noise next to this reader's verdict.
        with context, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except (*MALFORMED, RuntimeError) as err:  # RuntimeError: torch's archive reader
        raise error(
            fqn,
            f"its DCP payload cannot be read without running pickled code ({first_line(err)})",
            path,
        ) from err


def _check_json_value(value: object, budget: int, fqn: str, path: str) -> None:
    """Check that ``value`` can be stored as a JSON value of bounded depth and size: walked
    without recursion, each item charged about its JSON bytes against ``budget``, so the walk
    stops early on a value that expands past it."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > _MAX_OBJECT_DEPTH:
            raise error(fqn, f"its value nests deeper than {_MAX_OBJECT_DEPTH} levels", path)
        budget -= 1
        not_json = None
        if isinstance(item, str):
            budget -= len(item)
        elif isinstance(item, int):
            budget -= item.bit_length() // 8
        elif isinstance(item, (list, tuple)):
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    not_json = f"a dict with a key of type {type(key).__name__}"
                    break
                budget -= len(key)
                stack.append((child, depth + 1))
        elif not (item is None or isinstance(item, float)):
            not_json = f"a {type(item).__name__}"
        if not_json is not None:
            what = not_json if item is value else f"a {type(value).__name__} containing {not_json}"
            raise error(
                fqn,
                f"holds {what}, which a shardwise checkpoint stores only with pickle; "
                "convert-dcp does not pickle",
                path,
            )
        if budget < 0:
            raise error(
                fqn,
                f"its value is more than {_MAX_OBJECT_EXPANSION} times larger than its payload "
                "(the payload repeats shared parts)",
                path,
            )


def decode_dcp_object(payload: bytes, fqn: str, path: str) -> Any:
    """The object value ``payload`` holds: raw bytes as they are, else a ``torch.save``
    archive decoded into ``bytes``, ``io.BytesIO`` or a bounded JSON value."""
    if not payload.startswith(_ZIP_MAGIC):
        return payload  # raw bytes (a planner that does not torch.save its objects)
    # DCP's default planner stores every non-tensor value as torch.save(value).
    value = torch_load(payload, fqn, path, safe=[io.BytesIO])
    if isinstance(value, (bytes, io.BytesIO)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    _check_json_value(value, _MAX_OBJECT_EXPANSION * len(payload), fqn, path)
    return value
