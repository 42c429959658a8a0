"""Building ShardedTensors from shards the ranks already hold: ``init_from_local_shards``
(collective, cross-rank validated), ``_init_from_local_shards_and_global_metadata`` (no
communication) and ``init_from_local_tensor``, on real gloo groups.

The design property checked throughout: when one rank passes a bad argument, every rank
raises (the bad rank its own error, the others the same type and message), and none hangs.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.remote_device import _remote_device

import shardwise as sw
from shardwise import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    RemoteDevice,
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)
from shardwise.sharded_tensor.utils import parse_and_validate_remote_device
from tests.harness import distributed


class _ClaimsPinned(torch.Tensor):
    """A CPU tensor that reports itself pinned: this host has no accelerator, so real pinned
    memory cannot be allocated, but the pin_memory checks only ask ``is_pinned()``."""

    def is_pinned(self, device: Any = None) -> bool:  # type: ignore[override]
        return True


def _claims_pinned(tensor: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(_ClaimsPinned, tensor)


def _grid_md(rank: int) -> ShardMetadata:
    """Block ``rank`` (row-major) of a 10x10 tensor cut into four 5x5 blocks."""
    return ShardMetadata([(rank // 2) * 5, (rank % 2) * 5], [5, 5], f"rank:{rank}/cpu")


def _grid_shard(rank: int, **kwargs: Any) -> Shard:
    md = _grid_md(rank)
    return Shard(torch.full(md.shard_sizes, float(rank), **kwargs), md)


def _grid_metadata(**properties: Any) -> ShardedTensorMetadata:
    return ShardedTensorMetadata(
        [_grid_md(r) for r in range(4)], torch.Size([10, 10]), TensorProperties(**properties)
    )


def _row_shard(offset: int, rows: int, cols: int, rank: int) -> Shard:
    base = torch.arange(offset * cols, (offset + rows) * cols, dtype=torch.float32)
    return Shard(
        base.view(rows, cols), ShardMetadata([offset, 0], [rows, cols], f"rank:{rank}/cpu")
    )


def _layout(st: ShardedTensor) -> list[tuple[list[int], list[int], str]]:
    return [
        (list(md.shard_offsets), list(md.shard_sizes), str(md.placement))
        for md in st.metadata().shards_metadata
    ]


def _placement_ranks(spec: Any) -> list[int]:
    return [p.rank() for p in spec.placements]


def _raises_everywhere(exc: type[BaseException], message: str, anchored: bool = True) -> Any:
    """``pytest.raises`` for an exact message (the same on every rank)."""
    pattern = re.escape(message)
    return pytest.raises(exc, match=f"^{pattern}$" if anchored else pattern)


# -- success paths ---------------------------------------------------------------------------


@distributed(world_size=4)
def test_row_wise_shards_with_every_size_form() -> None:
    rank = dist.get_rank()
    rows = [3, 3, 3, 1]
    size_forms: list[tuple[Any, ...]] = [(10, 4), ([10, 4],), ((10, 4),), (torch.Size([10, 4]),)]
    for size in size_forms:
        shards = [_row_shard(3 * rank, rows[rank], 4, rank)]
        st = sw.init_from_local_shards(shards, *size)
        assert isinstance(st, ShardedTensor)
        assert st.size() == torch.Size([10, 4])
        # The caller's list and shard objects are kept as they are.
        assert st.local_shards() is shards
        assert st.local_shards()[0].metadata is shards[0].metadata
        assert _layout(st) == [([3 * r, 0], [rows[r], 4], f"rank:{r}/cpu") for r in range(4)]
        properties = st.metadata().tensor_properties
        assert properties == TensorProperties(torch.float32, torch.strided, False)
        spec = st.sharding_spec()
        assert isinstance(spec, ChunkShardingSpec)
        assert spec.dim == 0
        assert _placement_ranks(spec) == [0, 1, 2, 3]
        assert st._process_group is dist.group.WORLD
        full = torch.arange(40, dtype=torch.float32).view(10, 4)
        assert torch.equal(st.local_tensor(), full[3 * rank : 3 * rank + rows[rank]])


@distributed(world_size=4)
def test_grid_shards_infer_an_enumerable_spec() -> None:
    rank = dist.get_rank()
    st = ShardedTensor._init_from_local_shards([_grid_shard(rank)], [10, 10])
    assert st.size() == torch.Size([10, 10])
    assert st.metadata().shards_metadata == [_grid_md(r) for r in range(4)]
    spec = st.sharding_spec()
    assert isinstance(spec, EnumerableShardingSpec)
    assert spec.shards == [_grid_md(r) for r in range(4)]
    assert st.local_shards()[0].metadata == _grid_md(rank)


@distributed(world_size=4)
def test_a_rank_without_shards_and_chunk_inference() -> None:
    # Reference example: ranks 0-2 hold [2, 3] at [2r, 0], rank 3 holds nothing, size (6, 3).
    rank = dist.get_rank()
    shards = [] if rank == 3 else [_row_shard(2 * rank, 2, 3, rank)]
    st = sw.init_from_local_shards(shards, 6, 3)
    assert _layout(st) == [([2 * r, 0], [2, 3], f"rank:{r}/cpu") for r in range(3)]
    spec = st.sharding_spec()
    assert isinstance(spec, ChunkShardingSpec)
    assert (spec.dim, _placement_ranks(spec)) == (0, [0, 1, 2])
    if rank == 3:
        assert st.local_shards() == []
        assert st.device == torch.device("cpu")
    else:
        assert st.local_tensor() is shards[0].tensor


@distributed(world_size=4)
def test_uneven_and_column_chunks_infer_chunk_specs() -> None:
    rank = dist.get_rank()
    rows = [3, 3, 3, 1]
    uneven = sw.init_from_local_shards([_row_shard(3 * rank, rows[rank], 2, rank)], 10, 2)
    assert isinstance(uneven.sharding_spec(), ChunkShardingSpec)

    # 9 columns over 4 ranks: 3, 3, 3 and an empty chunk at offset 9.
    cols = [3, 3, 3, 0]
    md = ShardMetadata([0, 3 * rank], [3, cols[rank]], f"rank:{rank}/cpu")
    columns = sw.init_from_local_shards([Shard(torch.zeros(3, cols[rank]), md)], 3, 9)
    spec = columns.sharding_spec()
    assert isinstance(spec, ChunkShardingSpec)
    assert (spec.dim, _placement_ranks(spec)) == (1, [0, 1, 2, 3])


@distributed(world_size=4)
def test_non_chunk_layouts_infer_enumerable_specs() -> None:
    rank = dist.get_rank()
    # Row counts 4, 2, 2, 2 are not a ceil-chunking of 10 rows.
    rows, offsets = [4, 2, 2, 2], [0, 4, 6, 8]
    st = sw.init_from_local_shards([_row_shard(offsets[rank], rows[rank], 2, rank)], 10, 2)
    assert isinstance(st.sharding_spec(), EnumerableShardingSpec)
    assert _layout(st) == [([offsets[r], 0], [rows[r], 2], f"rank:{r}/cpu") for r in range(4)]

    # One shard (all offsets zero) is undecidable: enumerable.
    single = sw.init_from_local_shards([_row_shard(0, 4, 4, 0)] if rank == 0 else [], 4, 4)
    assert isinstance(single.sharding_spec(), EnumerableShardingSpec)
    assert _layout(single) == [([0, 0], [4, 4], "rank:0/cpu")]


@distributed(world_size=4)
def test_several_shards_per_rank() -> None:
    rank = dist.get_rank()
    shards = [_row_shard(2 * rank, 2, 3, rank), _row_shard(2 * (rank + 4), 2, 3, rank)]
    st = sw.init_from_local_shards(shards, 16, 3)
    # Global metadata: rank order, each rank's shards in its local order.
    assert _layout(st) == [
        ([2 * (r + 4 * i), 0], [2, 3], f"rank:{r}/cpu") for r in range(4) for i in range(2)
    ]
    spec = st.sharding_spec()
    assert isinstance(spec, ChunkShardingSpec)
    # Placements in chunk (offset) order.
    assert _placement_ranks(spec) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert len(st.local_shards()) == 2


@distributed(world_size=4)
def test_sub_group_only_members_call() -> None:
    rank = dist.get_rank()
    group = dist.new_group([1, 2, 3])
    if rank == 0:
        return  # not a member: takes no part
    shard = _row_shard(5 * (rank - 1), 5, 5, rank)
    st = sw.init_from_local_shards([shard], [15, 5], process_group=group)
    assert st._process_group is group
    # Placements name global ranks; the metadata is in group-rank order.
    assert _layout(st) == [([5 * i, 0], [5, 5], f"rank:{i + 1}/cpu") for i in range(3)]
    assert _placement_ranks(st.sharding_spec()) == [1, 2, 3]

    # A cross-rank error inside the sub-group: members agree, ranks are group ranks.
    dtype = torch.float64 if rank == 2 else torch.float32
    bad = Shard(torch.zeros(5, 5, dtype=dtype), shard.metadata)
    with _raises_everywhere(
        ValueError,
        "ShardedTensor dtype property does not match from different ranks! "
        "Found dtype=torch.float32 on rank:0, and dtype=torch.float64 on rank:1.",
    ):
        sw.init_from_local_shards([bad], [15, 5], process_group=group)

    # A placement outside the group is a local error that every member raises.
    outside = _row_shard(0, 5, 5, 0) if rank == 1 else shard
    with _raises_everywhere(
        ValueError, "Global rank 0 does not exist in input process group: [1, 2, 3]"
    ):
        sw.init_from_local_shards([outside], [15, 5], process_group=group)


@distributed(world_size=4)
def test_concurrent_sub_groups_with_meta_shards() -> None:
    """Two disjoint sub-groups ({0, 2} and {1, 3}) build their tensors at the same time."""
    rank = dist.get_rank()
    groups = {0: dist.new_group([0, 2]), 1: dist.new_group([1, 3])}
    group = groups[rank % 2]
    members = [rank % 2, rank % 2 + 2]
    # Placements are checked against the sub-group's global ranks, and need no CUDA to parse.
    for member in members:
        assert parse_and_validate_remote_device(
            group, RemoteDevice(f"rank:{member}/cuda:{member % 2}")
        ) == (member, torch.device("cuda", member % 2))
    md = ShardMetadata([3 * (rank // 2)], [3], f"rank:{rank}/meta")
    shard = Shard(torch.empty(3, device="meta"), md)
    st = ShardedTensor._init_from_local_shards([shard], 6, process_group=group)
    assert st.is_meta is True
    assert st.size() == torch.Size([6])
    assert _layout(st) == [([3 * i], [3], f"rank:{m}/meta") for i, m in enumerate(members)]


@distributed(world_size=2)
def test_two_ranks_and_keyword_arguments() -> None:
    rank = dist.get_rank()
    shard = _row_shard(2 * rank, 2, 2, rank)
    st = ShardedTensor._init_from_local_shards(
        [shard], 4, 2, process_group=dist.group.WORLD, init_rrefs=False
    )
    assert _layout(st) == [([0, 0], [2, 2], "rank:0/cpu"), ([2, 0], [2, 2], "rank:1/cpu")]
    with _raises_everywhere(
        RuntimeError,
        "RPC Framework needs to be initialized using torch.distributed.rpc.init_rpc if "
        "init_rrefs is set to True",
    ):
        sw.init_from_local_shards([shard], 4, 2, init_rrefs=True)


@distributed(world_size=1)
def test_world_size_one() -> None:
    shards = [_row_shard(0, 2, 2, 0), _row_shard(2, 1, 2, 0)]
    st = sw.init_from_local_shards(shards, 3, 2)
    assert _layout(st) == [([0, 0], [2, 2], "rank:0/cpu"), ([2, 0], [1, 2], "rank:0/cpu")]
    with _raises_everywhere(ValueError, "ShardedTensor have no local shards on all ranks!"):
        sw.init_from_local_shards([], 3, 2)


# -- local validation errors (reference §10.1 step 2) ------------------------------------------


@distributed(world_size=4)
def test_local_errors_on_every_rank() -> None:
    rank = dist.get_rank()
    md = _grid_md(rank)

    sparse = Shard(torch.randn(5, 5).to_sparse(), md)
    message = (
        "Only torch.strided layout is currently supported, but found torch.sparse_coo on "
        f"rank:{rank}!"
    )
    with _raises_everywhere(ValueError, message):
        sw.init_from_local_shards([sparse], 10, 10)
    # A layout differing from the first local shard's is reported the same way.
    with _raises_everywhere(ValueError, message):
        sw.init_from_local_shards([_grid_shard(rank), sparse], 10, 10)

    transposed = Shard(torch.randn(5, 5).t(), md)
    with _raises_everywhere(
        ValueError, "Only torch.contiguous_format memory_format is currently supported!"
    ):
        sw.init_from_local_shards([transposed], 10, 10)

    other = (rank + 1) % 4
    foreign = Shard(torch.zeros(5, 5), ShardMetadata(md.shard_offsets, [5, 5], f"rank:{other}/cpu"))
    with _raises_everywhere(
        ValueError,
        "Local shard metadata's rank does not match with the rank in its process group! "
        f"Found current rank in the process group: {rank}, local ShardMetadata placement's rank: "
        f"{other}",
    ):
        sw.init_from_local_shards([foreign], 10, 10)
    rankless = Shard(torch.zeros(5, 5), ShardMetadata(md.shard_offsets, [5, 5], "cpu"))
    with _raises_everywhere(
        ValueError, "local ShardMetadata placement's rank: None", anchored=False
    ):
        sw.init_from_local_shards([rankless], 10, 10)
    with _raises_everywhere(ValueError, "remote device is None"):
        sw.init_from_local_shards([Shard(torch.zeros(5, 5), ShardMetadata([0, 0], [5, 5]))], 10, 10)

    # Shard validates at construction; metadata changed afterwards is caught here.
    moved = _grid_shard(rank)
    moved.metadata.placement = RemoteDevice(f"rank:{rank}/meta")
    with _raises_everywhere(
        ValueError,
        "Local shard tensor device does not match with local Shard's placement! "
        "Found local shard tensor device: cpu, local shard metadata placement device: meta",
    ):
        sw.init_from_local_shards([moved], 10, 10)
    resized = _grid_shard(rank)
    resized.metadata.shard_sizes = [5, 4]
    with _raises_everywhere(
        ValueError,
        f"Local shards' tensor size property need to be the same on rank:{rank}! "
        "Found one local shard tensor size=[5, 4], the other local shard tensor size=[5, 5].",
    ):
        sw.init_from_local_shards([resized], 10, 10)


@distributed(world_size=4)
def test_local_shards_of_one_rank_must_agree() -> None:
    rank = dist.get_rank()
    first = Shard(
        torch.zeros(5, 5),
        ShardMetadata([(rank // 2) * 5, (rank % 2) * 5], [5, 5], f"rank:{rank}/cpu"),
    )

    def second(tensor: torch.Tensor) -> Shard:
        # Same metadata as the first shard: the property checks come before overlap checks.
        return Shard(tensor, copy.deepcopy(first.metadata))

    cases = [
        (second(torch.zeros(5, 5, dtype=torch.float64)), "dtype", "torch.float64", "torch.float32"),
        (second(torch.zeros(5, 5, requires_grad=True)), "requires_grad", "True", "False"),
        (second(_claims_pinned(torch.zeros(5, 5))), "pin_memory", "True", "False"),
    ]
    for shard, prop, this, first_value in cases:
        # "one local shard" is the offending shard, "the other" the first one (upstream order).
        with _raises_everywhere(
            ValueError,
            f"Local shards' tensor {prop} property need to be the same on rank:{rank}! "
            f"Found one local shard tensor {prop}={this}, "
            f"the other local shard tensor {prop}={first_value}.",
        ):
            sw.init_from_local_shards([first, shard], 10, 10)


@distributed(world_size=4)
def test_bad_local_argument_on_one_rank_raises_on_every_rank() -> None:
    rank = dist.get_rank()
    # Rank 2 passes a shard placed on rank 3: its own local error, shared with everyone.
    shard = _grid_shard(3) if rank == 2 else _grid_shard(rank)
    message = (
        "Local shard metadata's rank does not match with the rank in its process group! "
        "Found current rank in the process group: 2, local ShardMetadata placement's rank: 3"
    )
    with _raises_everywhere(ValueError, message):
        sw.init_from_local_shards([shard], 10, 10)

    # Two ranks fail: each raises its own error, the healthy ranks the lowest failing rank's.
    transposed = Shard(torch.zeros(5, 5).t(), _grid_md(rank))
    shards = [transposed] if rank == 1 else [_grid_shard(3)] if rank == 2 else [_grid_shard(rank)]
    expected = (
        message
        if rank == 2
        else "Only torch.contiguous_format memory_format is currently supported!"
    )
    with _raises_everywhere(ValueError, expected):
        sw.init_from_local_shards(shards, 10, 10)

    # A bad size on one rank only.
    size: tuple[Any, ...] = (10, 10.0) if rank == 3 else (10, 10)
    with _raises_everywhere(TypeError, "size has to be a sequence of ints, found: [10, 10.0]"):
        sw.init_from_local_shards([_grid_shard(rank)], *size)

    # The group is still in step afterwards.
    st = sw.init_from_local_shards([_grid_shard(rank)], 10, 10)
    assert st.size() == torch.Size([10, 10])


# -- cross-rank validation errors (reference §10.1 step 3) -------------------------------------


@distributed(world_size=4)
@pytest.mark.parametrize("odd_rank", [0, 2])
def test_cross_rank_property_mismatch_raises_on_every_rank(odd_rank: int) -> None:
    rank = dist.get_rank()
    odd = rank == odd_rank
    # Ranks are positions in the gathered list; the first rank's value is the reference.
    first, other = (0, odd_rank) if odd_rank else (0, 1)

    def found(prop: str, usual: str, unusual: str) -> str:
        a = unusual if first == odd_rank else usual
        b = unusual if other == odd_rank else usual
        return (
            f"ShardedTensor {prop} property does not match from different ranks! "
            f"Found {prop}={a} on rank:{first}, and {prop}={b} on rank:{other}."
        )

    with _raises_everywhere(
        ValueError, found("global_size", "torch.Size([10, 10])", "torch.Size([10, 5])")
    ):
        sw.init_from_local_shards([_grid_shard(rank)], (10, 5) if odd else (10, 10))

    with _raises_everywhere(ValueError, found("dtype", "torch.float32", "torch.int32")):
        sw.init_from_local_shards(
            [_grid_shard(rank, dtype=torch.int32 if odd else torch.float32)], 10, 10
        )

    with _raises_everywhere(ValueError, found("requires_grad", "False", "True")):
        sw.init_from_local_shards([_grid_shard(rank, requires_grad=odd)], 10, 10)

    pinned = Shard(_claims_pinned(torch.zeros(5, 5)), _grid_md(rank))
    with _raises_everywhere(ValueError, found("pin_memory", "False", "True")):
        sw.init_from_local_shards([pinned if odd else _grid_shard(rank)], 10, 10)

    # Properties are compared in order: global_size before dtype.
    with _raises_everywhere(ValueError, "ShardedTensor global_size property", anchored=False):
        sw.init_from_local_shards(
            [_grid_shard(rank, dtype=torch.int32 if odd else torch.float32)],
            (10, 5) if odd else (10, 10),
        )


@distributed(world_size=4)
def test_global_layout_errors() -> None:
    rank = dist.get_rank()
    with _raises_everywhere(ValueError, "ShardedTensor have no local shards on all ranks!"):
        sw.init_from_local_shards([], 10, 10)

    # Rank 0's block grows to 6x6: it passes its own checks; the union overlaps.
    big = Shard(torch.zeros(6, 6), ShardMetadata([0, 0], [6, 6], "rank:0/cpu"))
    with _raises_everywhere(
        ValueError,
        "Shards ShardMetadata(shard_offsets=[0, 0], shard_sizes=[6, 6], placement=rank:0/cpu) "
        "and ShardMetadata(shard_offsets=[0, 5], shard_sizes=[5, 5], placement=rank:1/cpu) "
        "overlap",
    ):
        sw.init_from_local_shards([big if rank == 0 else _grid_shard(rank)], 10, 10)

    small = Shard(torch.zeros(4, 4), ShardMetadata([0, 0], [4, 4], "rank:0/cpu"))
    with _raises_everywhere(
        ValueError,
        "Total volume of shards: 91 does not match tensor volume: 100, in other words all the "
        "individual shards do not cover the entire tensor",
    ):
        sw.init_from_local_shards([small if rank == 0 else _grid_shard(rank)], 10, 10)

    with _raises_everywhere(
        ValueError,
        "Shard offset 5 and length 5 exceeds tensor dim: 9 for shard "
        "ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement=rank:2/cpu)",
    ):
        sw.init_from_local_shards([_grid_shard(rank)], 9, 10)

    # No size at all: a 0-d global size.
    with _raises_everywhere(ValueError, "Rank of tensor is 0, but shards rank is 2"):
        sw.init_from_local_shards([_grid_shard(rank)])


# -- recalc mode (None sizes, reference §10.1 step 4) --------------------------------------------


@distributed(world_size=4)
@pytest.mark.parametrize("side", [5, 0])
def test_recalc_stacks_row_blocks(side: int) -> None:
    rank = dist.get_rank()
    original = ShardMetadata([0, 0], [side, side], f"rank:{rank}/cpu")
    shard = Shard(torch.zeros(side, side), original)
    st = sw.init_from_local_shards([shard], None, None)
    assert st.size() == torch.Size([4 * side, side])
    assert _layout(st) == [([r * side, 0], [side, side], f"rank:{r}/cpu") for r in range(4)]
    local = st.local_shards()[0]
    assert local is shard
    assert local.metadata.shard_offsets == [rank * side, 0]
    # The first local shard now carries the recalculated global entry, not the caller's object,
    # which keeps its offsets.
    assert local.metadata is not original
    assert local.metadata is st.metadata().shards_metadata[rank]
    assert original.shard_offsets == [0, 0]


@distributed(world_size=4)
def test_recalc_rewrites_grid_offsets_without_mutating_the_input() -> None:
    rank = dist.get_rank()
    original = _grid_md(rank)
    kept = copy.deepcopy(original)
    st = sw.init_from_local_shards([Shard(torch.zeros(5, 5), original)], None, 5)
    assert st.size() == torch.Size([20, 5])
    assert _layout(st) == [([5 * r, 0], [5, 5], f"rank:{r}/cpu") for r in range(4)]
    new = st.local_shards()[0].metadata
    assert new.shard_offsets == [5 * rank, 0]
    assert (new.shard_sizes, new.placement) == (original.shard_sizes, original.placement)
    assert original == kept
    if rank == 0:
        assert new.shard_offsets == original.shard_offsets
    else:
        assert new.shard_offsets != original.shard_offsets
    assert isinstance(st.sharding_spec(), ChunkShardingSpec)


@distributed(world_size=4)
def test_recalc_with_uneven_rows() -> None:
    # Reference example: rank r passes [r + 1, 2] at [0, 0] with size (None, 2).
    rank = dist.get_rank()
    shard = Shard(
        torch.zeros(rank + 1, 2), ShardMetadata([0, 0], [rank + 1, 2], f"rank:{rank}/cpu")
    )
    st = sw.init_from_local_shards([shard], [None, 2])
    assert st.size() == torch.Size([10, 2])
    assert [md.shard_offsets for md in st.metadata().shards_metadata] == [
        [0, 0],
        [1, 0],
        [3, 0],
        [6, 0],
    ]
    assert isinstance(st.sharding_spec(), EnumerableShardingSpec)


@distributed(world_size=4)
def test_recalc_errors_raise_on_every_rank() -> None:
    rank = dist.get_rank()
    # Rank 3 holds nothing: it reports its own numbers, everyone else the same.
    shards = (
        []
        if rank == 3
        else [Shard(torch.zeros(2, 2), ShardMetadata([0, 0], [2, 2], f"rank:{rank}/cpu"))]
    )
    with _raises_everywhere(
        AssertionError,
        "# for metadata recalculation, local_shards must be larger than 0 actual:0, # glb "
        "metadata must be greater than any rank id, # metadata:3, rank id:3",
    ):
        sw.init_from_local_shards(shards, None, 2)

    # Two shards on one rank: that rank has two recalculated entries.
    two = [
        Shard(torch.zeros(1, 2), ShardMetadata([0, 0], [1, 2], f"rank:{rank}/cpu")),
        Shard(torch.zeros(1, 2), ShardMetadata([1, 0], [1, 2], f"rank:{rank}/cpu")),
    ]
    mine = [Shard(torch.zeros(1, 2), ShardMetadata([0, 0], [1, 2], f"rank:{rank}/cpu"))]
    with _raises_everywhere(
        AssertionError,
        "should has and only has one metadata for local rank, actual:["
        "ShardMetadata(shard_offsets=[1, 0], shard_sizes=[1, 2], placement=rank:1/cpu), "
        "ShardMetadata(shard_offsets=[2, 0], shard_sizes=[1, 2], placement=rank:1/cpu)]",
    ):
        sw.init_from_local_shards(two if rank == 1 else mine, None, 2)

    # Explicit zero sizes are not recalc mode: the shards are checked against (0, 0).
    five = Shard(torch.zeros(5, 5), ShardMetadata([5 * rank, 0], [5, 5], f"rank:{rank}/cpu"))
    with _raises_everywhere(
        ValueError, "Shard offset 0 and length 5 exceeds tensor dim: 0", anchored=False
    ):
        sw.init_from_local_shards([five], 0, 0)
    stacked = Shard(torch.zeros(5, 5), ShardMetadata([0, 0], [5, 5], f"rank:{rank}/cpu"))
    with _raises_everywhere(ValueError, "overlap", anchored=False):
        sw.init_from_local_shards([stacked], 0, 0)
    # No size at all is no recalc either; overlap is checked before the tensor rank.
    with _raises_everywhere(ValueError, "overlap", anchored=False):
        sw.init_from_local_shards([stacked])
    with _raises_everywhere(ValueError, "Rank of tensor is 0, but shards rank is 2"):
        sw.init_from_local_shards([five])


# -- _init_from_local_shards_and_global_metadata (reference §10.2) ------------------------------


@distributed(world_size=4)
def test_global_metadata_success() -> None:
    rank = dist.get_rank()
    metadata = _grid_metadata()
    shard = Shard(torch.full((5, 5), float(rank)), metadata.shards_metadata[rank])
    st = ShardedTensor._init_from_local_shards_and_global_metadata([shard], metadata)
    assert st.metadata() is metadata
    assert st.local_shards() == [shard]
    assert isinstance(st.sharding_spec(), EnumerableShardingSpec)
    assert st.size() == torch.Size([10, 10])
    assert st._process_group is dist.group.WORLD

    spec = EnumerableShardingSpec(list(metadata.shards_metadata))
    given = sw.init_from_local_shards_and_global_metadata(
        [shard], metadata, process_group=dist.group.WORLD, sharding_spec=spec
    )
    assert given.sharding_spec() is spec
    assert given.local_tensor() is shard.tensor


@distributed(world_size=4)
def test_global_metadata_with_local_views() -> None:
    """Each rank passes DIFFERENT metadata: its own 5x5 shard, the others as empty shards."""
    rank = dist.get_rank()

    def view(own_offset: list[int]) -> ShardedTensorMetadata:
        shards = [
            ShardMetadata(own_offset, [5, 5], f"rank:{r}/cpu")
            if r == rank
            else ShardMetadata([0 if r < rank else 5, 0], [0, 0], f"rank:{r}/cpu")
            for r in range(4)
        ]
        return ShardedTensorMetadata(shards, torch.Size([5, 5]), TensorProperties())

    metadata = view([0, 0])
    shard = Shard(torch.zeros(5, 5), metadata.shards_metadata[rank])
    st = ShardedTensor._init_from_local_shards_and_global_metadata([shard], metadata)
    assert st.size() == torch.Size([5, 5])
    assert st.metadata().shards_metadata == metadata.shards_metadata

    shifted = view([1, 0])
    with _raises_everywhere(
        ValueError,
        "Shard offset 1 and length 5 exceeds tensor dim: 5 for shard "
        f"ShardMetadata(shard_offsets=[1, 0], shard_sizes=[5, 5], placement=rank:{rank}/cpu)",
    ):
        ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(torch.zeros(5, 5), shifted.shards_metadata[rank])], shifted
        )

    # Every shard empty: a valid 0x0 tensor.
    zeros = ShardedTensorMetadata(
        [ShardMetadata([0, 0], [0, 0], f"rank:{r}/cpu") for r in range(4)], torch.Size([0, 0])
    )
    empty = ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(torch.zeros(0, 0), zeros.shards_metadata[rank])], zeros
    )
    assert empty.size() == torch.Size([0, 0])
    assert empty.local_tensor().shape == (0, 0)


@distributed(world_size=4)
def test_global_metadata_errors_in_order() -> None:
    rank = dist.get_rank()
    init = ShardedTensor._init_from_local_shards_and_global_metadata
    metadata = _grid_metadata()
    md = metadata.shards_metadata[rank]

    for shards in ([], [Shard(torch.zeros(5, 5), md), Shard(torch.zeros(5, 5), md)]):
        with _raises_everywhere(
            RuntimeError,
            f"Number of local shards ({len(shards)}) does not match number of local shards "
            f"metadata in sharded_tensor_metadata (1) on rank ({rank}) ",
        ):
            init(shards, metadata)
    # The count is checked first, then emptiness.
    with _raises_everywhere(ValueError, "shards_metadata must not be empty!"):
        init([], ShardedTensorMetadata([], torch.Size([10, 10])))

    sparse_props = _grid_metadata(layout=torch.sparse_coo)
    with _raises_everywhere(ValueError, "Only torch.strided layout is currently supported"):
        init([Shard(torch.zeros(5, 5), sparse_props.shards_metadata[rank])], sparse_props)

    def incompatible(prop: str, source: str, expected: str, actual: str) -> Any:
        return _raises_everywhere(
            ValueError,
            f"Local shards' tensor {prop} property is incompatible with {source} on rank {rank}: "
            f"{source} {prop}={expected}, local shard tensor {prop}={actual}.",
        )

    with incompatible("layout", "tensor property", "torch.strided", "torch.sparse_coo"):
        init([Shard(torch.zeros(5, 5).to_sparse(), md)], metadata)
    with _raises_everywhere(
        ValueError, "Only torch.contiguous_format memory_format is currently supported"
    ):
        init([Shard(torch.zeros(5, 5).t(), md)], metadata)
    resized = Shard(torch.zeros(5, 5), md)
    resized.tensor = torch.zeros(5, 4)
    with incompatible("size", "local ShardMetadata", "[5, 5]", "[5, 4]"):
        init([resized], metadata)
    with incompatible("pin_memory", "tensor property", "False", "True"):
        init([Shard(_claims_pinned(torch.zeros(5, 5)), md)], metadata)
    moved = Shard(
        torch.zeros(5, 5, device="meta"),
        ShardMetadata(md.shard_offsets, [5, 5], f"rank:{rank}/meta"),
    )
    with incompatible("device", "local ShardMetadata", "cpu", "meta"):
        # The shard's own metadata says meta, the global entry cpu: the count matches.
        moved.metadata = md
        init([moved], metadata)
    with incompatible("dtype", "tensor property", "torch.float32", "torch.int32"):
        init([Shard(torch.zeros(5, 5, dtype=torch.int32), md)], metadata)
    with incompatible("requires_grad", "tensor property", "False", "True"):
        init([Shard(torch.zeros(5, 5, requires_grad=True), md)], metadata)

    # Layout is checked before contiguity, size before dtype.
    with incompatible("layout", "tensor property", "torch.strided", "torch.sparse_coo"):
        init([Shard(torch.zeros(5, 5).to_sparse(), md)], metadata)
    wrong_both = Shard(torch.zeros(5, 5, dtype=torch.int32), md)
    wrong_both.tensor = torch.zeros(5, 4, dtype=torch.int32)
    with incompatible("size", "local ShardMetadata", "[5, 5]", "[5, 4]"):
        init([wrong_both], metadata)

    no_placement = Shard(torch.zeros(5, 5), ShardMetadata(md.shard_offsets, [5, 5]))
    with _raises_everywhere(AssertionError, "Must specify placement for `Shard`!"):
        init([no_placement], metadata)

    # Code migrating from upstream assigns torch's own placement objects to the metadata.
    md.placement = _remote_device(f"rank:{rank}/cpu")  # type: ignore[assignment]
    with incompatible("pin_memory", "tensor property", "False", "True"):
        init([Shard(_claims_pinned(torch.zeros(5, 5)), md)], metadata)
    assert init([Shard(torch.zeros(5, 5), md)], metadata).local_tensor().shape == (5, 5)

    # Overlap and coverage of the global metadata come last.
    overlapping = _grid_metadata()
    overlapping.shards_metadata[3] = ShardMetadata([4, 5], [5, 5], "rank:3/cpu")
    with _raises_everywhere(ValueError, "overlap", anchored=False):
        init([Shard(torch.zeros(5, 5), overlapping.shards_metadata[rank])], overlapping)
    short = _grid_metadata()
    short.size = torch.Size([10, 11])
    with _raises_everywhere(ValueError, "does not match tensor volume: 110", anchored=False):
        init([Shard(torch.zeros(5, 5), short.shards_metadata[rank])], short)


@distributed(world_size=4)
def test_global_metadata_validates_placements_against_the_group() -> None:
    rank = dist.get_rank()
    group = dist.new_group([1, 2, 3])
    metadata = _grid_metadata()
    if rank == 0:
        return
    with _raises_everywhere(
        ValueError, "Global rank 0 does not exist in input process group: [1, 2, 3]"
    ):
        ShardedTensor._init_from_local_shards_and_global_metadata(
            [_grid_shard(rank)], metadata, process_group=group
        )
    sub = ShardedTensorMetadata(
        [
            ShardMetadata([0, 0], [2, 2], "rank:1/cpu"),
            ShardMetadata([2, 0], [2, 2], "rank:2/cpu"),
            ShardMetadata([4, 0], [2, 2], "rank:3/cpu"),
        ],
        torch.Size([6, 2]),
    )
    st = ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(torch.zeros(2, 2), sub.shards_metadata[rank - 1])], sub, process_group=group
    )
    assert st._process_group is group
    assert _placement_ranks(st.sharding_spec()) == [1, 2, 3]


# -- init_from_local_tensor ----------------------------------------------------------------------


@distributed(world_size=4)
def test_init_from_local_tensor() -> None:
    rank = dist.get_rank()
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in (3, 2, 1, 0)])
    expected = spec.build_metadata(torch.Size([10, 3]), TensorProperties())
    mine = next(md for md in expected.shards_metadata if md.placement.rank() == rank)  # type: ignore[union-attr]
    local = torch.rand(mine.shard_sizes)
    for build in (
        lambda: ShardedTensor._init_from_local_tensor(local, spec, [10, 3]),
        lambda: ShardedTensor._init_from_local_tensor(local, spec, 10, 3),
        lambda: sw.init_from_local_tensor(local, spec, torch.Size([10, 3])),
    ):
        st = build()
        assert st.size() == torch.Size([10, 3])
        assert st.sharding_spec() is spec
        # Placement order, not rank order.
        assert st.metadata().shards_metadata == expected.shards_metadata
        assert st.local_tensor() is local
        assert st.local_shards()[0].metadata == mine


@distributed(world_size=4)
def test_init_from_local_tensor_errors() -> None:
    rank = dist.get_rank()
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(4)])
    with _raises_everywhere(ValueError, "local_tensor is not a contiguous Tensor."):
        ShardedTensor._init_from_local_tensor(torch.zeros(3, 4).t(), spec, 16, 3)
    gappy = EnumerableShardingSpec(
        [
            ShardMetadata([0, 0], [12, 6], "rank:0/cpu"),
            ShardMetadata([12, 6], [12, 6], "rank:1/cpu"),
        ]
    )
    with _raises_everywhere(
        ValueError,
        "Total volume of shards: 144 does not match tensor volume: 288, in other words all the "
        "individual shards do not cover the entire tensor",
    ):
        sw.init_from_local_tensor(torch.zeros(12, 6), gappy, [24, 12])
    # The local tensor must match this rank's shard.
    with _raises_everywhere(
        ValueError,
        "Shard tensor size does not match with metadata.shard_lengths! "
        f"Found shard tensor size: [5, 3], metadata.shard_lengths: [{4 - rank // 3}, 3], ",
    ):
        sw.init_from_local_tensor(torch.zeros(5, 3), spec, 15, 3)
