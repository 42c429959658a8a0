"""Helpers shared by the op implementations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardwise.metadata import ShardedTensorMetadata

if TYPE_CHECKING:
    from shardwise.sharded_tensor.api import ShardedTensor
    from shardwise.sharded_tensor.shard import Shard


def sharded_input(args: Any) -> ShardedTensor:
    """The op's first argument, which must be a ShardedTensor."""
    from shardwise.sharded_tensor.api import ShardedTensor

    if not args or not isinstance(args[0], ShardedTensor):
        raise TypeError("input needs to be a ShardedTensor")
    return args[0]


def rebuild(
    st: ShardedTensor, shards: list[Shard], metadata: ShardedTensorMetadata | None = None
) -> ShardedTensor:
    """A new ShardedTensor like ``st`` (group, RRefs, spec) over ``shards`` and ``metadata``."""
    from shardwise.sharded_tensor.api import ShardedTensor

    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards,
        st.metadata() if metadata is None else metadata,
        process_group=st._process_group,
        init_rrefs=st._init_rrefs,
        sharding_spec=st.sharding_spec(),
    )
