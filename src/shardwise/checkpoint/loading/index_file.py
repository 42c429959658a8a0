"""Finding a checkpoint: its index read safely and decoded, or, if none, what is there instead."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

from shardwise.checkpoint.index import (
    DATA_DIR,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    Index,
    decode_index,
    is_data_file_name,
    is_temporary_name,
)
from shardwise.checkpoint.storage import FsspecStorage, LocalStorage, Storage, UnsafePathError
from shardwise.errors import (
    CheckpointDataError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointStorageError,
)

__all__ = ["decode", "quoted", "read_index_at", "read_index_bytes"]


def read_index_bytes(storage: Storage, path: str) -> bytes:
    """The raw index of the checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: No committed checkpoint there (the message says what is).
        CheckpointFormatError: The index is not a regular file, or too large to be one.
    """
    name = storage.join(INDEX_NAME)
    if not storage.exists(name):
        raise CheckpointNotFoundError(_what_is_there(storage, path), file=storage.url(name))
    return read_index_at(storage, name, path)


def read_index_at(storage: Storage, name: str, path: str) -> bytes:
    """The raw bytes of the index file ``name`` (a path of ``storage``) of the checkpoint at
    ``path`` (for messages), read as every reader reads one: a regular file reached without
    following a link, of at most ``MAX_INDEX_BYTES``, whole.

    Raises:
        CheckpointNotFoundError: It is not there.
        CheckpointFormatError: It is not a regular file, or too large to be an index.
        CheckpointDataError: The storage failed to open or read it.
    """
    # On an object store a save may replace the index between the size lookup and the read:
    # a length other than the size (one byte more is asked for) is read again rather than
    # decoded as a mix. (Locally, the open file is the index that was there, whole.)
    for _ in range(_INDEX_ATTEMPTS):
        size, data = _read_index(storage, name, path)
        if len(data) == size:
            break
    return data


# Reads of an index that keeps changing size before its bytes are decoded as they are.
_INDEX_ATTEMPTS = 5


def _read_index(storage: Storage, name: str, path: str) -> tuple[int, bytes]:
    """The size of the index ``name`` when opened, and the bytes read (up to one more)."""
    shown = storage.url(name)
    try:
        reader = storage.open_reader(name)
    except UnsafePathError as err:
        raise CheckpointFormatError(
            f"the checkpoint index is not a regular file ({err.strerror})", file=shown
        ) from err
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"no checkpoint at {path}", file=shown) from err
    except CheckpointStorageError:
        raise
    except OSError as err:
        raise CheckpointDataError(f"cannot open the index: {err}", file=shown) from err
    try:
        if reader.size > MAX_INDEX_BYTES:
            raise CheckpointFormatError(
                f"the checkpoint index has {reader.size} bytes, more than a reader accepts",
                file=shown,
            )
        data = bytearray(reader.size + 1)
        count = reader.read_into(0, memoryview(data))
    except CheckpointStorageError:
        raise
    except OSError as err:
        raise CheckpointDataError(f"cannot read the index: {err}", file=shown) from err
    finally:
        reader.close()
    return reader.size, bytes(data[:count])


# What a path without an index is, told by the names in it (never by their contents).
_DCP_METADATA = ".metadata"
_DCP_SUFFIX = ".distcp"
_HF_NAMES = frozenset(
    {
        "adapter_config.json",
        "config.json",
        "generation_config.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
)
_HF_SUFFIXES = (".safetensors", ".safetensors.index.json")
_SHOWN = 5


def _what_is_there(storage: Storage, path: str) -> str:
    """Why there is no checkpoint at ``path``, told from at most two listings (``path``, its
    ``data/``): no file is read and no link below ``path`` followed."""
    if isinstance(storage, LocalStorage) and os.path.islink(storage.root):
        # The user chose this link; listings refuse one, so list what it names.
        storage = LocalStorage(os.path.realpath(storage.root))
    try:
        if not storage.exists(storage.root):
            return f"no checkpoint at {path}{_missing_bucket(storage)}"
        if _is_file(storage):
            return _a_file(path)
        entries = storage.listdir(storage.root)
    except CheckpointStorageError:
        raise
    except OSError as err:
        reason = err.strerror or str(err)
        return f"no checkpoint at {path}: it has no {INDEX_NAME} and cannot be listed ({reason})"
    if not entries:
        return f"no checkpoint at {path}: it is an empty directory"
    if DATA_DIR in entries and _holds_shardwise_data(storage):
        return (
            f"{path} is not a complete shardwise checkpoint: its index {INDEX_NAME} is "
            "missing, so the save that wrote it did not commit (it may have been "
            "interrupted). Save again or load an earlier checkpoint"
        )
    num_distcp = sum(entry.endswith(_DCP_SUFFIX) for entry in entries)
    if num_distcp or _DCP_METADATA in entries:
        found = [repr(_DCP_METADATA)] if _DCP_METADATA in entries else []
        if num_distcp:
            found.append(f"{num_distcp} *{_DCP_SUFFIX} file{'s' if num_distcp > 1 else ''}")
        return (
            f"{path} is a torch.distributed.checkpoint (DCP) checkpoint, not a shardwise one "
            f"(it has {' and '.join(found)} and no {INDEX_NAME}): convert it with "
            f"`shardwise convert-dcp {shlex.quote(path)} <out>`, or load it with "
            "torch.distributed.checkpoint.load"
        )
    hugging_face = [e for e in entries if e in _HF_NAMES or e.endswith(_HF_SUFFIXES)]
    if hugging_face:
        return (
            f"{path} is a Hugging Face model directory (it has {quoted(hugging_face)}), not a "
            f"shardwise checkpoint (a directory with {INDEX_NAME} and data/): load its weights "
            "into any state dict, sharded or not, with shardwise.checkpoint.load_safetensors "
            "(or the model with transformers' from_pretrained)"
        )
    return (
        f"{path} is not a shardwise checkpoint: it has no {INDEX_NAME}; it holds {quoted(entries)}"
    )


def _missing_bucket(storage: Storage) -> str:
    """Why an object store has nothing at the path, when its bucket is missing (else "")."""
    if isinstance(storage, FsspecStorage) and storage.bucket and not storage.exists(storage.bucket):
        return f": there is no bucket {storage.bucket!r} (or these credentials cannot see it)"
    return ""


def _is_file(storage: Storage) -> bool:
    """Whether the checkpoint path is a regular file (opened to check, never read)."""
    try:
        storage.open_reader(storage.root).close()
    except OSError:  # a directory, or something unsafe to open
        return False
    return True


def _a_file(path: str) -> str:
    """Why the file at ``path`` is no checkpoint (and, for an index, where one is)."""
    message = (
        f"no checkpoint at {path}: it is a file, and a shardwise checkpoint is a directory "
        f"holding {INDEX_NAME} and data/"
    )
    parent, base = os.path.split(path.rstrip("/"))
    if base == INDEX_NAME:
        message += f"; to read the checkpoint of this index, give its directory {parent or '.'}"
    return message


def _holds_shardwise_data(storage: Storage) -> bool:
    """Whether ``data/`` holds a data file the writer makes (final or temporary name)."""
    try:
        names = storage.listdir(storage.join(DATA_DIR))
    except OSError:  # not a real directory: nothing of ours
        return False
    return any(is_data_file_name(name) or is_temporary_name(name) for name in names)


def quoted(names: Sequence[str], limit: int = _SHOWN) -> str:
    """Up to ``limit`` of ``names``, quoted (a name may hold any character), then how many more."""
    shown = ", ".join(repr(name) for name in names[:limit])
    more = len(names) - limit
    return f"{shown} and {more} more" if more > 0 else shown


def decode(data: bytes, storage: Storage) -> Index:
    """:func:`decode_index`, naming the index file in its errors."""
    try:
        return decode_index(data)
    except CheckpointFormatError as err:
        raise type(err)(
            err.bare_message, key=err.key, file=storage.url(storage.join(INDEX_NAME))
        ) from err
