"""ChunkShardingSpec and the chunk arithmetic (reference §5)."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardwise.placement import RemoteDevice
from shardwise.sharding_spec import (
    ChunkShardingSpec,
    check_tensor,
    get_chunk_sharding_params,
    get_chunked_dim_size,
    get_split_size,
    validate_non_overlapping_shards_metadata,
)

PARSE_ERROR = (
    "Could not parse remote_device: {}. The valid format is '<workername>/<device>' or "
    "'rank:<rank>/<device>' or '<device>'"
)


def ranks(count: int) -> list[RemoteDevice | str | torch.device]:
    return [f"rank:{r}/cpu" for r in range(count)]


def layout(spec: ChunkShardingSpec, size: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    metadata = spec.build_metadata(torch.Size(size), TensorProperties())
    return (
        [s.shard_sizes for s in metadata.shards_metadata],
        [s.shard_offsets for s in metadata.shards_metadata],
    )


class TestConstruction:
    @pytest.mark.parametrize(
        "placements",
        [
            [torch.device("cpu"), torch.device("cuda", 1)],
            ["cuda:0", "cuda:1"],
            ["rank:0/cuda:0", "rank:0/cuda:1"],
            ["rank:0", "rank:1"],
            ["rank:0/cpu", "rank:1/cpu"],
        ],
    )
    def test_valid_placements_become_remote_devices(
        self, placements: list[RemoteDevice | str | torch.device]
    ) -> None:
        spec = ChunkShardingSpec(-1, placements)
        assert all(isinstance(p, RemoteDevice) for p in spec.placements)

    def test_placements_converted_in_the_callers_list(self) -> None:
        placements = ranks(2)
        placements.append(RemoteDevice("rank:2/cpu"))
        kept = placements[2]
        spec = ChunkShardingSpec(dim=0, placements=placements)
        assert spec.placements is placements
        assert placements == [RemoteDevice(f"rank:{r}/cpu") for r in range(3)]
        assert placements[2] is kept

    def test_equality_and_repr(self) -> None:
        spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
        assert repr(spec) == "ChunkShardingSpec(dim=0, placements=[rank:0/cpu, rank:1/cpu])"
        assert spec == ChunkShardingSpec(0, [RemoteDevice("rank:0/cpu"), "rank:1/cpu"])
        assert spec != ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu"])
        assert spec != ChunkShardingSpec(0, ["rank:1/cpu", "rank:0/cpu"])
        assert copy.deepcopy(spec) == spec
        assert pickle.loads(pickle.dumps(spec)) == spec

    def test_named_dim_not_implemented(self) -> None:
        with pytest.raises(
            NotImplementedError,
            match=re.escape("ChunkShardingSpec does not support named dimension yet!"),
        ):
            ChunkShardingSpec("N", ranks(2))

    @pytest.mark.parametrize(("dim", "shown"), [(None, "None"), ({}, "{}"), (1.0, "1.0")])
    def test_non_integer_dim(self, dim: object, shown: str) -> None:
        with pytest.raises(
            ValueError, match=re.escape(f"Sharding dim needs to be an integer, found: {shown}")
        ):
            ChunkShardingSpec(dim, ranks(2))  # type: ignore[arg-type]

    def test_bool_dim_is_an_int(self) -> None:
        spec = ChunkShardingSpec(True, ranks(2))
        assert layout(spec, [3, 4]) == ([[3, 2], [3, 2]], [[0, 0], [0, 2]])

    @pytest.mark.parametrize("placement", ["random:0", "cuda:foo", "rank:foo", "foo:0"])
    def test_unparsable_placement(self, placement: str) -> None:
        with pytest.raises(ValueError, match=re.escape(PARSE_ERROR.format(placement))):
            ChunkShardingSpec(0, [placement, "cpu"])

    @pytest.mark.parametrize(
        ("placement", "message"),
        [
            ("rank:0/foo", "Expected one of"),
            ("rank:0/random:0", "Expected one of"),
            ("rank:0/cuda:foo", "Invalid device string: 'cuda:foo'"),
        ],
    )
    def test_invalid_placement_device(self, placement: str, message: str) -> None:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            ChunkShardingSpec(0, [placement, "cpu"])

    def test_invalid_placement_type(self) -> None:
        with pytest.raises(TypeError, match=re.escape("Invalid type for remote_device: <class")):
            ChunkShardingSpec(0, [None])  # type: ignore[list-item]


# (dim size, chunks) -> (sizes, offsets), reference §5.
CHUNK_TABLE = [
    (10, 4, [3, 3, 3, 1], [0, 3, 6, 9]),
    (9, 4, [3, 3, 3, 0], [0, 3, 6, 9]),
    (5, 4, [2, 2, 1, 0], [0, 2, 4, 6]),
    (2, 4, [1, 1, 0, 0], [0, 1, 2, 3]),
    (1, 4, [1, 0, 0, 0], [0, 1, 2, 3]),
    (0, 4, [0, 0, 0, 0], [0, 0, 0, 0]),
    (13, 4, [4, 4, 4, 1], [0, 4, 8, 12]),
    (3, 8, [1, 1, 1, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]),
]


class TestBuildMetadata:
    @pytest.mark.parametrize(("dim_size", "chunks", "sizes", "offsets"), CHUNK_TABLE)
    def test_chunk_table_1d(
        self, dim_size: int, chunks: int, sizes: list[int], offsets: list[int]
    ) -> None:
        spec = ChunkShardingSpec(0, ranks(chunks))
        assert layout(spec, [dim_size]) == ([[s] for s in sizes], [[o] for o in offsets])

    @pytest.mark.parametrize(("dim_size", "chunks", "sizes", "offsets"), CHUNK_TABLE)
    @pytest.mark.parametrize(("dim", "negative"), [(0, -3), (1, -2), (2, -1)])
    def test_chunk_table_3d(
        self,
        dim_size: int,
        chunks: int,
        sizes: list[int],
        offsets: list[int],
        dim: int,
        negative: int,
    ) -> None:
        size = [7, 5, 3]
        size[dim] = dim_size
        expected_sizes, expected_offsets = [], []
        for length, offset in zip(sizes, offsets, strict=True):
            shard_size, shard_offset = list(size), [0, 0, 0]
            shard_size[dim], shard_offset[dim] = length, offset
            expected_sizes.append(shard_size)
            expected_offsets.append(shard_offset)
        expected = (expected_sizes, expected_offsets)
        assert layout(ChunkShardingSpec(dim, ranks(chunks)), size) == expected
        assert layout(ChunkShardingSpec(negative, ranks(chunks)), size) == expected

    def test_result_metadata(self) -> None:
        placements = ["rank:1/cpu", "rank:0/cpu"]
        spec = ChunkShardingSpec(0, placements)
        size = torch.Size([4, 2])
        properties = TensorProperties(dtype=torch.float16, requires_grad=True)
        metadata = spec.build_metadata(size, properties)
        assert isinstance(metadata, ShardedTensorMetadata)
        assert metadata.size is size
        assert metadata.tensor_properties is properties
        assert metadata.shards_metadata == [
            ShardMetadata([0, 0], [2, 2], "rank:1/cpu"),
            ShardMetadata([2, 0], [2, 2], "rank:0/cpu"),
        ]

    @pytest.mark.parametrize(("dim", "size"), [(2, [3, 4]), (-3, [3, 4]), (0, []), (-1, [])])
    def test_invalid_sharding_dim(self, dim: int, size: list[int]) -> None:
        spec = ChunkShardingSpec(dim, ranks(2))
        with pytest.raises(ValueError, match=re.escape(f"Invalid sharding dim: {dim}")):
            spec.build_metadata(torch.Size(size), TensorProperties())

    def test_dim_revalidated(self) -> None:
        spec = ChunkShardingSpec(0, ranks(2))
        spec.dim = "N"
        with pytest.raises(NotImplementedError, match="not support named dimension"):
            spec.build_metadata(torch.Size([4]), TensorProperties())
        spec.dim = None  # type: ignore[assignment]
        with pytest.raises(ValueError, match=re.escape("needs to be an integer, found: None")):
            spec.build_metadata(torch.Size([4]), TensorProperties())

    def test_no_placements(self) -> None:
        spec = ChunkShardingSpec(0, [])
        with pytest.raises(ValueError, match="has no placements"):
            spec.build_metadata(torch.Size([4]), TensorProperties())

    def test_empty_trailing_chunks_pass_validation(self) -> None:
        # SPEC deviation 1: offsets stay split * i (6 > 5 here), and the layout is valid.
        spec = ChunkShardingSpec(0, ranks(4))
        metadata = spec.build_metadata(torch.Size([5, 3]), TensorProperties())
        assert [s.shard_offsets[0] for s in metadata.shards_metadata] == [0, 2, 4, 6]
        validate_non_overlapping_shards_metadata(metadata.shards_metadata)
        check_tensor(metadata.shards_metadata, metadata.size)

    @settings(max_examples=100, deadline=None)
    @given(
        size=st.lists(st.integers(0, 9), min_size=1, max_size=3),
        chunks=st.integers(1, 12),
        data=st.data(),
    )
    def test_matches_torch_chunk(self, size: list[int], chunks: int, data: st.DataObject) -> None:
        dim = data.draw(st.integers(-len(size), len(size) - 1))
        metadata = ChunkShardingSpec(dim, ranks(chunks)).build_metadata(
            torch.Size(size), TensorProperties()
        )
        shards = metadata.shards_metadata
        lengths = [s.shard_sizes[dim] for s in shards]
        torch_lengths = [t.size(dim) for t in torch.empty(size).chunk(chunks, dim)]
        assert lengths == torch_lengths + [0] * (chunks - len(torch_lengths))
        assert sum(lengths) == size[dim]
        split = get_split_size(size[dim], chunks)
        assert [s.shard_offsets[dim] for s in shards] == [split * i for i in range(chunks)]
        for shard in shards:
            others = [d for d in range(len(size)) if d != dim % len(size)]
            assert [shard.shard_sizes[d] for d in others] == [size[d] for d in others]
            assert [shard.shard_offsets[d] for d in others] == [0] * len(others)
        validate_non_overlapping_shards_metadata(shards)
        check_tensor(shards, size)


@pytest.mark.parametrize(
    ("dim_size", "chunks", "expected"),
    [(11, 4, 3), (12, 4, 3), (13, 4, 4), (5, 4, 2), (11, 1, 11), (11, 11, 1), (0, 3, 0)],
)
def test_get_split_size(dim_size: int, chunks: int, expected: int) -> None:
    assert get_split_size(dim_size, chunks) == expected


@pytest.mark.parametrize(
    ("dim_size", "split", "idx", "expected"),
    [(11, 3, 0, 3), (11, 3, 3, 2), (13, 4, 0, 4), (13, 4, 3, 1), (5, 2, 3, 0), (5, 2, 9, 0)],
)
def test_get_chunked_dim_size(dim_size: int, split: int, idx: int, expected: int) -> None:
    assert get_chunked_dim_size(dim_size, split, idx) == expected


class TestGetChunkShardingParams:
    def test_in_placement_order(self) -> None:
        placements = ranks(4)
        spec = ChunkShardingSpec(dim=0, placements=placements)
        assert get_chunk_sharding_params(21, 4, spec, 1) == (6, 6)
        assert get_chunk_sharding_params(21, 4, spec, 3) == (18, 3)
        # As upstream's test does: reorder the (converted, in place) list and assign it back.
        placements[1], placements[2] = placements[2], placements[1]
        placements[0], placements[3] = placements[3], placements[0]
        spec.placements = placements
        assert get_chunk_sharding_params(21, 4, spec, 1) == (12, 6)
        assert get_chunk_sharding_params(21, 4, spec, 3) == (0, 6)

    def test_rank_without_placement(self) -> None:
        spec = ChunkShardingSpec(0, ranks(2))
        with pytest.raises(ValueError, match=re.escape("Rank 5 has no placement in")):
            get_chunk_sharding_params(8, 2, spec, 5)
