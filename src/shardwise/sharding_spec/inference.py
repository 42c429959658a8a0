"""Recover a sharding spec from the shards of a tensor (as ``init_from_local_shards`` does)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.metadata import ShardMetadata
from shardwise.placement import RemoteDevice
from shardwise.sharding_spec.api import ShardingSpec
from shardwise.sharding_spec.chunk import (
    ChunkShardingSpec,
    get_chunked_dim_size,
    get_split_size,
)
from shardwise.sharding_spec.enumerable import EnumerableShardingSpec

__all__ = ["_infer_sharding_spec_from_shards_metadata"]


def _infer_sharding_spec_from_shards_metadata(
    shards_metadata: list[ShardMetadata],
) -> ShardingSpec:
    """The :class:`ChunkShardingSpec` the shards were cut with, else an enumerable spec.

    The shards are a chunk layout when every shard's offsets are zero except, for some
    shards, along one common dim, and the shards' lengths and offsets along that dim are
    those of ``ChunkShardingSpec`` for their total length and count (compared as sorted
    lists). Its placements are the shards' placements ordered by the sum of each shard's
    offsets (ties keep the input order). A single shard, or shards whose offsets are all
    zero, give an enumerable spec. The input is not modified.

    Args:
        shards_metadata: Every shard of a tensor.

    Returns:
        A ``ChunkShardingSpec``, or an ``EnumerableShardingSpec`` over ``shards_metadata``
        itself (the same list object).

    Raises:
        ValueError: An enumerable spec is built and the shards are empty, of different
            numbers of dims, or overlapping.
    """
    dim = _single_offset_dim(shards_metadata)
    if dim is not None and _is_chunk_layout(shards_metadata, dim):
        ordered = sorted(shards_metadata, key=lambda shard: sum(shard.shard_offsets))
        placements: list[RemoteDevice | str | torch.device] = [
            shard.placement for shard in ordered if shard.placement is not None
        ]
        # A chunk spec needs a placement per chunk; shards without one stay enumerable
        # (upstream raised a TypeError while building the chunk spec).
        if len(placements) == len(ordered):
            return ChunkShardingSpec(dim=dim, placements=placements)
    return EnumerableShardingSpec(shards_metadata)


def _single_offset_dim(shards: Sequence[ShardMetadata]) -> int | None:
    """The one dim along which shards have non-zero offsets, or ``None``."""
    found: int | None = None
    for shard in shards:
        dims = [dim for dim, offset in enumerate(shard.shard_offsets) if offset != 0]
        if not dims:
            # All-zero offsets say nothing about the sharded dim.
            continue
        # Upstream tested ``found`` for truthiness, so a dim 0 found first could be replaced
        # by another dim; two different dims mean this is no chunk layout.
        if len(dims) > 1 or (found is not None and found != dims[0]):
            return None
        found = dims[0]
    return found


def _is_chunk_layout(shards: Sequence[ShardMetadata], dim: int) -> bool:
    lengths = sorted(shard.shard_sizes[dim] for shard in shards)
    offsets = sorted(shard.shard_offsets[dim] for shard in shards)
    total = sum(lengths)
    chunks = len(shards)
    split = get_split_size(total, chunks)
    expected_lengths = sorted(get_chunked_dim_size(total, split, idx) for idx in range(chunks))
    return lengths == expected_lengths and offsets == [split * idx for idx in range(chunks)]
