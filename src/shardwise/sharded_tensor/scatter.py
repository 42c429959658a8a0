"""Scatter: lay a whole tensor out as a ShardedTensor from one source rank.

The engine behind the built-in specs' ``shard`` and :func:`shardwise.shard_tensor`: one
metadata exchange (which also checks that every rank passes the same ``src_rank`` and spec),
validation of the layout on every rank, then one point-to-point message per non-empty remote
shard, straight from the source tensor's memory into the owner's shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise._boxes import region
from shardwise.metadata import ShardedTensorMetadata, TensorProperties, dtype_from_name, dtype_name
from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharded_tensor.shard import Shard
from shardwise.sharded_tensor.utils import parse_and_validate_remote_device
from shardwise.sharding_spec import ShardingSpec
from shardwise.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)

__all__ = ["check_same_call", "describe_call", "scatter"]


def _scatter_plan(
    entries: list[dict[str, Any]], src_rank: int, sharding_spec: ShardingSpec, group: ProcessGroup
) -> ShardedTensorMetadata:
    """Check that every rank called with the same ``src_rank`` and spec, and build the metadata
    from the source's tensor. Pure in the gathered entries, so every rank agrees."""
    check_same_call(entries, src_rank, sharding_spec, collectives.group_rank(group))
    if not 0 <= src_rank < len(entries):
        raise ValueError(f"src_rank={src_rank} is not a rank of the process group")
    source = entries[src_rank]
    properties = TensorProperties(
        dtype=dtype_from_name(source["dtype"]),
        layout=torch.strided,
        requires_grad=source["requires_grad"],
        memory_format=torch.contiguous_format,
        pin_memory=source["pin_memory"],
    )
    metadata = sharding_spec.build_metadata(torch.Size(source["size"]), properties)
    for shard_metadata in metadata.shards_metadata:
        rank, _ = parse_and_validate_remote_device(group, shard_metadata.placement)
        if rank is None:
            raise ValueError(
                f"Cannot scatter to placement {shard_metadata.placement}: it names no rank"
            )
    validate_non_overlapping_shards_metadata(metadata.shards_metadata)
    check_tensor(metadata.shards_metadata, list(metadata.size))
    return metadata


def describe_call(
    tensor: torch.Tensor,
    sharding_spec: ShardingSpec,
    src_rank: int,
    *,
    require_contiguous: bool = True,
) -> dict[str, Any]:
    # shard_tensor insists on a contiguous input (upstream's contract); a spec's own shard()
    # copies the slices out anyway and accepts any strides, as upstream's does.
    if require_contiguous and not tensor.is_contiguous():
        raise ValueError("input tensor is not a contiguous Tensor")
    return {
        "src_rank": src_rank,
        "spec": repr(sharding_spec),
        "size": list(tensor.size()),
        "dtype": dtype_name(tensor.dtype),
        "requires_grad": tensor.requires_grad,
        "pin_memory": tensor.is_pinned(),
    }


def check_same_call(
    entries: list[dict[str, Any]], src_rank: int, spec: ShardingSpec, me: int
) -> None:
    # One rank at a time, src_rank before spec, so the first disagreement reported is the
    # one upstream reports.
    for rank, entry in enumerate(entries):
        if entry["src_rank"] != src_rank:
            raise ValueError(
                f"src_rank={src_rank} on rank: {me} does not match with "
                f"src_rank={entry['src_rank']} on rank: {rank}"
            )
        if entry["spec"] != repr(spec):
            raise ValueError(
                f"sharding_spec={spec} on rank: {me} does not match with "
                f"sharding_spec={entry['spec']} on rank: {rank}"
            )


def scatter(
    tensor: torch.Tensor,
    sharding_spec: ShardingSpec,
    src_rank: int = 0,
    process_group: ProcessGroup | None = None,
) -> ShardedTensor:
    """Scatter ``tensor`` from group rank ``src_rank`` by ``sharding_spec``'s metadata.

    The engine behind the built-in specs' ``shard``: one metadata exchange (which also checks
    that every rank passes the same ``src_rank`` and spec), validation of the layout on every
    rank, then one point-to-point message per non-empty remote shard, straight from the
    source tensor's memory into the owner's shard.
    """
    group = collectives.resolve_group(process_group)
    if not collectives.is_member(group):
        # SPMD code calls this on every rank; a rank outside the group receives nothing and
        # has nobody to agree with, so it only lays out its own tensor (as upstream's specs
        # lay out every rank's) and keeps no shard.
        describe_call(tensor, sharding_spec, src_rank, require_contiguous=False)
        properties = TensorProperties.create_from_tensor(tensor)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [],
            sharding_spec.build_metadata(tensor.size(), properties),
            process_group=group,
            sharding_spec=sharding_spec,
        )
    _, entries = collectives.exchange_or_raise(
        group, lambda: describe_call(tensor, sharding_spec, src_rank, require_contiguous=False)
    )
    metadata = _scatter_plan(entries, src_rank, sharding_spec, group)

    me = collectives.global_rank()
    src_global = collectives.global_ranks(group)[src_rank]
    properties = metadata.tensor_properties
    local_shards: list[Shard] = []
    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    with torch.no_grad():
        for shard_metadata in metadata.shards_metadata:
            owner, device = parse_and_validate_remote_device(group, shard_metadata.placement)
            if me == src_global:
                piece = region(tensor, shard_metadata.shard_offsets, shard_metadata.shard_sizes)
                if owner == me:
                    local = piece.detach().to(device=device, copy=True).contiguous()
                    local_shards.append(Shard(local, shard_metadata))
                else:
                    assert owner is not None
                    sends.append((owner, piece.detach().contiguous()))
            elif owner == me:
                local = torch.empty(
                    shard_metadata.shard_sizes, dtype=properties.dtype, device=device
                )
                recvs.append((src_global, local))
                local_shards.append(Shard(local, shard_metadata))
        collectives.send_recv_bytes(group, sends, recvs)
    for shard in local_shards:
        shard.tensor.requires_grad_(properties.requires_grad)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, metadata, process_group=group, sharding_spec=sharding_spec
    )
