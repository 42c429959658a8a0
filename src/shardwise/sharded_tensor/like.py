"""New ShardedTensors laid out like an existing one, over other local data (no communication).

The gradient of a sharded parameter, the optimizer state of one and the results of the
shard-by-shard ops are built this way.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from shardwise.metadata import ShardedTensorMetadata, TensorProperties
from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharded_tensor.shard import Shard

__all__ = ["rebuild", "with_local_tensors"]


def rebuild(
    st: ShardedTensor, shards: list[Shard], metadata: ShardedTensorMetadata | None = None
) -> ShardedTensor:
    """A new ShardedTensor like ``st`` (group, RRefs, spec) over ``shards`` and ``metadata``."""
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards,
        st.metadata() if metadata is None else metadata,
        process_group=st._process_group,
        init_rrefs=st._init_rrefs,
        sharding_spec=st.sharding_spec(),
    )


def with_local_tensors(like: ShardedTensor, tensors: Sequence[torch.Tensor]) -> ShardedTensor:
    """A ShardedTensor laid out like ``like`` whose local shards are ``tensors`` (no copies).

    ``tensors[i]`` takes the place of ``like``'s ``i``-th local shard and must have its size
    and device; dtype and requires_grad come from the tensors (all alike). The gradient of a
    sharded parameter and the optimizer state of one are built this way. No communication.

    Raises:
        ValueError: The number of tensors, or one's size, dtype or requires_grad, does not fit.
    """
    local = like.local_shards()
    if len(tensors) != len(local):
        raise ValueError(f"expected {len(local)} local tensors, got {len(tensors)}")
    global_metadata = like.metadata()
    shards_metadata = copy.deepcopy(global_metadata.shards_metadata)
    # The local shards' metadata are entries of the global list (the same objects).
    position = {id(entry): i for i, entry in enumerate(global_metadata.shards_metadata)}
    shards = []
    for shard, tensor in zip(local, tensors, strict=True):
        index = position.get(id(shard.metadata))
        if index is None:
            index = global_metadata.shards_metadata.index(shard.metadata)
        shards.append(Shard(tensor, shards_metadata[index]))
    first = tensors[0] if tensors else None
    properties = TensorProperties(
        dtype=like.dtype if first is None else first.dtype,
        layout=global_metadata.tensor_properties.layout,
        requires_grad=False if first is None else first.requires_grad,
        memory_format=global_metadata.tensor_properties.memory_format,
        pin_memory=False if first is None else first.is_pinned(),
    )
    metadata = ShardedTensorMetadata(shards_metadata, global_metadata.size, properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards,
        metadata,
        process_group=like._process_group,
        init_rrefs=False,
        sharding_spec=like.sharding_spec(),
    )
