"""_infer_sharding_spec_from_shards_metadata (reference §6 and §10.1)."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.metadata import ShardMetadata, TensorProperties
from shardwise.placement import RemoteDevice
from shardwise.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    _infer_sharding_spec_from_shards_metadata,
    get_chunked_dim_size,
    get_split_size,
)
from tests.unit.sharding_spec._layouts import cut_points, tiling


def chunk_layout(
    placements: list[RemoteDevice | str | torch.device], dim: int, size: list[int]
) -> list[ShardMetadata]:
    """The shards of a chunk spec, listed by placement rank (as upstream's test builds them)."""
    spec = ChunkShardingSpec(dim, placements)
    shards = spec.build_metadata(torch.Size(size), TensorProperties()).shards_metadata
    by_rank: list[ShardMetadata | None] = [None] * len(shards)
    for shard in shards:
        assert shard.placement is not None
        rank = shard.placement.rank()
        assert rank is not None
        by_rank[rank] = shard
    return [s for s in by_rank if s is not None]


class TestExamples:
    def test_enumerable_cases(self) -> None:
        cases = [
            [ShardMetadata([0, 0], [5, 5], "cpu"), ShardMetadata([5, 0], [10, 5], "cpu")],
            [ShardMetadata([0], [16], "cpu"), ShardMetadata([16], [9], "cpu")],
            [
                ShardMetadata([0, 0], [5, 5], "rank:0/cpu"),
                ShardMetadata([5, 0], [5, 5], "rank:1/cpu"),
                ShardMetadata([0, 5], [5, 5], "rank:2/cpu"),
                ShardMetadata([5, 5], [5, 5], "rank:3/cpu"),
            ],
        ]
        for shards in cases:
            spec = _infer_sharding_spec_from_shards_metadata(shards)
            assert isinstance(spec, EnumerableShardingSpec)
            assert spec.shards is shards

    @pytest.mark.parametrize(
        ("dim", "size"),
        [
            (0, [4, 16]),
            (0, [5, 15, 16]),
            (1, [12, 16]),
            (2, [4, 18, 15]),
            (3, [7, 12, 16, 37]),
            (4, [50, 4, 18, 15, 77]),
        ],
    )
    @pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 3, 0, 1], [3, 0, 1, 2], [1, 3, 0, 2]])
    def test_chunk_cases(self, dim: int, size: list[int], order: list[int]) -> None:
        placements: list[RemoteDevice | str | torch.device] = [f"rank:{r}/cpu" for r in order]
        spec = _infer_sharding_spec_from_shards_metadata(chunk_layout(placements, dim, size))
        assert isinstance(spec, ChunkShardingSpec)
        assert spec.dim == dim
        assert spec.placements == placements

    def test_rows_of_a_6x3_tensor(self) -> None:
        # Reference §10.1: ranks 0-2 hold [2, 3] at [2r, 0], rank 3 holds nothing.
        shards = [ShardMetadata([2 * r, 0], [2, 3], f"rank:{r}/cpu") for r in range(3)]
        spec = _infer_sharding_spec_from_shards_metadata(shards)
        assert spec == ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"])

    def test_stacked_uneven_rows_are_enumerable(self) -> None:
        # Reference §10.1: recalculated [r + 1, 2] shards at offsets 0, 1, 3, 6 of (10, 2).
        shards = [
            ShardMetadata([offset, 0], [r + 1, 2], f"rank:{r}/cpu")
            for r, offset in enumerate([0, 1, 3, 6])
        ]
        spec = _infer_sharding_spec_from_shards_metadata(shards)
        assert isinstance(spec, EnumerableShardingSpec)
        assert spec.shards is shards

    def test_placements_ordered_by_offset(self) -> None:
        shards = [
            ShardMetadata([0, 8], [4, 4], "rank:2/cpu"),
            ShardMetadata([0, 0], [4, 4], "rank:1/cpu"),
            ShardMetadata([0, 4], [4, 4], "rank:0/cpu"),
        ]
        spec = _infer_sharding_spec_from_shards_metadata(shards)
        assert spec == ChunkShardingSpec(1, ["rank:1/cpu", "rank:0/cpu", "rank:2/cpu"])

    def test_trailing_empty_chunks(self) -> None:
        # 5 rows over 4 ranks: the empty chunk sits at offset 6, past the end.
        placements: list[RemoteDevice | str | torch.device] = [
            f"rank:{r}/cpu" for r in (3, 1, 0, 2)
        ]
        shards = ChunkShardingSpec(0, list(placements)).build_metadata(
            torch.Size([5, 2]), TensorProperties()
        )
        reversed_shards = list(reversed(shards.shards_metadata))
        spec = _infer_sharding_spec_from_shards_metadata(reversed_shards)
        assert spec == ChunkShardingSpec(0, placements)

    @pytest.mark.parametrize(
        "shards",
        [
            [ShardMetadata([0, 0], [4, 4], "rank:0/cpu")],
            [ShardMetadata([0, 0], [0, 4], "rank:0/cpu"), ShardMetadata([0, 0], [4, 4], "cpu")],
            [ShardMetadata([0], [0], "rank:0/cpu"), ShardMetadata([0], [0], "rank:1/cpu")],
        ],
    )
    def test_all_zero_offsets_are_enumerable(self, shards: list[ShardMetadata]) -> None:
        spec = _infer_sharding_spec_from_shards_metadata(shards)
        assert isinstance(spec, EnumerableShardingSpec)
        assert spec.shards is shards

    def test_offsets_along_two_dims_are_enumerable(self) -> None:
        # Each shard is offset along one dim only, but not the same one. (Upstream's
        # truthiness test on the chosen dim let dim 1 replace dim 0 and returned a chunk spec.)
        shards = [
            ShardMetadata([2, 0], [2, 3], "rank:0/cpu"),
            ShardMetadata([0, 3], [2, 3], "rank:1/cpu"),
        ]
        assert isinstance(_infer_sharding_spec_from_shards_metadata(shards), EnumerableShardingSpec)

    def test_shards_without_placement_are_enumerable(self) -> None:
        # A chunk spec needs placements; upstream raised a TypeError building one.
        shards = [ShardMetadata([0], [2]), ShardMetadata([2], [2])]
        assert isinstance(_infer_sharding_spec_from_shards_metadata(shards), EnumerableShardingSpec)

    def test_errors_of_the_enumerable_spec(self) -> None:
        with pytest.raises(ValueError, match="Empty shard list provided: \\[\\]"):
            _infer_sharding_spec_from_shards_metadata([])
        with pytest.raises(ValueError, match="overlap"):
            _infer_sharding_spec_from_shards_metadata(
                [ShardMetadata([0], [4], "cpu"), ShardMetadata([2], [4], "cpu")]
            )

    def test_input_not_modified(self) -> None:
        shards = [ShardMetadata([2 * r, 0], [2, 3], f"rank:{r}/cpu") for r in (2, 0, 1)]
        placements = [s.placement for s in shards]
        before = copy.deepcopy(shards)
        spec = _infer_sharding_spec_from_shards_metadata(shards)
        assert isinstance(spec, ChunkShardingSpec)
        assert shards == before
        assert [s.placement for s in shards] == placements
        assert all(s.placement is p for s, p in zip(shards, placements, strict=True))
        assert spec.placements is not placements


def is_ceil_chunking(shards: list[ShardMetadata], size: list[int]) -> int | None:
    """The dim along which ``shards`` are exactly a chunk layout with a non-zero offset."""
    for dim in range(len(size)):
        others = [d for d in range(len(size)) if d != dim]
        if any(
            s.shard_offsets[d] != 0 or s.shard_sizes[d] != size[d] for s in shards for d in others
        ):
            continue
        chunks = len(shards)
        split = get_split_size(size[dim], chunks)
        expected = [(split * i, get_chunked_dim_size(size[dim], split, i)) for i in range(chunks)]
        actual = sorted((s.shard_offsets[dim], s.shard_sizes[dim]) for s in shards)
        if actual == expected and any(offset for offset, _ in actual):
            return dim
    return None


# (dim size, chunks) whose chunk offsets all lie within the dim, so that cut points can
# reproduce them (an empty chunk past the end cannot come from cut points).
CUT_POINT_CHUNKINGS = [
    (size, chunks)
    for size, chunks in itertools.product([1, 4, 5, 9, 13], [2, 3, 4])
    if all(get_split_size(size, chunks) * i <= size for i in range(chunks))
]


@st.composite
def chunk_like_cuts(draw: st.DrawFn) -> list[list[int]]:
    """Cut points of a chunk layout along one dim (sometimes with one point moved)."""
    num_dims = draw(st.integers(1, 3))
    cuts = [[0, draw(st.integers(0, 6))] for _ in range(num_dims)]
    size = draw(st.integers(1, 20))
    chunks = draw(st.integers(2, 6))
    split = get_split_size(size, chunks)
    points = [min(size, split * i) for i in range(chunks + 1)]
    if draw(st.booleans()):
        at = draw(st.integers(1, chunks - 1))
        points[at] = draw(st.integers(points[at - 1], points[at + 1]))
    cuts[draw(st.integers(0, num_dims - 1))] = points
    return cuts


class TestProperties:
    @settings(max_examples=100, deadline=None)
    @given(
        size=st.lists(st.integers(0, 9), min_size=1, max_size=3),
        chunks=st.integers(1, 8),
        data=st.data(),
    )
    def test_chunk_layouts_infer_their_spec(
        self, size: list[int], chunks: int, data: st.DataObject
    ) -> None:
        dim = data.draw(st.integers(0, len(size) - 1))
        placements: list[RemoteDevice | str | torch.device] = list(
            data.draw(st.permutations([f"rank:{r}/cpu" for r in range(chunks)]))
        )
        built = ChunkShardingSpec(dim, list(placements)).build_metadata(
            torch.Size(size), TensorProperties()
        )
        shards = data.draw(st.permutations(built.shards_metadata))
        spec = _infer_sharding_spec_from_shards_metadata(shards)
        if chunks >= 2 and size[dim] >= 1:
            assert spec == ChunkShardingSpec(dim, placements)
        else:
            # One chunk, or an empty dim: every offset is zero.
            assert isinstance(spec, EnumerableShardingSpec)

    @settings(max_examples=100, deadline=None)
    @given(cuts=cut_points() | chunk_like_cuts(), seed=st.randoms(use_true_random=False))
    def test_tilings_infer_chunk_exactly_when_chunked(
        self, cuts: list[list[int]], seed: random.Random
    ) -> None:
        shards = tiling(cuts)
        for rank, shard in enumerate(shards):
            shard.placement = RemoteDevice(f"rank:{rank}/cpu")
        seed.shuffle(shards)
        size = [points[-1] for points in cuts]
        spec = _infer_sharding_spec_from_shards_metadata(shards)
        dim = is_ceil_chunking(shards, size)
        if dim is None:
            assert isinstance(spec, EnumerableShardingSpec)
            return
        assert isinstance(spec, ChunkShardingSpec)
        assert spec.dim == dim
        rebuilt = spec.build_metadata(torch.Size(size), TensorProperties()).shards_metadata
        key = lambda s: (s.shard_offsets, s.shard_sizes, str(s.placement))  # noqa: E731
        assert sorted(rebuilt, key=key) == sorted(shards, key=key)

    @pytest.mark.parametrize(("size", "chunks"), CUT_POINT_CHUNKINGS)
    def test_chunk_tilings_from_cut_points(self, size: int, chunks: int) -> None:
        # Cut points that reproduce a chunk layout exactly infer a chunk spec ...
        split = get_split_size(size, chunks)
        points = [min(size, split * i) for i in range(chunks + 1)]
        shards = tiling([points, [0, 3]])
        for rank, shard in enumerate(shards):
            shard.placement = RemoteDevice(f"rank:{rank}/cpu")
        assert is_ceil_chunking(shards, [size, 3]) == 0
        assert isinstance(_infer_sharding_spec_from_shards_metadata(shards), ChunkShardingSpec)
        # ... and moving one cut point makes them enumerable.
        if chunks >= 2 and points[1] > 1:
            points[1] -= 1
            moved = tiling([points, [0, 3]])
            assert isinstance(
                _infer_sharding_spec_from_shards_metadata(moved), EnumerableShardingSpec
            )
