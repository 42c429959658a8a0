"""Sharded tensors: :class:`ShardedTensor`, :class:`Shard`, factories and constructors.

Importing this package also connects the layers around the sharded tensor, once: the op
registry of :mod:`shardwise.ops` (built on ShardedTensor) becomes its ``__torch_function__``,
the spec layer below gets its scatter engine and upstream's ``custom_sharding_spec_op``, the
classes ``torch.load(..., weights_only=True)`` needs are registered as safe, and a
``torch.optim`` optimizer given a ShardedTensor parameter raises instead of silently leaving it
unchanged.
"""

from __future__ import annotations

from typing import Any

from torch.distributed import ProcessGroup

from shardwise.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardwise.ops import registry
from shardwise.ops.registry import custom_sharded_op_impl
from shardwise.sharded_tensor import api, guards, scatter, serialization
from shardwise.sharded_tensor.api import ShardedTensor, ShardedTensorBase
from shardwise.sharded_tensor.factories import empty, full, ones, rand, randn, zeros
from shardwise.sharded_tensor.shard import Shard
from shardwise.sharding_spec import ShardingSpec
from shardwise.sharding_spec import api as sharding_spec_api

__all__ = [
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorBase",
    "ShardedTensorMetadata",
    "TensorProperties",
    "custom_sharded_op_impl",
    "empty",
    "full",
    "init_from_local_shards",
    "init_from_local_shards_and_global_metadata",
    "init_from_local_tensor",
    "ones",
    "rand",
    "randn",
    "zeros",
]


def init_from_local_shards(
    local_shards: list[Shard],
    *global_size: Any,
    process_group: ProcessGroup | None = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Build a ShardedTensor from each rank's shards (collective over ``process_group``).

    Every rank passes the shards it owns (possibly none) and the same global size. Ranks
    exchange their metadata, check that it agrees (global size, dtype, requires_grad,
    pin_memory), that shards do not overlap and that they cover the tensor; then the sharding
    spec is inferred. A ``None`` in the global size stacks the shards along dim 0 in rank
    order and computes the size.

    Raises:
        ValueError: A local or cross-rank inconsistency; every rank raises, none hangs.

    Example:
        >>> shard = Shard.from_tensor_and_offsets(torch.ones(2, 3), [2 * rank, 0], rank)
        >>> st = init_from_local_shards([shard], 2 * world_size, 3)
    """
    return ShardedTensor._init_from_local_shards(
        local_shards, *global_size, process_group=process_group, init_rrefs=init_rrefs
    )


def init_from_local_shards_and_global_metadata(
    local_shards: list[Shard],
    sharded_tensor_metadata: ShardedTensorMetadata,
    process_group: ProcessGroup | None = None,
    init_rrefs: bool = False,
    sharding_spec: ShardingSpec | None = None,
) -> ShardedTensor:
    """Build a ShardedTensor from this rank's shards and the known global metadata.

    No communication; this rank's shards are validated against their metadata.
    """
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards,
        sharded_tensor_metadata,
        process_group=process_group,
        init_rrefs=init_rrefs,
        sharding_spec=sharding_spec,
    )


def init_from_local_tensor(
    local_tensor: Any,
    sharding_spec: ShardingSpec,
    *global_size: Any,
    process_group: ProcessGroup | None = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """Build a ShardedTensor whose every local shard is ``local_tensor`` (no communication)."""
    return ShardedTensor._init_from_local_tensor(
        local_tensor,
        sharding_spec,
        *global_size,
        process_group=process_group,
        init_rrefs=init_rrefs,
    )


def _connect_layers() -> None:
    api.install_torch_function_handler(registry.dispatch)
    sharding_spec_api.install_tensor_layer(
        sharding_spec_api.TensorLayer(
            scatter=scatter.scatter, custom_sharding_spec_op=registry.custom_sharding_spec_op
        )
    )
    serialization.register_safe_globals(ShardedTensor)
    guards.install_optimizer_guard(ShardedTensor)


_connect_layers()
