"""Pure helpers of sharded-tensor construction: size flattening, placement resolution, and
the local and cross-rank metadata validation of ``init_from_local_shards``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from shardwise import collectives
from shardwise.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardwise.placement import RemoteDevice
from shardwise.sharded_tensor.shard import Shard

__all__ = [
    "build_global_metadata",
    "build_metadata_from_local_shards",
    "check_local_shard",
    "flatten_tensor_size",
    "parse_and_validate_remote_device",
    "recalc_global_sharded_tensor_metadata",
    "recalculated_entry",
    "size_dims",
]


def size_dims(size: Sequence[Any]) -> list[Any]:
    """The dims of a size given as varargs or as one sequence (list, tuple, ``torch.Size``)."""
    return list(size[0]) if len(size) == 1 and isinstance(size[0], Sequence) else list(size)


def flatten_tensor_size(size: Sequence[Any]) -> torch.Size:
    """Sizes given as varargs, or as one sequence (list, tuple, ``torch.Size``), as a Size.

    Raises:
        TypeError: An element is not an ``int``.
    """
    dims = size_dims(size)
    for dim in dims:
        if not isinstance(dim, int):
            raise TypeError(f"size has to be a sequence of ints, found: {dims}")
    return torch.Size(dims)


def parse_and_validate_remote_device(
    process_group: ProcessGroup | None, remote_device: RemoteDevice | None
) -> tuple[int | None, torch.device]:
    """The global rank and device a placement names, validated against ``process_group``.

    Raises:
        ValueError: No placement, a rank outside the group, or an unknown worker name.
        RuntimeError: A worker-name placement without an initialized RPC framework.
    """
    if remote_device is None:
        raise ValueError("remote device is None")
    rank = remote_device.rank()
    device = remote_device.device()
    worker_name = remote_device.worker_name()
    if rank is not None and process_group is not None and collectives.is_member(process_group):
        members = collectives.global_ranks(process_group)
        if rank not in members:
            raise ValueError(f"Global rank {rank} does not exist in input process group: {members}")
    if worker_name is not None:
        return collectives.rpc_worker_id(worker_name), device
    return rank, device


def _raise_local_mismatch(expected: Any, actual: Any, prop: str, rank: int) -> None:
    if expected != actual:
        raise ValueError(
            f"Local shards' tensor {prop} property need to be the same on rank:{rank}! "
            f"Found one local shard tensor {prop}={expected}, "
            f"the other local shard tensor {prop}={actual}."
        )


def build_metadata_from_local_shards(
    local_shards: list[Shard],
    global_size: torch.Size,
    current_rank: int,
    process_group: ProcessGroup,
) -> ShardedTensorMetadata:
    """Validate this rank's shards against each other and their placements.

    Returns:
        This rank's view: its shards' metadata, the global size and the common properties.
    """
    assert local_shards, "build_metadata_from_local_shards needs at least one local shard"
    first = local_shards[0].tensor
    for shard in local_shards:
        tensor = shard.tensor
        metadata = shard.metadata
        rank, device = parse_and_validate_remote_device(process_group, metadata.placement)
        if tensor.layout != torch.strided or tensor.layout != first.layout:
            raise ValueError(
                "Only torch.strided layout is currently supported, but found "
                f"{tensor.layout} on rank:{current_rank}!"
            )
        if not tensor.is_contiguous():
            raise ValueError("Only torch.contiguous_format memory_format is currently supported!")
        if rank != current_rank:
            raise ValueError(
                "Local shard metadata's rank does not match with the rank in its process group! "
                f"Found current rank in the process group: {current_rank}, "
                f"local ShardMetadata placement's rank: {rank}"
            )
        if tensor.device != device:
            raise ValueError(
                "Local shard tensor device does not match with local Shard's placement! "
                f"Found local shard tensor device: {tensor.device}, "
                f"local shard metadata placement device: {device}"
            )
        _raise_local_mismatch(metadata.shard_sizes, list(tensor.size()), "size", current_rank)
        # Upstream's message order: "one local shard" is this shard, "the other" the first.
        _raise_local_mismatch(tensor.is_pinned(), first.is_pinned(), "pin_memory", current_rank)
        _raise_local_mismatch(tensor.dtype, first.dtype, "dtype", current_rank)
        _raise_local_mismatch(
            tensor.requires_grad, first.requires_grad, "requires_grad", current_rank
        )
    return ShardedTensorMetadata(
        shards_metadata=[shard.metadata for shard in local_shards],
        size=global_size,
        tensor_properties=TensorProperties.create_from_tensor(first),
    )


def _raise_cross_rank_mismatch(
    expected: Any, actual: Any, prop: str, ranks: tuple[int, int]
) -> None:
    if expected != actual:
        raise ValueError(
            f"ShardedTensor {prop} property does not match from different ranks! "
            f"Found {prop}={expected} on rank:{ranks[0]}, and {prop}={actual} on rank:{ranks[1]}."
        )


def build_global_metadata(
    gathered: Sequence[ShardedTensorMetadata | None],
) -> ShardedTensorMetadata:
    """Merge every rank's view (``None`` for ranks without shards) into the global metadata.

    Raises:
        ValueError: Ranks disagree on the global size, dtype, requires_grad or pin_memory, or
            no rank has a shard.
    """
    merged: ShardedTensorMetadata | None = None
    merged_rank = 0
    for rank, view in enumerate(gathered):
        if view is None:
            continue
        if merged is None:
            merged = copy.deepcopy(view)
            merged_rank = rank
            continue
        ranks = (merged_rank, rank)
        _raise_cross_rank_mismatch(merged.size, view.size, "global_size", ranks)
        first, other = merged.tensor_properties, view.tensor_properties
        _raise_cross_rank_mismatch(first.dtype, other.dtype, "dtype", ranks)
        _raise_cross_rank_mismatch(first.requires_grad, other.requires_grad, "requires_grad", ranks)
        _raise_cross_rank_mismatch(first.pin_memory, other.pin_memory, "pin_memory", ranks)
        merged.shards_metadata.extend(copy.deepcopy(view.shards_metadata))
    if merged is None:
        raise ValueError("ShardedTensor have no local shards on all ranks!")
    return merged


def recalc_global_sharded_tensor_metadata(metadata: ShardedTensorMetadata) -> None:
    """Stack the shards along dim 0 in placement-rank order (sizes given with ``None``).

    Every dim-0 offset becomes the running sum of dim-0 sizes, other offsets become 0, and the
    global size becomes the dim-0 total followed by the first shard's other sizes. In place.
    """
    shards = metadata.shards_metadata
    ordered = sorted(shards, key=lambda md: _placement_rank(md))
    offset = 0
    for shard in ordered:
        shard.shard_offsets = [offset] + [0] * (len(shard.shard_sizes) - 1)
        offset += shard.shard_sizes[0]
    metadata.size = torch.Size([offset, *shards[0].shard_sizes[1:]])


def _placement_rank(metadata: ShardMetadata) -> int:
    placement = metadata.placement
    rank = None if placement is None else placement.rank()
    return -1 if rank is None else rank


def recalculated_entry(
    metadata: ShardedTensorMetadata, num_local_shards: int, rank: int
) -> ShardMetadata:
    """The one recalculated entry of global ``rank``, which must own ``num_local_shards`` > 0."""
    num_entries = len(metadata.shards_metadata)
    if not num_local_shards or num_entries <= rank:
        raise AssertionError(
            "# for metadata recalculation, local_shards must be larger than 0 "
            f"actual:{num_local_shards}, # glb metadata must be greater than any rank id, "
            f"# metadata:{num_entries}, rank id:{rank}"
        )
    entries = [
        md
        for md in metadata.shards_metadata
        if md.placement is not None and md.placement.rank() == rank
    ]
    if len(entries) != 1:
        raise AssertionError(
            f"should has and only has one metadata for local rank, actual:{entries}"
        )
    return entries[0]


def check_local_shard(shard: Shard, properties: TensorProperties) -> None:
    """Check one of this rank's shards against the global tensor properties."""
    tensor = shard.tensor
    metadata = shard.metadata
    if metadata.placement is None:
        raise AssertionError("Must specify placement for `Shard`!")
    # Messages name the rank of the shard's own placement (upstream's choice).
    rank = metadata.placement.rank()

    def mismatch(prop: str, source: str, expected: Any, actual: Any) -> None:
        if expected != actual:
            raise ValueError(
                f"Local shards' tensor {prop} property is incompatible with {source} on rank "
                f"{rank}: {source} {prop}={expected}, local shard tensor {prop}={actual}."
            )

    mismatch("layout", "tensor property", properties.layout, tensor.layout)
    if not tensor.is_contiguous():
        raise ValueError("Only torch.contiguous_format memory_format is currently supported")
    mismatch("size", "local ShardMetadata", metadata.shard_sizes, list(tensor.size()))
    mismatch("pin_memory", "tensor property", properties.pin_memory, tensor.is_pinned())
    mismatch("device", "local ShardMetadata", metadata.placement.device(), tensor.device)
    mismatch("dtype", "tensor property", properties.dtype, tensor.dtype)
    mismatch("requires_grad", "tensor property", properties.requires_grad, tensor.requires_grad)
