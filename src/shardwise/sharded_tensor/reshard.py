"""Resharding: move a ShardedTensor's data to another layout, in place.

Any layout to any layout (chunk or enumerable, any dim, several shards per rank). The plan is
a pure function of the old and new shard metadata: for every pair of an old and a new shard
whose boxes intersect, the intersection is copied locally when both belong to the same rank
and sent from the old owner to the new owner otherwise. So only bytes that change owner cross
the wire, each exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardwise import _boxes, collectives
from shardwise.metadata import ShardMetadata, TensorProperties
from shardwise.placement import RemoteDevice
from shardwise.sharded_tensor.shard import Shard
from shardwise.sharded_tensor.utils import parse_and_validate_remote_device
from shardwise.sharding_spec import ChunkShardingSpec, ShardingSpec

if TYPE_CHECKING:
    from shardwise.sharded_tensor.api import ShardedTensor

__all__ = [
    "Transfer",
    "build_reshard_metadata",
    "get_idx_from_placements",
    "intersect",
    "plan_reshard",
    "reshard",
]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of data moving from an old shard to a new shard.

    Attributes:
        source: Index of the old shard in the old metadata list.
        target: Index of the new shard in the new metadata list.
        offsets: Global offsets of the box.
        sizes: Sizes of the box (all positive).
    """

    source: int
    target: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def intersect(a: ShardMetadata, b: ShardMetadata) -> _boxes.Box | None:
    """The box two shards share, as ``(offsets, sizes)``, or ``None`` if it is empty."""
    return _boxes.intersect(a.shard_offsets, a.shard_sizes, b.shard_offsets, b.shard_sizes)


def plan_reshard(old: Sequence[ShardMetadata], new: Sequence[ShardMetadata]) -> list[Transfer]:
    """Every non-empty intersection of an old and a new shard, ordered by (target, source).

    Sorting the old shards by their start along dim 0 lets each new shard scan only the old
    shards that can reach it, instead of all pairs.
    """
    if not old or not new:
        return []
    order = sorted(
        range(len(old)), key=lambda i: old[i].shard_offsets[0] if old[i].shard_offsets else 0
    )
    starts = [old[i].shard_offsets[0] if old[i].shard_offsets else 0 for i in order]
    transfers = []
    for target, box in enumerate(new):
        stop = box.shard_offsets[0] + box.shard_sizes[0] if box.shard_offsets else 1
        for position, source in enumerate(order):
            if starts[position] >= stop:
                break
            overlap = intersect(old[source], box)
            if overlap is not None:
                transfers.append(Transfer(source, target, *overlap))
    transfers.sort(key=lambda t: (t.target, t.source))
    return transfers


def get_idx_from_placements(placements: Sequence[RemoteDevice | str], current_rank: int) -> int:
    """Index of the first placement on ``current_rank``.

    Raises:
        RuntimeError: No placement names that rank.
    """
    for index, placement in enumerate(placements):
        device = placement if isinstance(placement, RemoteDevice) else RemoteDevice(placement)
        if device.rank() == current_rank:
            return index
    raise RuntimeError("current_rank not in the placement.")


def build_reshard_metadata(
    st_size: torch.Size, sharding_spec: ChunkShardingSpec, world_size: int
) -> tuple[list[ShardMetadata], list[int]]:
    """The chunk layout of ``sharding_spec`` indexed by placement rank, and the ranks in
    placement order (upstream's helper; every rank of the world must have one placement)."""
    metadata = sharding_spec.build_metadata(st_size, TensorProperties())
    by_rank: list[ShardMetadata | None] = [None] * world_size
    ranks = []
    for shard in metadata.shards_metadata:
        rank = shard.placement.rank() if shard.placement is not None else None
        assert rank is not None
        by_rank[rank] = shard
        ranks.append(rank)
    assert all(entry is not None for entry in by_rank), "every rank needs a placement"
    return [entry for entry in by_rank if entry is not None], ranks


def _owner(metadata: ShardMetadata) -> int:
    placement = metadata.placement
    rank = None if placement is None else placement.rank()
    if rank is None:
        raise ValueError(f"reshard needs rank placements, found {placement}")
    return rank


def reshard(st: ShardedTensor, resharding_spec: ShardingSpec) -> ShardedTensor:
    """Move ``st``'s data to the layout of ``resharding_spec``, in place (collective).

    Returns ``st``. A chunk spec with the same dim and placements is a no-op; a chunk target
    stores its shard metadata ordered by placement rank (upstream's order).
    """
    group = st._process_group
    old_spec = st.sharding_spec()
    # A rank outside the group owns nothing before or after (placements name members), so it
    # only updates its metadata, without taking part in the group's communication.
    member = collectives.is_member(group)
    if member:
        _, specs = collectives.exchange_or_raise(group, lambda: repr(resharding_spec))
        if any(other != repr(resharding_spec) for other in specs):
            raise ValueError(f"reshard: ranks passed different specs: {sorted(set(specs))}")
    if (
        isinstance(old_spec, ChunkShardingSpec)
        and isinstance(resharding_spec, ChunkShardingSpec)
        and old_spec.dim == resharding_spec.dim
        and old_spec.placements == resharding_spec.placements
    ):
        return st

    properties = st.metadata().tensor_properties
    new_metadata = resharding_spec.build_metadata(st.size(), properties)
    new_shards = new_metadata.shards_metadata
    if isinstance(resharding_spec, ChunkShardingSpec):
        new_shards = sorted(new_shards, key=_owner)
    for shard in new_shards:
        parse_and_validate_remote_device(group, shard.placement)
        _owner(shard)
    old_shards = st.metadata().shards_metadata
    me = collectives.global_rank()
    if not member and any(_owner(shard) == me for shard in new_shards):
        raise ValueError(
            f"reshard: rank {me} is not a member of the tensor's process group, but "
            f"{resharding_spec} places a shard on it"
        )
    local_by_offsets = {tuple(s.metadata.shard_offsets): s.tensor for s in st.local_shards()}

    targets: list[Shard] = []
    target_tensor: dict[int, torch.Tensor] = {}
    for index, shard in enumerate(new_shards):
        if _owner(shard) == me:
            _, device = parse_and_validate_remote_device(group, shard.placement)
            tensor = torch.empty(shard.shard_sizes, dtype=properties.dtype, device=device)
            target_tensor[index] = tensor
            targets.append(Shard(tensor, shard))

    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    landing: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for transfer in plan_reshard(old_shards, new_shards):
            source_md = old_shards[transfer.source]
            target_md = new_shards[transfer.target]
            source_rank, target_rank = _owner(source_md), _owner(target_md)
            if source_rank == me:
                piece = _boxes.narrow_to(
                    local_by_offsets[tuple(source_md.shard_offsets)],
                    source_md.shard_offsets,
                    transfer.offsets,
                    transfer.sizes,
                )
                if target_rank == me:
                    _boxes.narrow_to(
                        target_tensor[transfer.target],
                        target_md.shard_offsets,
                        transfer.offsets,
                        transfer.sizes,
                    ).copy_(piece)
                else:
                    sends.append((target_rank, piece.contiguous()))
            elif target_rank == me:
                buffer = torch.empty(
                    transfer.sizes,
                    dtype=properties.dtype,
                    device=target_tensor[transfer.target].device,
                )
                recvs.append((source_rank, buffer))
                landing.append(
                    (
                        _boxes.narrow_to(
                            target_tensor[transfer.target],
                            target_md.shard_offsets,
                            transfer.offsets,
                            transfer.sizes,
                        ),
                        buffer,
                    )
                )
        collectives.send_recv_bytes(group, sends, recvs)
        for region, buffer in landing:
            region.copy_(buffer)
    for target in targets:
        target.tensor.requires_grad_(properties.requires_grad)
    st._local_shards = targets
    st._metadata.shards_metadata = list(new_shards)
    st._sharding_spec = resharding_spec
    return st
