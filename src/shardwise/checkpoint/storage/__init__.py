"""Where checkpoint bytes live: a small storage protocol with a local and an fsspec backend.

The only part of shardwise that touches files. Paths are plain ``str`` joined with ``/`` so that
URLs (``s3://bucket/ckpt``, ``memory://ckpt``) survive; a URL needs ``fsspec`` (extra ``remote``).
:func:`open_storage` picks the backend; the rest is in ``docs/architecture.md`` (*Storage*).
"""

from __future__ import annotations

import os
from typing import Any

from shardwise.checkpoint.storage._errors import describe_storage_error
from shardwise.checkpoint.storage._fsspec import FsspecStorage
from shardwise.checkpoint.storage._local import LocalStorage, PartWriter
from shardwise.checkpoint.storage._protocol import (
    Finish,
    RangeRequest,
    Reader,
    Storage,
    UnsafePathError,
    Writer,
)
from shardwise.checkpoint.storage._threads import batches, run_concurrently
from shardwise.errors import CheckpointError

__all__ = [
    "Finish",
    "FsspecStorage",
    "LocalStorage",
    "PartWriter",
    "RangeRequest",
    "Reader",
    "Storage",
    "UnsafePathError",
    "Writer",
    "batches",
    "describe_storage_error",
    "local_path",
    "open_shared_storage",
    "open_storage",
    "run_concurrently",
]


# URL schemes that name this machine's files: served by LocalStorage, which follows no link
# below its root and creates every file it writes (fsspec's local backend does neither).
_LOCAL_SCHEMES = ("file://", "local://")


def local_path(path: str | os.PathLike[str]) -> str | None:
    """The local path ``path`` names (a plain path, or a ``file://`` or ``local://`` URL),
    or None for a URL of another store: the one rule telling local storage from fsspec's."""
    text = os.fspath(path)
    for scheme in _LOCAL_SCHEMES:
        if text.startswith(scheme):
            return text[len(scheme) :]
    return None if "://" in text else text


def open_storage(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Storage:
    """The storage backend for ``path``: local for plain paths (and ``file://``,
    ``local://``), fsspec for other URLs."""
    local = local_path(path)
    if local is None:
        return FsspecStorage(os.fspath(path), storage_options)
    return LocalStorage(local)


def open_shared_storage(
    path: str, storage_options: dict[str, Any] | None, world_size: int
) -> Storage:
    """:func:`open_storage`, refused when ``world_size`` processes would not share it.

    Raises:
        CheckpointError: A process-local store (``memory://``) for more than one process.
    """
    storage = open_storage(path, storage_options)
    if storage.process_local and world_size > 1:
        raise CheckpointError(
            f"{path} is in a store that only this process sees (memory://), but {world_size} "
            "processes save or load it together: each would have its own copy. Use a shared "
            "file system or object store, or one process",
            file=path,
        )
    return storage
