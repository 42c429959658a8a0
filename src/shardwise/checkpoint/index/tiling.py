"""Whether a tensor's chunks tile it exactly (for save and every index decoder): by arithmetic
for a split along one dim (:func:`split_tiles`), else by the general sweep."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise._boxes import Box
from shardwise.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)

__all__ = ["check_tiling", "check_tiling_generally", "split_tiles"]


@dataclass(frozen=True, slots=True)
class _Chunk:
    """A box as the shard-layout checks read it (no validation of its own: cheap)."""

    shard_offsets: tuple[int, ...]
    shard_sizes: tuple[int, ...]

    def __repr__(self) -> str:
        return f"chunk(offsets={list(self.shard_offsets)}, sizes={list(self.shard_sizes)})"


def check_tiling(size: Sequence[int], boxes: Sequence[Box]) -> None:
    """Check that ``boxes`` tile a tensor of ``size`` exactly: each has its dims, none overlap,
    they cover it, and one with elements lies inside (an empty one anywhere: the ceil rule).

    Raises:
        ValueError: The boxes do not tile the tensor (the message says how).
    """
    if not boxes:
        raise ValueError("there are no chunks")
    ndim = len(size)
    if not ndim and len(boxes) != 1:
        raise ValueError("a 0-d tensor must be one chunk")
    for offsets, sizes in boxes:
        if len(offsets) != ndim or len(sizes) != ndim:
            raise ValueError(
                f"the chunk at offsets {list(offsets)} with sizes {list(sizes)} does not have "
                f"the {ndim} dims of the tensor"
            )
    if len(boxes) == 1:  # a replicated or unsharded tensor: the common case
        offsets, sizes = boxes[0]
        if not any(offsets) and tuple(sizes) == tuple(size):
            return
    elif split_tiles(size, boxes):
        return
    check_tiling_generally(size, boxes)


def split_tiles(size: Sequence[int], boxes: Sequence[Box]) -> bool:
    """Whether ``boxes`` (each of ``len(size)`` dims, tuples: a box of lists never matches)
    tile a tensor of ``size`` as a split along one dim, what FSDP, row- and column-wise
    sharding save, at a quarter of the general sweep's cost for 4 chunks. ``True`` proves the
    tiling; ``False`` proves nothing (the general check decides, and words its error)."""
    ndim = len(size)
    if not ndim or min(size) <= 0:
        return False
    dim = -1
    extents = []
    for offsets, sizes in boxes:
        if dim < 0:  # the split dim: where the first box with elements is not whole
            if not math.prod(sizes):
                continue
            dim = next((d for d in range(ndim) if offsets[d] or sizes[d] != size[d]), 0)
            after = dim + 1
            head, tail = tuple(size[:dim]), tuple(size[after:])
            zeros_head, zeros_tail = (0,) * dim, (0,) * (ndim - after)
        if (
            sizes[after:] == tail
            and offsets[after:] == zeros_tail
            and (not dim or (sizes[:dim] == head and offsets[:dim] == zeros_head))
        ):
            if sizes[dim]:
                extents.append((offsets[dim], sizes[dim]))
        elif math.prod(sizes):
            return False
    if dim < 0:
        return False
    extents.sort()
    end = 0
    for start, length in extents:
        if start != end or length < 0:
            return False
        end += length
    return end == size[dim]


def check_tiling_generally(size: Sequence[int], boxes: Sequence[Box]) -> None:
    """:func:`check_tiling` (and its ``ValueError``) of boxes that have the tensor's dims, by
    an O(n log n) overlap sweep and coverage by volume."""
    filled = [_Chunk(tuple(offsets), tuple(sizes)) for offsets, sizes in boxes if math.prod(sizes)]
    if not filled:
        if math.prod(size):
            raise ValueError(f"the chunks hold no elements of a tensor of size {list(size)}")
        return
    validate_non_overlapping_shards_metadata(filled)
    check_tensor(filled, list(size))
