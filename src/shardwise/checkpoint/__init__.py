"""Distributed checkpoints: pickle-free, verified, atomic and reshardable save and load."""

from shardwise.checkpoint.huggingface import consolidate, load_safetensors, save_safetensors
from shardwise.checkpoint.loading.load import LoadResult, load, load_tensor, read_metadata
from shardwise.checkpoint.loading.verify import VerifyProblem, VerifyReport, verify
from shardwise.checkpoint.local_tier import LocalTier
from shardwise.checkpoint.manager import (
    CheckpointManager,
    RetentionPolicy,
    SavePolicy,
    materialize,
)
from shardwise.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from shardwise.checkpoint.saving.save import async_save, save
from shardwise.errors import (
    CheckpointDataError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CheckpointTimeoutError,
    CheckpointVersionError,
    ChecksumError,
    DCPImportError,
    LocalTierWarning,
    PickleNotAllowedError,
    RemoteError,
    RestoreFallbackWarning,
)

__all__ = [
    "BytesStorageMetadata",
    "CheckpointDataError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointKeyError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "CheckpointTimeoutError",
    "CheckpointVersionError",
    "ChecksumError",
    "ChunkStorageMetadata",
    "DCPImportError",
    "LoadResult",
    "LocalTier",
    "LocalTierWarning",
    "Metadata",
    "MetadataIndex",
    "PickleNotAllowedError",
    "RemoteError",
    "RestoreFallbackWarning",
    "RetentionPolicy",
    "SavePolicy",
    "StorageMeta",
    "TensorStorageMetadata",
    "VerifyProblem",
    "VerifyReport",
    "async_save",
    "consolidate",
    "load",
    "load_safetensors",
    "load_tensor",
    "materialize",
    "read_metadata",
    "save",
    "save_safetensors",
    "verify",
]

# Reprs, help() and pickles by reference name the public module, not the private one that
# defines a name (`shardwise.checkpoint.CheckpointManager`). Importing any module of this
# package runs this first, so every process sees the same names. The errors keep theirs,
# `shardwise.errors`, public too.
for _name in __all__:
    _value = globals()[_name]
    if _value.__module__.startswith(f"{__name__}."):
        _value.__module__ = __name__
del _name, _value
