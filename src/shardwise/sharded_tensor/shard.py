"""``Shard``: one local tensor together with its metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.metadata import ShardMetadata
from shardwise.placement import RemoteDevice

__all__ = ["Shard"]


@dataclass(slots=True)
class Shard:
    """A local tensor and the :class:`ShardMetadata` that places it in the global tensor.

    Raises:
        ValueError: The tensor's size or device disagrees with the metadata.
    """

    tensor: torch.Tensor
    metadata: ShardMetadata

    def __post_init__(self) -> None:
        if list(self.tensor.size()) != list(self.metadata.shard_sizes):
            raise ValueError(
                "Shard tensor size does not match with metadata.shard_lengths! "
                f"Found shard tensor size: {list(self.tensor.size())}, "
                f"metadata.shard_lengths: {self.metadata.shard_sizes}, "
            )
        placement = self.metadata.placement
        if placement is not None and placement.device() != self.tensor.device:
            raise ValueError(
                "Local shard tensor device does not match with local Shard's placement! "
                f"Found local shard tensor device: {self.tensor.device}, "
                f"local shard metadata placement device: {placement.device()}"
            )

    @classmethod
    def from_tensor_and_offsets(
        cls, tensor: torch.Tensor, shard_offsets: Sequence[int], rank: int
    ) -> Shard:
        """A shard of ``tensor`` at ``shard_offsets``, placed on global ``rank``.

        Example:
            >>> Shard.from_tensor_and_offsets(torch.zeros(2, 3), [4, 0], rank=1).metadata
            ShardMetadata(shard_offsets=[4, 0], shard_sizes=[2, 3], placement=rank:1/cpu)
        """
        metadata = ShardMetadata(
            shard_offsets=list(shard_offsets),
            shard_sizes=list(tensor.size()),
            placement=RemoteDevice(f"rank:{rank}/{tensor.device}"),
        )
        return cls(tensor, metadata)
