"""Sharding specs: how a tensor is cut into shards and where each shard lives.

* :class:`ChunkShardingSpec` splits one dim into equal chunks (the ``torch.chunk`` rule).
* :class:`EnumerableShardingSpec` lists arbitrary non-overlapping boxes.
* :class:`DevicePlacementSpec` places a whole entity on one device.

:func:`validate_non_overlapping_shards_metadata` and :func:`check_tensor` validate any shard
layout; ``_infer_sharding_spec_from_shards_metadata`` recovers a spec from shards.
"""

from shardwise.metadata import ShardMetadata
from shardwise.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)
from shardwise.sharding_spec.api import DevicePlacementSpec, PlacementSpec, ShardingSpec
from shardwise.sharding_spec.chunk import (
    ChunkShardingSpec,
    ShardingDim,
    get_chunk_sharding_params,
    get_chunked_dim_size,
    get_split_size,
)
from shardwise.sharding_spec.enumerable import EnumerableShardingSpec
from shardwise.sharding_spec.inference import (
    _infer_sharding_spec_from_shards_metadata as _infer_sharding_spec_from_shards_metadata,
)

__all__ = [
    "ChunkShardingSpec",
    "DevicePlacementSpec",
    "EnumerableShardingSpec",
    "PlacementSpec",
    "ShardMetadata",
    "ShardingDim",
    "ShardingSpec",
    "check_tensor",
    "get_chunk_sharding_params",
    "get_chunked_dim_size",
    "get_split_size",
    "validate_non_overlapping_shards_metadata",
]
