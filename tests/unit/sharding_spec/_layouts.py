"""Shard layouts and a brute-force overlap reference for the sharding-spec tests."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from hypothesis import strategies as st

from shardwise.metadata import ShardMetadata
from shardwise.placement import RemoteDevice

PLACEMENT = "rank:0/cpu"
# Shared by the shards of a tiling: parsing a placement per shard dominates large layouts.
_TILING_PLACEMENT = RemoteDevice(PLACEMENT)


def tiling(cuts: Sequence[Sequence[int]]) -> list[ShardMetadata]:
    """The grid of cells between consecutive cut points, one list of cut points per dim.

    Repeated cut points make zero-size cells.
    """
    cells = [list(itertools.pairwise(points)) for points in cuts]
    return [
        ShardMetadata(
            [start for start, _ in cell],
            [end - start for start, end in cell],
            _TILING_PLACEMENT,
        )
        for cell in itertools.product(*cells)
    ]


def tensor_size(cuts: Sequence[Sequence[int]]) -> list[int]:
    return [points[-1] for points in cuts]


@st.composite
def cut_points(
    draw: st.DrawFn, min_dims: int = 1, max_dims: int = 3, max_inner: int = 3
) -> list[list[int]]:
    """Cut points for a random grid: per dim, sorted points from 0 to the dim size.

    At most ``max_inner`` points besides the ends, so at most ``max_inner + 1`` cells per dim
    (which keeps the brute-force reference cheap).
    """
    num_dims = draw(st.integers(min_dims, max_dims))
    cuts = []
    for _ in range(num_dims):
        size = draw(st.integers(0, 12))
        inner = draw(st.lists(st.integers(0, size), max_size=max_inner))
        cuts.append(sorted([0, *inner, size]))
    return cuts


def _overlap(a: ShardMetadata, b: ShardMetadata) -> bool:
    return all(
        max(oa, ob) < min(oa + sa, ob + sb)
        for oa, sa, ob, sb in zip(
            a.shard_offsets, a.shard_sizes, b.shard_offsets, b.shard_sizes, strict=True
        )
    )


def reference_overlap(shards: Sequence[ShardMetadata]) -> bool:
    """Whether the overlap contract reports an overlap, by examining every pair.

    * 0 or 1 shard: no.
    * All shards identical: yes unless they are all empty with all-zero offsets.
    * Shards differing along one dim only: if the shards are empty because another dim has
      length 0, no; otherwise intervals ``[offset, offset + size - 1]`` sorted, an
      interval that reaches a later one's start overlaps it.
    * Several dims: two shards overlap when they share an element.
    """
    if len(shards) <= 1:
        return False
    first = shards[0]
    num_dims = len(first.shard_offsets)
    sharded = [
        dim
        for dim in range(num_dims)
        if any(
            s.shard_offsets[dim] != first.shard_offsets[dim]
            or s.shard_sizes[dim] != first.shard_sizes[dim]
            for s in shards
        )
    ]
    if not sharded:
        return not all(not any(s.shard_offsets) and math.prod(s.shard_sizes) == 0 for s in shards)
    if len(sharded) == 1:
        (dim,) = sharded
        if any(first.shard_sizes[other] == 0 for other in range(num_dims) if other != dim):
            return False
        intervals = sorted(
            (s.shard_offsets[dim], s.shard_offsets[dim] + s.shard_sizes[dim] - 1, i)
            for i, s in enumerate(shards)
        )
        return any(
            earlier[1] >= later[0] for earlier, later in itertools.combinations(intervals, 2)
        )
    return any(_overlap(a, b) for a, b in itertools.combinations(shards, 2))
