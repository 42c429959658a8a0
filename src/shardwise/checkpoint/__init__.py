"""Distributed checkpoints: pickle-free, verified, atomic and reshardable save and load."""

from shardwise.checkpoint.huggingface import consolidate, load_safetensors, save_safetensors
from shardwise.checkpoint.loading.load import LoadResult, load, load_tensor, read_metadata
from shardwise.checkpoint.local_tier import LocalTier, LocalTierWarning
from shardwise.checkpoint.manager import (
    CheckpointManager,
    RestoreFallbackWarning,
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
    PickleNotAllowedError,
    RemoteError,
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
    "async_save",
    "consolidate",
    "load",
    "load_safetensors",
    "load_tensor",
    "materialize",
    "read_metadata",
    "save",
    "save_safetensors",
]
