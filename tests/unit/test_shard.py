"""``Shard`` validation and construction, and ``ShardedTensorBase`` built without any process
group (both pure: no worker processes, no ``init_process_group``)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Shard, ShardedTensorBase, ShardedTensorMetadata, ShardMetadata

# -- Shard -------------------------------------------------------------------------------------


def test_shard_keeps_its_tensor_and_metadata() -> None:
    tensor = torch.arange(6.0).view(2, 3)
    md = ShardMetadata([4, 0], [2, 3], "rank:1/cpu")
    shard = Shard(tensor, md)
    assert shard.tensor is tensor
    assert shard.metadata is md
    # Keyword construction, as upstream code writes it.
    assert Shard(tensor=tensor, metadata=md).metadata is md


def test_shard_size_mismatch_message() -> None:
    md = ShardMetadata([0, 0], [5, 5], "rank:0/cpu")
    expected = (
        "Shard tensor size does not match with metadata.shard_lengths! "
        "Found shard tensor size: [2, 3], metadata.shard_lengths: [5, 5], "
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        Shard(torch.randn(2, 3), md)
    # A different number of dims is a size mismatch too.
    with pytest.raises(ValueError, match=re.escape("Found shard tensor size: [25]")):
        Shard(torch.randn(25), md)


def test_shard_device_mismatch_message() -> None:
    md = ShardMetadata([0, 0], [5, 5], "rank:0/meta")
    expected = (
        "Local shard tensor device does not match with local Shard's placement! "
        "Found local shard tensor device: cpu, local shard metadata placement device: meta"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        Shard(torch.randn(5, 5), md)


def test_shard_cpu_with_index_is_not_plain_cpu() -> None:
    # torch.device("cpu:0") != torch.device("cpu"): an indexed CPU placement never matches a
    # CPU tensor (upstream behavior; CPU placements are written "rank:N/cpu").
    md = ShardMetadata([0], [2], "rank:0/cpu:0")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Found local shard tensor device: cpu, local shard metadata placement device: cpu:0"
        ),
    ):
        Shard(torch.zeros(2), md)


def test_shard_size_is_checked_before_device() -> None:
    md = ShardMetadata([0], [3], "rank:0/meta")
    with pytest.raises(ValueError, match=r"^Shard tensor size does not match"):
        Shard(torch.zeros(2), md)


def test_shard_without_placement_is_allowed() -> None:
    shard = Shard(torch.zeros(10), ShardMetadata([0], [10]))
    assert shard.metadata.placement is None
    assert shard.tensor.shape == (10,)


def test_shard_accepts_a_sparse_tensor() -> None:
    # Only sizes and device are checked, so a sparse COO tensor is a valid Shard.
    sparse = torch.randn(5, 5).to_sparse()
    shard = Shard(sparse, ShardMetadata([0, 0], [5, 5], "rank:0/cpu"))
    assert shard.tensor.layout == torch.sparse_coo


def test_shard_accepts_meta_and_empty_tensors() -> None:
    meta = Shard(torch.empty(3, 2, device="meta"), ShardMetadata([0, 0], [3, 2], "rank:2/meta"))
    assert meta.tensor.is_meta
    empty = Shard(torch.empty(0, 4), ShardMetadata([6, 0], [0, 4], "rank:3/cpu"))
    assert empty.tensor.numel() == 0


def test_from_tensor_and_offsets() -> None:
    tensor = torch.randn(5, 5)
    shard = Shard.from_tensor_and_offsets(tensor, shard_offsets=[5, 0], rank=2)
    assert shard.tensor is tensor
    expected = ShardMetadata([5, 0], [5, 5], "rank:2/cpu")
    assert shard.metadata == expected
    # Sizes are stored as a list (dataclass equality: a list never equals a torch.Size).
    assert type(shard.metadata.shard_sizes) is list
    assert type(shard.metadata.shard_offsets) is list
    assert str(shard.metadata.placement) == "rank:2/cpu"
    assert shard.metadata.placement is not None
    assert shard.metadata.placement.rank() == 2
    assert shard.metadata.placement.device() == torch.device("cpu")


def test_from_tensor_and_offsets_equals_explicit_construction() -> None:
    tensor = torch.randn(2, 3)
    explicit = Shard(tensor, ShardMetadata([0, 3], [2, 3], "rank:1/cpu"))
    derived = Shard.from_tensor_and_offsets(tensor, (0, 3), 1)
    assert derived.metadata == explicit.metadata


def test_from_tensor_and_offsets_uses_the_tensor_device() -> None:
    shard = Shard.from_tensor_and_offsets(torch.empty(4, device="meta"), [8], 3)
    assert str(shard.metadata.placement) == "rank:3/meta"
    assert shard.metadata.shard_sizes == [4]


def test_from_tensor_and_offsets_validates_offsets() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "shard_offsets and shard_sizes should have the same number of elements, "
            "found 1 and [2, 3] respectively"
        ),
    ):
        Shard.from_tensor_and_offsets(torch.zeros(2, 3), [0], 0)
    with pytest.raises(ValueError, match=re.escape("shard_offsets should be >=0")):
        Shard.from_tensor_and_offsets(torch.zeros(2, 3), [-1, 0], 0)


# -- ShardedTensorBase with no process group -----------------------------------------------


def _two_row_blocks() -> ShardedTensorMetadata:
    return ShardedTensorMetadata(
        shards_metadata=[
            ShardMetadata([0, 0], [2, 2], "rank:0/cpu"),
            ShardMetadata([2, 0], [2, 2], "rank:1/cpu"),
        ],
        size=torch.Size([4, 2]),
    )


def test_base_init_needs_no_process_group() -> None:
    assert not dist.is_initialized()
    metadata = _two_row_blocks()
    shards = [
        Shard(torch.full(md.shard_sizes, float(i)), md)
        for i, md in enumerate(metadata.shards_metadata)
    ]
    st = ShardedTensorBase._init_from_local_shards_and_global_metadata(
        local_shards=shards, sharded_tensor_metadata=metadata
    )
    assert not dist.is_initialized()
    # Upstream builds a ShardedTensor object (the subclass) without process-group fields.
    assert type(st) is sw.ShardedTensor
    # Every shard given is stored, even the one placed on another rank.
    assert st.local_shards() is shards
    assert [s.metadata.placement.rank() for s in st.local_shards()] == [0, 1]  # type: ignore[union-attr]
    assert st.metadata() is metadata
    spec = st.sharding_spec()
    assert isinstance(spec, sw.ChunkShardingSpec)
    assert spec.dim == 0
    assert [str(p) for p in spec.placements] == ["rank:0/cpu", "rank:1/cpu"]
    assert not st.is_pinned()
    assert repr(st) == f"ShardedTensor({metadata})"


def test_base_init_stores_non_contiguous_shards_unchecked() -> None:
    metadata = _two_row_blocks()
    source = torch.arange(8.0).view(4, 2)
    non_contiguous = torch.arange(4.0).view(2, 2).t()
    assert not non_contiguous.is_contiguous()
    shards = [
        Shard(source[0:2, 0:2], metadata.shards_metadata[0]),
        Shard(non_contiguous, metadata.shards_metadata[1]),
    ]
    st = ShardedTensorBase._init_from_local_shards_and_global_metadata(shards, metadata)
    assert st.local_shards()[1].tensor is non_contiguous
    assert torch.equal(st.local_shards()[0].tensor, source[0:2])


def test_base_init_keeps_a_given_spec_and_infers_enumerable() -> None:
    metadata = _two_row_blocks()
    spec = sw.EnumerableShardingSpec(list(metadata.shards_metadata))
    st = ShardedTensorBase._init_from_local_shards_and_global_metadata(
        [], metadata, sharding_spec=spec
    )
    assert st.sharding_spec() is spec
    assert st.local_shards() == []

    grid = ShardedTensorMetadata(
        shards_metadata=[
            ShardMetadata([0, 0], [2, 1], "rank:0/cpu"),
            ShardMetadata([0, 1], [2, 1], "rank:1/cpu"),
            ShardMetadata([2, 0], [2, 1], "rank:2/cpu"),
            ShardMetadata([2, 1], [2, 1], "rank:3/cpu"),
        ],
        size=torch.Size([4, 2]),
    )
    inferred = ShardedTensorBase._init_from_local_shards_and_global_metadata([], grid)
    assert isinstance(inferred.sharding_spec(), sw.EnumerableShardingSpec)
    assert inferred.sharding_spec().shards == grid.shards_metadata  # type: ignore[attr-defined]


def test_base_init_errors() -> None:
    init = ShardedTensorBase._init_from_local_shards_and_global_metadata
    with pytest.raises(ValueError, match=re.escape("shards_metadata must not be empty!")):
        init([], ShardedTensorMetadata([], torch.Size([4, 2])))

    sparse = _two_row_blocks()
    sparse.tensor_properties.layout = torch.sparse_coo
    with pytest.raises(
        ValueError, match=f"^{re.escape('Only torch.strided layout is currently supported')}$"
    ):
        init([], sparse)

    overlapping = ShardedTensorMetadata(
        shards_metadata=[
            ShardMetadata([0, 0], [3, 2], "rank:0/cpu"),
            ShardMetadata([2, 0], [2, 2], "rank:1/cpu"),
        ],
        size=torch.Size([4, 2]),
    )
    with pytest.raises(
        ValueError, match=r"^Shards ShardMetadata\(.*\) and ShardMetadata\(.*\) overlap$"
    ):
        init([], overlapping)

    gap = _two_row_blocks()
    gap.size = torch.Size([5, 2])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Total volume of shards: 8 does not match tensor volume: 10, in other words all the "
            "individual shards do not cover the entire tensor"
        ),
    ):
        init([], gap)

    wrong_rank = _two_row_blocks()
    wrong_rank.size = torch.Size([4, 2, 1])
    with pytest.raises(ValueError, match=re.escape("Rank of tensor is 3, but shards rank is 2")):
        init([], wrong_rank)


def test_base_init_accepts_empty_trailing_chunks() -> None:
    # SPEC deviation 1: 5 rows over 4 chunks gives an empty chunk at offset 6 (> 5); a
    # zero-volume shard is exempt from the bounds check.
    metadata = sw.ChunkShardingSpec(
        dim=0, placements=[f"rank:{r}/cpu" for r in range(4)]
    ).build_metadata(torch.Size([5, 3]), sw.TensorProperties())
    assert [md.shard_offsets[0] for md in metadata.shards_metadata] == [0, 2, 4, 6]
    assert [md.shard_sizes[0] for md in metadata.shards_metadata] == [2, 2, 1, 0]
    st = ShardedTensorBase._init_from_local_shards_and_global_metadata([], metadata)
    spec = st.sharding_spec()
    assert isinstance(spec, sw.ChunkShardingSpec)
    assert [p.rank() for p in spec.placements] == [0, 1, 2, 3]  # type: ignore[union-attr]
