"""Enumerable sharding: any set of non-overlapping boxes, listed one by one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardwise.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)
from shardwise.sharding_spec.api import ScatterByMetadata

__all__ = ["EnumerableShardingSpec"]


@dataclass(slots=True)
class EnumerableShardingSpec(ScatterByMetadata):
    """Shards a tensor into explicitly listed boxes (offsets, sizes and placement each).

    The shards must not overlap; whether they cover a given tensor exactly is checked by
    :meth:`build_metadata`.

    Args:
        shards: The shards, all with the same number of dims.

    Raises:
        ValueError: ``shards`` is empty, the shards have different numbers of dims, or two
            shards overlap.

    Example:
        >>> spec = EnumerableShardingSpec([
        ...     ShardMetadata([0, 0], [2, 4], "rank:0/cpu"),
        ...     ShardMetadata([2, 0], [2, 4], "rank:1/cpu"),
        ... ])
        >>> spec.build_metadata(torch.Size([4, 4]), TensorProperties()).size
        torch.Size([4, 4])
    """

    shards: list[ShardMetadata]

    def __post_init__(self) -> None:
        if len(self.shards) == 0:
            raise ValueError(f"Empty shard list provided: {self.shards}")
        num_dims = len(self.shards[0].shard_offsets)
        for shard in self.shards:
            if len(shard.shard_offsets) != num_dims:
                raise ValueError(
                    f"Found inconsistent ranks for shards: {num_dims} and "
                    f"{len(shard.shard_offsets)}"
                )
        validate_non_overlapping_shards_metadata(self.shards)

    def build_metadata(
        self, tensor_sizes: torch.Size, tensor_properties: TensorProperties
    ) -> ShardedTensorMetadata:
        """Check that the shards tile a tensor of size ``tensor_sizes`` and describe it.

        The arguments are those of :meth:`ShardingSpec.build_metadata`.

        Returns:
            Metadata holding this spec's own shard list (the same list object),
            ``tensor_sizes`` and ``tensor_properties``.

        Raises:
            ValueError: The shards do not have ``len(tensor_sizes)`` dims, a non-empty shard
                reaches past the tensor, or the shards do not cover the whole tensor.
        """
        check_tensor(self.shards, tensor_sizes)
        return ShardedTensorMetadata(self.shards, tensor_sizes, tensor_properties)
