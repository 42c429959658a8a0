"""A series on storage: the step directories under its root, their record files, one listing.

Layout (``docs/manager.md``)::

    <root>/step-00000100/shardwise.json          the checkpoint's index: "committed"
    <root>/step-00000100/shardwise-step.json     the step record (step, time, metrics), written
                                                 before the save starts
    <root>/step-00000100/shardwise-rejected.json a restore found it unusable (why, when)

Only names that match :func:`step_name` exactly are the series' (``step-7``, ``step-0100`` or
``step-00000100.old`` are not); anything else under the root is left alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from shardwise._codec import strict_json
from shardwise.checkpoint.index import DATA_DIR, INDEX_NAME, decode_index
from shardwise.checkpoint.index.names import parse_reference, references_in_bytes
from shardwise.checkpoint.loading.index_file import read_index_at
from shardwise.checkpoint.manager.policy import RetentionPolicy
from shardwise.checkpoint.storage import (
    LocalStorage,
    Storage,
    UnsafePathError,
    open_shared_storage,
)
from shardwise.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointStorageError,
)

__all__ = [
    "MAX_STEP",
    "REJECTED_NAME",
    "STEP_RECORD_NAME",
    "CheckpointInfo",
    "References",
    "checkpoint_bytes",
    "list_series",
    "open_series",
    "parse_step_name",
    "read_step_record",
    "references_of",
    "restorable",
    "rejection_record",
    "step_name",
    "step_record",
    "write_step_record",
]

#: The step record of a checkpoint: written by the manager before the save that commits it.
STEP_RECORD_NAME = "shardwise-step.json"
#: Written into a checkpoint that a restore found unusable.
REJECTED_NAME = "shardwise-rejected.json"
logger = logging.getLogger("shardwise.checkpoint.manager")

_RECORD_FORMAT = "shardwise-step"
_RECORD_VERSION = 1
_MAX_RECORD_BYTES = 1 << 20
_STEP_DIGITS = 8
_STEP_NAME = re.compile(r"step-([0-9]{8,19})")
#: The largest step: its name has the most digits a series' listing reads (19).
MAX_STEP = 10**19 - 1
# References (``references_of``): the decoded results by the xxh3_128 of the index's bytes.
# Indexes do not change once committed, and retention asks for every kept one at each commit:
# decoding a 10,000-tensor index takes tens of milliseconds, and a run keeping a checkpoint
# every N steps holds hundreds. The key is the content, so a changed index is decoded anew.
_REFERENCES_CACHED = 1024
_references_cache: dict[bytes, References] = {}


def open_series(root: str, storage_options: dict[str, Any] | None, world_size: int = 1) -> Storage:
    """The storage of the series at ``root`` (refused where ``world_size`` processes would not
    share it). A local root is made absolute, so that a later change of the working directory
    moves nothing; one that is a symbolic link is opened where it points: the user chose it,
    and nothing below it is followed."""
    storage = open_shared_storage(root, storage_options, world_size)
    if isinstance(storage, LocalStorage):
        local = storage.root
        storage = LocalStorage(
            os.path.realpath(local) if os.path.islink(local) else os.path.abspath(local)
        )
    return storage


def step_name(step: int) -> str:
    """The directory name of ``step``: ``step-00000100`` (8 digits, more past 99,999,999)."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ValueError(f"a step is an int from 0 to {MAX_STEP}, not {step!r}")
    return f"step-{step:0{_STEP_DIGITS}d}"


def parse_step_name(name: str) -> int | None:
    """The step a directory name stands for, or None unless it is exactly ``step_name(step)``."""
    match = _STEP_NAME.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_name(step) == name else None


def _finite(value: float | int) -> bool:
    """Whether ``value`` is a finite number that a float holds (an int may exceed them all)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _metric_json(value: object) -> float | int | None:
    # JSON has no NaN or infinity: a diverged loss is recorded as null (never ranked best), and
    # so is an int beyond a float's range (no reader could rank it, nor always parse it).
    if type(value) is bool or not isinstance(value, (int, float)):
        raise TypeError(f"a metric is an int or float, not {type(value).__name__}")
    if not _finite(value):
        return None
    return int(value) if isinstance(value, int) else float(value)


def step_record(
    step: int, metrics: Mapping[str, object] | None, retention: RetentionPolicy
) -> bytes:
    """The bytes of a step record: JSON, no pickle.

    Raises:
        TypeError: A metric name is not a str, or a value not a real number (NumPy and
            0-d tensors are turned into Python numbers first by the caller).
    """
    converted: dict[str, float | int | None] = {}
    for name, value in (metrics or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"metric names are str, not {type(name).__name__} ({name!r})")
        try:
            converted[name] = _metric_json(value)
        except TypeError as err:
            raise TypeError(f"metric {name!r}: {err}") from None
    record = {
        "format": _RECORD_FORMAT,
        "version": _RECORD_VERSION,
        "step": step,
        "time": time.time(),
        "metrics": converted,
        "retention": retention.to_json(),
    }
    return json.dumps(record, allow_nan=False).encode()


def rejection_record(reason: str) -> bytes:
    """The bytes of a rejection record."""
    return json.dumps({"reason": reason, "time": time.time()}).encode()


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One step directory of a series, as one listing saw it."""

    step: int
    #: The directory's path (a URL on remote storage).
    path: str
    #: Whether its index exists: a save committed it.
    committed: bool
    #: Why a restore found it unusable (None: never rejected).
    rejected: str | None = None
    #: When its save started (seconds since the epoch; None without a step record).
    time: float | None = None
    #: The metrics given to ``save`` (a non-finite value is None).
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    #: The retention policy of the manager that saved it (None without a step record).
    retention: RetentionPolicy | None = None

    @property
    def good(self) -> bool:
        """Committed and not rejected: a restore may choose it."""
        return self.committed and self.rejected is None


def read_step_record(storage: Storage, step: int) -> dict[str, Any] | None:
    """The step record of ``step`` when it is there and well formed, else None."""
    path = storage.join(step_name(step), STEP_RECORD_NAME)
    try:
        # NaN and Infinity taken: a hand-edited record's non-finite metric is null (below).
        record = strict_json(
            storage.read_small(path, _MAX_RECORD_BYTES), "a step record", constants=True
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # unreadable: as if absent
        return None
    if (
        not isinstance(record, dict)
        or record.get("format") != _RECORD_FORMAT
        or record.get("version") != _RECORD_VERSION
        or record.get("step") != step
        or type(record.get("time")) not in (int, float)
        or not _finite(record["time"])  # JSON parsing takes NaN and Infinity
        or not isinstance(record.get("metrics"), dict)
    ):
        return None
    # As the writer records them: a non-finite value (JSON parsing takes NaN and Infinity) or
    # an int beyond a float's range is null; a value of another type is left out.
    metrics = {
        name: value if value is not None and _finite(value) else None
        for name, value in record["metrics"].items()
        if value is None or type(value) in (int, float)
    }
    retention: RetentionPolicy | None
    try:
        retention = RetentionPolicy.from_json(record.get("retention"))
    except (ValueError, TypeError):
        retention = None
    return {"time": float(record["time"]), "metrics": metrics, "retention": retention}


def _rejection(storage: Storage, step: int) -> str | None:
    path = storage.join(step_name(step), REJECTED_NAME)
    try:
        data = storage.read_small(path, _MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"unreadable rejection record ({err})"
    try:
        reason = strict_json(data, "a rejection record", constants=True).get("reason")
    except (ValueError, AttributeError):
        reason = None
    return reason if isinstance(reason, str) else "malformed rejection record"


def list_series(storage: Storage, *, records: bool = True) -> list[CheckpointInfo]:
    """The step directories under ``storage``'s root, oldest step first, from one listing.

    Args:
        records: Read each committed checkpoint's step record (one small read each); without,
            its time and metrics are left unknown. A rejection record is always read (where
            the listing shows one).
    """
    found = []
    for name in storage.listdir(storage.root):
        step = parse_step_name(name)
        if step is None:
            continue
        try:
            entries = storage.listdir(storage.join(name))
        except UnsafePathError:  # a file or a link of that name: not the series'
            continue
        committed = INDEX_NAME in entries
        info = CheckpointInfo(step, storage.url(storage.join(name)), committed)
        if committed:
            has_record = records and STEP_RECORD_NAME in entries
            record = read_step_record(storage, step) if has_record else None
            rejected = _rejection(storage, step) if REJECTED_NAME in entries else None
            info = CheckpointInfo(
                step,
                info.path,
                committed,
                rejected,
                None if record is None else record["time"],
                {} if record is None else record["metrics"],
                None if record is None else record["retention"],
            )
        found.append(info)
    return sorted(found, key=lambda info: info.step)


def _entry_bytes(storage: Storage, *parts: str) -> int:
    """The size of the entry ``parts`` below the root (a link's own: never followed); 0 once it
    is gone (a deletion running meanwhile)."""
    try:
        return storage.size(storage.join(*parts))
    except FileNotFoundError:
        return 0


def checkpoint_bytes(storage: Storage, step: int) -> int:
    """The bytes of the files of ``step``'s directory and of its ``data/`` (a ``data`` that is
    a symbolic link or a file counts as itself: nothing below the root is followed)."""
    name = step_name(step)
    total = 0
    for entry in storage.listdir(storage.join(name)):
        if entry == DATA_DIR:
            try:
                data = storage.listdir(storage.join(name, DATA_DIR))
            except UnsafePathError:
                total += _entry_bytes(storage, name, entry)
                continue
            total += sum(_entry_bytes(storage, name, DATA_DIR, file) for file in data)
        else:
            total += _entry_bytes(storage, name, entry)
    return total


@dataclass(frozen=True, slots=True)
class References:
    """The data files of other checkpoints that one checkpoint's index names."""

    #: ``(checkpoint directory, "data/<file>")`` -> the size the index declares (None when the
    #: index did not decode).
    files: dict[tuple[str, str], int | None] = field(default_factory=dict)
    #: Why the index did not decode (None: it did, and ``files`` is exactly what a reader reads
    #: through it). Then ``files`` holds every reference name found in it: as JSON strings
    #: where it is JSON (any formatting, key order or escape), else in its raw bytes.
    undecoded: str | None = None


def references_of(storage: Storage, step: int) -> References:
    """What the index of ``step`` references, read and decoded by the one validated reader
    (``docs/manager.md``, *Retention by reference*): exactly the sibling data files a load
    reads through it. An index that does not decode (damaged, of a version this shardwise does
    not read, malformed) is taken to reference every reference name it holds. No index, or one
    that no reader opens (a link, a directory, larger than an index may be), references nothing.

    Raises:
        CheckpointError: The storage failed to read it (then nothing may be deleted: it may
            reference anything).
    """
    path = storage.join(step_name(step), INDEX_NAME)
    try:
        data = read_index_at(storage, path, storage.url(storage.join(step_name(step))))
    except CheckpointNotFoundError:
        return References()
    except CheckpointFormatError as err:
        return References(undecoded=err.bare_message)
    key = xxhash.xxh3_128_digest(data)
    found = _references_cache.get(key)
    if found is None:
        found = _decoded_references(data)
        if len(_references_cache) >= _REFERENCES_CACHED:
            del _references_cache[next(iter(_references_cache))]
        _references_cache[key] = found
        if found.undecoded is not None:
            logger.warning(
                "the index of %s does not decode (%s): retention keeps every data file it "
                "names (%d found in it)",
                storage.url(path),
                found.undecoded,
                len(found.files),
            )
    return found


def _decoded_references(data: bytes) -> References:
    try:
        index = decode_index(data)
    except CheckpointFormatError as err:
        return References(dict.fromkeys(_names_in(data)), err.bare_message)
    files: dict[tuple[str, str], int | None] = {}
    for name, size in index.files.items():
        reference = parse_reference(name)
        if reference is not None:
            files[reference] = size
    return References(files)


def _names_in(data: bytes) -> list[tuple[str, str]]:
    """Every reference name in an index that does not decode: each JSON string (keys too) that
    is one, at any depth; in bytes that are not JSON, each found in them as raw text."""
    try:
        document = strict_json(data, "the checkpoint index", constants=True)
    except ValueError:
        return references_in_bytes(data)
    texts, pending = [], [document]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, dict):
            texts.extend(value)
            pending.extend(value.values())
    return [found for found in map(parse_reference, texts) if found is not None]


def restorable(storage: Storage) -> tuple[list[int], int]:
    """The steps of the series at ``storage`` that a restore may choose (committed and not
    rejected, oldest first), and how many committed checkpoints earlier restores rejected."""
    listing = list_series(storage, records=False)
    good = [info.step for info in listing if info.good]
    return good, sum(1 for info in listing if info.committed and not info.good)


def write_step_record(storage: Storage, step: int, record: bytes, shown: str) -> None:
    """Before the save of ``step`` (``shown``: its path, for errors): make its directory,
    remove a rejection record, write the step record (the index is the commit: the record must
    be there by then).

    Raises:
        CheckpointStorageError: The step's name is a link or a file, or the storage failed.
    """
    name = step_name(step)
    try:
        storage.makedirs(storage.join(name))
        storage.remove(storage.join(name, REJECTED_NAME))
        storage.replace_small(storage.join(name, STEP_RECORD_NAME), record)
    except UnsafePathError as err:
        raise CheckpointStorageError(
            f"cannot save step {step} to {shown}: it is not a real directory (a symbolic link, "
            "or a file named like a step), and a series follows no link below its root; move "
            "it away",
            file=shown,
        ) from err
    except CheckpointError:
        raise
    except OSError as err:
        filename = err.filename if isinstance(err.filename, str) else None
        raise CheckpointStorageError(
            f"cannot write the step record of {name}: {err}", file=filename
        ) from err
