"""Module-level sharding APIs: scatter a tensor (``shard_tensor``) or a module parameter
(``shard_parameter``) from a source rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise.metadata import ShardedTensorMetadata, TensorProperties, dtype_from_name, dtype_name
from shardwise.sharded_tensor.api import ShardedTensor
from shardwise.sharded_tensor.shard import Shard
from shardwise.sharded_tensor.utils import parse_and_validate_remote_device
from shardwise.sharding_spec import ShardingSpec
from shardwise.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)

__all__ = ["scatter", "shard_parameter", "shard_tensor"]


def _narrow(tensor: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    view = tensor
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if size != tensor.size(dim):
            # An empty trailing chunk may start past the end (5 rows over 4: offset 6).
            view = view.narrow(dim, min(offset, tensor.size(dim)), size)
    return view


def _scatter_plan(
    entries: list[dict[str, Any]], src_rank: int, sharding_spec: ShardingSpec, group: ProcessGroup
) -> ShardedTensorMetadata:
    """Check that every rank called with the same ``src_rank`` and spec, and build the metadata
    from the source's tensor. Pure in the gathered entries, so every rank agrees."""
    _check_same_call(entries, src_rank, sharding_spec, collectives.group_rank(group))
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


def _describe_call(
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


def _check_same_call(
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
        _describe_call(tensor, sharding_spec, src_rank, require_contiguous=False)
        properties = TensorProperties.create_from_tensor(tensor)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [],
            sharding_spec.build_metadata(tensor.size(), properties),
            process_group=group,
            sharding_spec=sharding_spec,
        )
    _, entries = collectives.exchange_or_raise(
        group, lambda: _describe_call(tensor, sharding_spec, src_rank, require_contiguous=False)
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
                piece = _narrow(tensor, shard_metadata.shard_offsets, shard_metadata.shard_sizes)
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


def _shard_tensor(
    tensor: torch.Tensor,
    sharding_spec: ShardingSpec,
    src_rank: int = 0,
    process_group: ProcessGroup | None = None,
    local_check: Callable[[], None] | None = None,
) -> ShardedTensor:
    group = collectives.resolve_group(process_group)

    def describe() -> dict[str, Any]:
        if local_check is not None:
            local_check()
        return _describe_call(tensor, sharding_spec, src_rank)

    if collectives.is_member(group):
        _, entries = collectives.exchange_or_raise(group, describe)
        _check_same_call(entries, src_rank, sharding_spec, collectives.group_rank(group))
    else:
        describe()  # outside the group: local checks only, nobody to compare with
    return sharding_spec.shard(tensor, src_rank=src_rank, process_group=group)


def shard_tensor(
    tensor: torch.Tensor,
    sharding_spec: ShardingSpec,
    src_rank: int = 0,
    process_group: ProcessGroup | None = None,
) -> ShardedTensor:
    """Scatter ``tensor`` from group rank ``src_rank`` into a ShardedTensor (collective).

    Every rank calls it with the same ``src_rank`` and spec; only the source's ``tensor``
    data is used (other ranks may pass any contiguous tensor, e.g. the same one). Any spec
    works, including several shards per rank and enumerable layouts.

    Raises:
        ValueError: The tensor is not contiguous, or ranks disagree on ``src_rank`` or the
            spec. Every rank raises before any data moves.

    Example:
        >>> spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
        >>> st = shardwise.shard_tensor(torch.arange(8.0), spec)
    """
    return _shard_tensor(tensor, sharding_spec, src_rank, process_group)


def shard_parameter(
    module: nn.Module,
    param_name: str,
    sharding_spec: ShardingSpec,
    src_rank: int = 0,
    process_group: ProcessGroup | None = None,
) -> None:
    """Replace ``module.<param_name>`` by a ShardedTensor parameter scattered from ``src_rank``.

    Raises:
        AttributeError: The module has no such attribute.
        ValueError: It is not a tensor, or not contiguous.
    """
    value = getattr(module, param_name, None)

    def check() -> None:
        if not hasattr(module, param_name):
            raise AttributeError(f"{type(module).__name__} has no attribute `{param_name}`")
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"Expected {type(module).__name__}.{param_name} to be a Tensor, but found "
                f"{type(value).__name__}"
            )
        if not value.is_contiguous():
            raise ValueError(f"param: {param_name} is not a contiguous Tensor")

    tensor = value if isinstance(value, torch.Tensor) else torch.empty(0)
    st = _shard_tensor(tensor, sharding_spec, src_rank, process_group, local_check=check)
    delattr(module, param_name)
    module.register_parameter(param_name, nn.Parameter(st, requires_grad=st.requires_grad))
