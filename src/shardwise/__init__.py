"""shardwise: sharded tensors and distributed checkpoints for PyTorch."""

from shardwise.errors import MetadataFormatError
from shardwise.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardwise.placement import RemoteDevice

__version__ = "0.1.0"

__all__ = [
    "MetadataFormatError",
    "RemoteDevice",
    "ShardMetadata",
    "ShardedTensorMetadata",
    "TensorProperties",
]
