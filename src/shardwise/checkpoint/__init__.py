"""Distributed checkpoints: metadata (DCP-compatible classes and the index JSON form)."""

from shardwise.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from shardwise.errors import (
    CheckpointDataError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ChecksumError,
    PickleNotAllowedError,
)

__all__ = [
    "BytesStorageMetadata",
    "CheckpointDataError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointKeyError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "PickleNotAllowedError",
    "StorageMeta",
    "TensorStorageMetadata",
]
