"""The object protocol ``torch.distributed.checkpoint`` (DCP) recognizes on state-dict values.

DCP's planners ask an object for its write items (``__create_write_items__``), its local
chunks (``__create_chunk_list__``) and the tensor behind a chunk (``__get_tensor_shard__``), so
``torch.distributed.checkpoint.save``/``load`` handle shardwise ShardedTensors, including
loading into a different sharding. These speak DCP's own metadata classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint.metadata import properties_to_dcp

if TYPE_CHECKING:
    from shardwise.sharded_tensor.api import ShardedTensor

__all__ = ["chunk_list", "tensor_shard", "write_items"]


def _chunk(offsets: Any, sizes: Any) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _non_empty(st: ShardedTensor) -> list[Any]:
    # An empty trailing chunk may start past the end (13 rows over 8 chunks: offset 14); it
    # holds no data, and DCP rejects its out-of-bounds box, so it is left out.
    return [shard for shard in st.local_shards() if 0 not in shard.metadata.shard_sizes]


def write_items(fqn: str, st: ShardedTensor) -> list[Any]:
    """One DCP ``WriteItem`` (type SHARD) per local shard."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    dcp_properties = properties_to_dcp(st.metadata().tensor_properties)
    items = []
    for shard in _non_empty(st):
        offsets = torch.Size(shard.metadata.shard_offsets)
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(offsets, shard.metadata.shard_sizes),
                    properties=dcp_properties,
                    size=torch.Size(st.metadata().size),
                ),
            )
        )
    return items


def chunk_list(st: ShardedTensor) -> list[Any]:
    """DCP ``ChunkStorageMetadata`` of every local shard."""
    return [
        _chunk(shard.metadata.shard_offsets, shard.metadata.shard_sizes) for shard in _non_empty(st)
    ]


def tensor_shard(st: ShardedTensor, index: Any) -> torch.Tensor:
    """The local shard tensor whose offsets are ``index.offset`` (``index.index`` is a hint).

    Raises:
        ValueError: No local shard starts there.
    """
    if index.offset is None:
        raise ValueError(
            f"Cannot lookup {index.fqn} since its a ShardedTensor and no offset was provided"
        )
    shards = st.local_shards()
    hint = index.index
    candidates = shards if hint is None or not 0 <= hint < len(shards) else [shards[hint], *shards]
    for shard in candidates:
        if torch.Size(shard.metadata.shard_offsets) == index.offset:
            found: torch.Tensor = shard.tensor
            return found
    raise ValueError(f"Could not find shard at '{index.offset}' for FQN: '{index.fqn}'")
