"""EnumerableShardingSpec and check_tensor (reference §6, SPEC deviation 1)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings

from shardwise.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardwise.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    check_tensor,
    validate_non_overlapping_shards_metadata,
)
from tests.unit.sharding_spec._layouts import PLACEMENT, cut_points, tensor_size, tiling


def shard(offsets: list[int], sizes: list[int], placement: str = PLACEMENT) -> ShardMetadata:
    return ShardMetadata(offsets, sizes, placement)


VALID_LAYOUTS = [
    pytest.param([shard([0, 0], [5, 5]), shard([5, 0], [5, 5])], [10, 5], id="row-wise"),
    pytest.param(
        [
            shard([0, 0], [3, 3]),
            shard([0, 3], [3, 3]),
            shard([3, 0], [3, 3]),
            shard([3, 3], [3, 3]),
        ],
        [6, 6],
        id="grid",
    ),
    pytest.param(
        [
            shard([0, 0], [2, 4]),
            shard([0, 4], [4, 2]),
            shard([2, 0], [4, 4]),
            shard([4, 4], [2, 2]),
        ],
        [6, 6],
        id="uneven",
    ),
]


class TestEnumerableShardingSpec:
    @pytest.mark.parametrize(("shards", "size"), VALID_LAYOUTS)
    def test_valid_layouts(self, shards: list[ShardMetadata], size: list[int]) -> None:
        spec = EnumerableShardingSpec(shards)
        check_tensor(spec.shards, torch.Size(size))
        properties = TensorProperties(dtype=torch.int64)
        metadata = spec.build_metadata(torch.Size(size), properties)
        assert isinstance(metadata, ShardedTensorMetadata)
        assert metadata.shards_metadata is shards
        assert metadata.size == torch.Size(size)
        assert metadata.tensor_properties is properties

    def test_empty_shard_list(self) -> None:
        with pytest.raises(ValueError, match=re.escape("Empty shard list provided: []")):
            EnumerableShardingSpec([])

    def test_inconsistent_ranks(self) -> None:
        with pytest.raises(
            ValueError, match=re.escape("Found inconsistent ranks for shards: 2 and 3")
        ):
            EnumerableShardingSpec(
                [shard([0, 0], [1, 1], "cpu"), shard([0, 0, 0], [1, 1, 1], "cpu")]
            )

    def test_overlap(self) -> None:
        first, second = shard([0, 0], [3, 3], "cpu"), shard([2, 0], [3, 3], "cpu")
        message = (
            "Shards ShardMetadata(shard_offsets=[0, 0], shard_sizes=[3, 3], placement=cpu) and "
            "ShardMetadata(shard_offsets=[2, 0], shard_sizes=[3, 3], placement=cpu) overlap"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            EnumerableShardingSpec([first, second])

    def test_dataclass(self) -> None:
        spec = EnumerableShardingSpec([shard([0], [2]), shard([2], [2])])
        assert spec == EnumerableShardingSpec([shard([0], [2]), shard([2], [2])])
        assert spec != EnumerableShardingSpec([shard([0], [4])])
        assert repr(spec) == (
            "EnumerableShardingSpec(shards=["
            "ShardMetadata(shard_offsets=[0], shard_sizes=[2], placement=rank:0/cpu), "
            "ShardMetadata(shard_offsets=[2], shard_sizes=[2], placement=rank:0/cpu)])"
        )

    def test_build_metadata_checks_the_tensor(self) -> None:
        spec = EnumerableShardingSpec([shard([0, 0], [5, 5]), shard([5, 0], [5, 5])])
        with pytest.raises(ValueError, match="Rank of tensor is 3, but shards rank is 2"):
            spec.build_metadata(torch.Size([10, 10, 10]), TensorProperties())
        with pytest.raises(ValueError, match="exceeds tensor dim"):
            spec.build_metadata(torch.Size([10, 3]), TensorProperties())
        with pytest.raises(ValueError, match="do not cover the entire tensor"):
            spec.build_metadata(torch.Size([10, 6]), TensorProperties())


class TestCheckTensor:
    def test_rank_mismatch(self) -> None:
        shards = [shard([0, 0], [5, 5]), shard([5, 0], [5, 5])]
        with pytest.raises(
            ValueError, match=re.escape("Rank of tensor is 3, but shards rank is 2")
        ):
            check_tensor(shards, torch.Size([10, 10, 10]))
        with pytest.raises(
            ValueError, match=re.escape("Rank of tensor is 0, but shards rank is 2")
        ):
            check_tensor(shards, ())

    def test_exceeds_tensor_dim(self) -> None:
        shards = [shard([0, 0], [5, 5]), shard([5, 0], [5, 5])]
        message = (
            "Shard offset 0 and length 5 exceeds tensor dim: 3 for shard "
            "ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement=rank:0/cpu)"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            check_tensor(shards, torch.Size([10, 3]))

    def test_volume_mismatch(self) -> None:
        shards = [shard([0, 0], [5, 5]), shard([5, 5], [5, 5])]
        message = (
            "Total volume of shards: 50 does not match tensor volume: 100, in other words all "
            "the individual shards do not cover the entire tensor"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            check_tensor(shards, torch.Size([10, 10]))

    def test_no_shards(self) -> None:
        with pytest.raises(ValueError, match=re.escape("shards_metadata must not be empty!")):
            check_tensor([], [4])

    def test_empty_shards_are_not_bounds_checked(self) -> None:
        # SPEC deviation 1: 5 rows over 4 ranks puts an empty chunk at offset 6 > 5.
        metadata = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(4)]).build_metadata(
            torch.Size([5, 3]), TensorProperties()
        )
        assert metadata.shards_metadata[3] == shard([6, 0], [0, 3], "rank:3/cpu")
        check_tensor(metadata.shards_metadata, [5, 3])
        # Any empty shard, however far out, is harmless ...
        check_tensor([shard([0, 0], [5, 3]), shard([100, 7], [0, 9])], [5, 3])
        # ... but a non-empty shard past the end still fails, with upstream's message.
        past_end = shard([4, 0], [2, 3])
        message = (
            "Shard offset 4 and length 2 exceeds tensor dim: 5 for shard "
            "ShardMetadata(shard_offsets=[4, 0], shard_sizes=[2, 3], placement=rank:0/cpu)"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            check_tensor([shard([0, 0], [4, 3]), past_end], [5, 3])

    def test_two_rows_over_four_ranks(self) -> None:
        # Upstream: "Shard offset 3 and length 0 exceeds tensor dim: 2".
        metadata = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(4)]).build_metadata(
            torch.Size([2]), TensorProperties()
        )
        assert [s.shard_offsets for s in metadata.shards_metadata] == [[0], [1], [2], [3]]
        EnumerableShardingSpec(metadata.shards_metadata).build_metadata(
            torch.Size([2]), TensorProperties()
        )

    @settings(max_examples=100, deadline=None)
    @given(cuts=cut_points())
    def test_every_tiling_is_valid(self, cuts: list[list[int]]) -> None:
        shards = tiling(cuts)
        validate_non_overlapping_shards_metadata(shards)
        check_tensor(shards, tensor_size(cuts))
        spec = EnumerableShardingSpec(shards)
        assert spec.build_metadata(torch.Size(tensor_size(cuts)), TensorProperties()).size == (
            torch.Size(tensor_size(cuts))
        )
