"""The exceptions shardwise raises beyond the built-in ones.

Hierarchy::

    ValueError
    └── MetadataFormatError          a JSON metadata document shardwise cannot read

    CheckpointError                  any failure to read, validate or load a checkpoint
    ├── CheckpointFormatError        malformed index, unknown key or dtype name
    │   │                            (also a MetadataFormatError, hence a ValueError)
    │   └── CheckpointVersionError   an index of a format version this shardwise does not read
    │                                (another shardwise may: a series keeps it)
    ├── CheckpointNotFoundError      no committed checkpoint at the path (also FileNotFoundError)
    ├── CheckpointKeyError           a requested key is not in the checkpoint (also KeyError)
    ├── CheckpointMismatchError      saved and target size or dtype differ (also ValueError)
    ├── CheckpointDataError          a data file is missing or truncated (also OSError)
    │   └── ChecksumError            the bytes of a chunk do not match their checksum
    ├── CheckpointStorageError       the storage itself failed: no credentials, an unreachable
    │                                endpoint, permission denied, no such bucket (also OSError)
    ├── PickleNotAllowedError        an entry needs pickle and the caller did not opt in
    │                                (also TypeError)
    ├── CheckpointLockedError        another save to the same path is running
    ├── CheckpointTimeoutError       a rank did not join a collective step of save, async_save
    │                                or load within the process group's timeout, or dropped out
    │                                (also RuntimeError, as torch's own collective errors are)
    └── DCPImportError               a torch.distributed.checkpoint directory is malformed, or
                                     cannot be read without running pickled code

    RuntimeError
    └── RemoteError                  another rank of the group failed with an error that has
                                     no counterpart here; the message names the rank and it

    UserWarning
    ├── LocalTierWarning             the local tier skipped a save (no room), fell back to the
    │                                durable tier, or holds fewer replicas than asked
    └── RestoreFallbackWarning       CheckpointManager.restore skipped a checkpoint it could
                                     not load (corrupt, incomplete), or found every committed
                                     one rejected by earlier restores

User mistakes otherwise raise the built-in ``ValueError``/``TypeError``/``RuntimeError``
with the upstream ``torch.distributed._shard`` messages, which are part of the API contract.

Every :class:`CheckpointError` takes the optional keywords ``key``, ``file`` and ``rank``; the
ones given are kept as attributes and named at the end of the message, e.g.
``checksum mismatch (key 'layer.weight', file 'data/rank-00001.safetensors', rank 1)``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

__all__ = [
    "CheckpointDataError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointKeyError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "CheckpointTimeoutError",
    "CheckpointVersionError",
    "ChecksumError",
    "DCPImportError",
    "LocalTierWarning",
    "MetadataFormatError",
    "PickleNotAllowedError",
    "RemoteError",
    "RestoreFallbackWarning",
]


class MetadataFormatError(ValueError):
    """A JSON metadata document is malformed, of an unknown version, or names an unknown value."""


class CheckpointError(Exception):
    """Base class of every failure to read, validate or load a checkpoint.

    Args:
        message: What went wrong, and how to fix it where that is not obvious.
        key: The fully qualified name of the state-dict entry concerned, if any.
        file: The checkpoint file concerned (index or data file), if any.
        rank: The rank that detected the failure, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        file: str | os.PathLike[str] | None = None,
        rank: int | None = None,
    ) -> None:
        self.bare_message = message
        self.key = key
        self.file = None if file is None else os.fspath(file)
        self.rank = rank
        context = []
        if key is not None:
            context.append(f"key {key!r}")
        if self.file is not None:
            context.append(f"file {self.file!r}")
        if rank is not None:
            context.append(f"rank {rank}")
        if context:
            message = f"{message} ({', '.join(context)})"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (``async_save``'s writer process sends its errors to the training
        # process): the keywords, the notes, and the cause, which pickle leaves out otherwise.
        state = dict(self.__dict__)
        if self.__cause__ is not None:
            state["__cause__"] = _portable(self.__cause__)
        return _rebuild, (type(self), self.bare_message, self.key, self.file, self.rank), state


def _rebuild(
    cls: type[CheckpointError], message: str, key: str | None, file: str | None, rank: int | None
) -> CheckpointError:
    return cls(message, key=key, file=file, rank=rank)


def _portable(error: BaseException) -> BaseException:
    """``error`` if it pickles, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


class CheckpointFormatError(CheckpointError, MetadataFormatError):
    """The index is malformed, has an unknown format version, or names an unknown key, dtype,
    layout or memory format."""


class CheckpointVersionError(CheckpointFormatError):
    """The index is of a format version this shardwise does not read (a newer shardwise may:
    a ``CheckpointManager`` skips such a checkpoint on restore without rejecting it)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no committed checkpoint at the path (missing directory, or no index: a save that
    did not finish)."""


class CheckpointKeyError(CheckpointError, KeyError):
    """A key requested from the checkpoint (with ``strict=True``) is not in it."""

    def __str__(self) -> str:
        # KeyError would show the repr of the message, quotes and escapes included.
        return str(self.args[0]) if self.args else ""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A saved tensor and the tensor it should load into differ in size or dtype."""


class CheckpointDataError(CheckpointError, OSError):
    """A data file named by the index is missing, or shorter than the byte ranges it should
    hold."""


class ChecksumError(CheckpointDataError):
    """The bytes read for a chunk do not match the checksum recorded in the index."""


class CheckpointStorageError(CheckpointError, OSError):
    """The storage holding a checkpoint failed: no credentials found, the endpoint cannot be
    reached, permission denied, no such bucket, a timeout, or another error of the storage
    library (fsspec and its backends, e.g. s3fs and botocore).

    The message is one line naming the URL and the cause in words; the storage library's own
    exception is the ``__cause__``.
    """


class PickleNotAllowedError(CheckpointError, TypeError):
    """An entry can only be saved or loaded with pickle, and ``allow_pickle=True`` was not
    given."""


class CheckpointLockedError(CheckpointError):
    """Another save to the same checkpoint path is running (saves to one path run one at a
    time)."""


class CheckpointTimeoutError(CheckpointError, RuntimeError):
    """A collective step of a save, async save or load failed: another rank did not call it
    within the process group's timeout (it skipped the call, raised before it, or is stuck), or
    it died. The torch.distributed error is the ``__cause__``."""


class DCPImportError(CheckpointError):
    """A DCP checkpoint is malformed, or cannot be read without running pickled code."""


class RemoteError(RuntimeError):
    """Another rank of the group failed with an error of a type that cannot be raised here as
    it is; the message names the rank, the type and its message."""


class LocalTierWarning(UserWarning):
    """The local tier skipped a save, fell back to the durable tier, or holds fewer replicas
    than asked (the training step itself never fails for it)."""


class RestoreFallbackWarning(UserWarning):
    """A restore skipped a checkpoint it could not load and tried the one before it (or found
    none left to try: every committed checkpoint was rejected by earlier restores)."""


#: Every CheckpointError class by name (to rebuild one another rank raised).
CHECKPOINT_ERRORS: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CheckpointDataError,
        CheckpointFormatError,
        CheckpointKeyError,
        CheckpointLockedError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointStorageError,
        CheckpointTimeoutError,
        CheckpointVersionError,
        ChecksumError,
        PickleNotAllowedError,
        DCPImportError,
    )
}
