"""Chunk sharding: one dim split into equal chunks, the ``torch.chunk`` rule.

With ``n`` elements along the sharded dim and ``k`` placements, every chunk is
``split = ceil(n / k)`` long until the dim runs out, so trailing chunks may be shorter or
empty. Chunk ``i`` starts at ``split * i`` even when it is empty, which can lie past the end
of the dim (5 rows over 4 placements: offsets 0, 2, 4, 6); such empty shards are harmless
because :func:`~shardwise.sharding_spec.check_tensor` skips bounds checks for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch

from shardwise.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardwise.placement import RemoteDevice
from shardwise.sharding_spec.api import ScatterByMetadata

__all__ = [
    "ChunkShardingSpec",
    "ShardingDim",
    "get_chunk_sharding_params",
    "get_chunked_dim_size",
    "get_split_size",
]

#: A sharding dim: an index, or (not supported yet) a dimension name.
ShardingDim: TypeAlias = int | str


def get_split_size(dim_size: int, chunks: int) -> int:
    """The length of every non-final chunk when ``dim_size`` is cut into ``chunks`` chunks.

    Args:
        dim_size: Length of the dim being chunked.
        chunks: Number of chunks.

    Returns:
        ``ceil(dim_size / chunks)``, as ``torch.chunk`` computes it.

    Raises:
        ZeroDivisionError: ``chunks`` is 0.
    """
    return (dim_size + chunks - 1) // chunks


def get_chunked_dim_size(dim_size: int, split_size: int, idx: int) -> int:
    """The length of chunk ``idx`` of a dim of length ``dim_size`` cut every ``split_size``.

    Args:
        dim_size: Length of the dim being chunked.
        split_size: Length of every full chunk (see :func:`get_split_size`).
        idx: Index of the chunk.

    Returns:
        The chunk's length: ``split_size``, or less for the chunk that reaches the end of the
        dim, or 0 for chunks past the end.
    """
    return max(min(dim_size, split_size * (idx + 1)) - split_size * idx, 0)


def _check_dim(dim: object) -> int:
    # bool is accepted on purpose (it is an int), as upstream does.
    if isinstance(dim, str):
        raise NotImplementedError("ChunkShardingSpec does not support named dimension yet!")
    if not isinstance(dim, int):
        raise ValueError(f"Sharding dim needs to be an integer, found: {dim}")
    return dim


@dataclass(slots=True)
class ChunkShardingSpec(ScatterByMetadata):
    """Shards a tensor along one dim into ``len(placements)`` chunks, like ``torch.chunk``.

    Chunk ``i`` goes to ``placements[i]``; trailing chunks may be empty (see the module
    docstring for the exact rule). Nothing requires placements to be distinct.

    Args:
        dim: The dim to shard; negative values count from the end.
        placements: Where each chunk lives. Entries that are not :class:`RemoteDevice` yet
            (strings such as ``"rank:0/cpu"`` or ``torch.device`` objects) are converted
            **in place**, in the caller's list.

    Raises:
        NotImplementedError: ``dim`` is a string (named dims are not supported).
        ValueError: ``dim`` is not an integer, or a placement string cannot be parsed.
        TypeError: A placement is neither a string, a ``torch.device`` nor a RemoteDevice.
        RuntimeError: A placement's device part is not a valid ``torch.device``.

    Example:
        >>> spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
        >>> [s.shard_sizes for s in spec.build_metadata(
        ...     torch.Size([5, 2]), TensorProperties()).shards_metadata]
        [[3, 2], [2, 2]]
    """

    dim: ShardingDim
    placements: list[RemoteDevice | str | torch.device]

    def __post_init__(self) -> None:
        _check_dim(self.dim)
        # In place, not a new list: callers (and upstream's tests) keep using the list they
        # passed and expect RemoteDevice entries in it afterwards.
        for i, placement in enumerate(self.placements):
            if not isinstance(placement, RemoteDevice):
                self.placements[i] = RemoteDevice(placement)

    def build_metadata(
        self, tensor_sizes: torch.Size, tensor_properties: TensorProperties
    ) -> ShardedTensorMetadata:
        """Cut a tensor of size ``tensor_sizes`` into this spec's chunks.

        The arguments are those of :meth:`ShardingSpec.build_metadata`.

        Returns:
            One shard per placement, in placement order, with ``tensor_sizes`` (as given) and
            ``tensor_properties``.

        Raises:
            NotImplementedError: ``dim`` is a string.
            ValueError: ``dim`` is not an integer or not a dim of ``tensor_sizes`` (a 0-d size
                has none), or the spec has no placements.
        """
        dim = _check_dim(self.dim)
        num_dims = len(tensor_sizes)
        if dim >= num_dims or dim < -num_dims:
            raise ValueError(f"Invalid sharding dim: {self.dim}")
        if not self.placements:
            # Upstream divides by zero here; say what is wrong instead.
            raise ValueError(
                f"ChunkShardingSpec has no placements, cannot split dim {self.dim} into 0 chunks"
            )
        dim = int(dim) % num_dims
        dim_size = int(tensor_sizes[dim])
        split = get_split_size(dim_size, len(self.placements))
        shards = []
        for idx, placement in enumerate(self.placements):
            offsets = [0] * num_dims
            sizes = [int(size) for size in tensor_sizes]
            offsets[dim] = split * idx
            sizes[dim] = get_chunked_dim_size(dim_size, split, idx)
            shards.append(ShardMetadata(offsets, sizes, _as_remote_device(placement)))
        return ShardedTensorMetadata(shards, tensor_sizes, tensor_properties)


def _as_remote_device(placement: RemoteDevice | str | torch.device) -> RemoteDevice:
    # Placements are converted at construction, but the field stays assignable.
    return placement if isinstance(placement, RemoteDevice) else RemoteDevice(placement)


def get_chunk_sharding_params(
    sharding_dim_size: int, world_size: int, spec: ChunkShardingSpec, rank: int
) -> tuple[int, int]:
    """The start and length of the chunk that ``rank`` owns under ``spec``.

    Chunks are laid out in placement order with the split size of ``sharding_dim_size`` over
    ``world_size`` chunks; the first placement on ``rank`` wins.

    Args:
        sharding_dim_size: Length of the sharded dim.
        world_size: Number of chunks (ranks).
        spec: The chunk spec whose placements give the chunk order.
        rank: The rank whose chunk is wanted, compared with ``placement.rank()``.

    Returns:
        ``(start, length)`` of that rank's chunk along the sharded dim.

    Raises:
        ValueError: No placement of ``spec`` is on ``rank`` (upstream returned a meaningless
            ``(0, <last chunk length>)`` then).

    Example:
        >>> spec = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(4)])
        >>> get_chunk_sharding_params(21, 4, spec, 3)
        (18, 3)
    """
    split = get_split_size(sharding_dim_size, world_size)
    start = 0
    for idx, placement in enumerate(spec.placements):
        length = get_chunked_dim_size(sharding_dim_size, split, idx)
        if _as_remote_device(placement).rank() == rank:
            return start, length
        start += length
    raise ValueError(f"Rank {rank} has no placement in {spec}")
