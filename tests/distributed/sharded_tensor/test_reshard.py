"""``ShardedTensor.reshard``: in place, any layout to any layout (SPEC deviation 4), on real
4-rank gloo groups.

Every test builds the same full tensor on every rank, shards it, reshards it and checks each
local shard against the matching region of the full tensor. The chunk-to-chunk case must give
exactly what upstream gives: the metadata of ``shard_tensor(full, spec2)`` with its shards
sorted by placement rank.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardedTensor,
    ShardMetadata,
    collectives,
)
from tests.harness import distributed


def _full(size: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Distinct values everywhere, identical on every rank.
    return torch.arange(int(torch.Size(size).numel())).reshape(*size).to(dtype)


def _chunk(dim: int, ranks: Sequence[int]) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


def _shuffled(seed: int) -> list[int]:
    ranks = [0, 1, 2, 3]
    random.Random(seed).shuffle(ranks)
    return ranks


def _region(full: torch.Tensor, md: ShardMetadata) -> torch.Tensor:
    view = full
    for dim, (offset, size) in enumerate(zip(md.shard_offsets, md.shard_sizes, strict=True)):
        view = view.narrow(dim, min(offset, full.size(dim)), size)
    return view


def _assert_holds(st: ShardedTensor, full: torch.Tensor) -> None:
    """Every local shard holds its region of ``full`` and is placed on this rank."""
    me = dist.get_rank()
    for shard in st.local_shards():
        assert shard.metadata.placement is not None
        assert shard.metadata.placement.rank() == me
        assert shard.tensor.dtype == full.dtype
        assert shard.tensor.is_contiguous()
        assert torch.equal(shard.tensor, _region(full, shard.metadata))
    owned = [
        md
        for md in st.metadata().shards_metadata
        if md.placement is not None and md.placement.rank() == me
    ]
    assert sorted(md.shard_offsets for md in owned) == sorted(
        s.metadata.shard_offsets for s in st.local_shards()
    )


def _by_rank(metadata: sw.ShardedTensorMetadata) -> list[ShardMetadata]:
    return sorted(metadata.shards_metadata, key=lambda md: md.placement.rank())  # type: ignore[union-attr]


@contextmanager
def _counting_bytes() -> Iterator[dict[str, int]]:
    """Count the bytes this rank sends and receives through ``collectives.send_recv_bytes``."""
    counts = {"sent": 0, "received": 0, "calls": 0}
    original = collectives.send_recv_bytes

    def shim(
        group: dist.ProcessGroup,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
    ) -> None:
        me = dist.get_rank()
        # A rank never sends to or receives from itself.
        assert all(peer != me for peer, _ in [*sends, *recvs])
        counts["calls"] += 1
        counts["sent"] += sum(t.numel() * t.element_size() for _, t in sends)
        counts["received"] += sum(t.numel() * t.element_size() for _, t in recvs)
        original(group, sends, recvs)

    collectives.send_recv_bytes = shim  # type: ignore[assignment]
    try:
        yield counts
    finally:
        collectives.send_recv_bytes = original  # type: ignore[assignment]


def _owner_map(shards: Sequence[ShardMetadata], size: Sequence[int]) -> torch.Tensor:
    owners = torch.full(list(size), -1, dtype=torch.int64)
    for md in shards:
        assert md.placement is not None
        _region(owners, md).fill_(int(md.placement.rank()))  # type: ignore[arg-type]
    return owners


def _expected_traffic(
    old: Sequence[ShardMetadata], new: Sequence[ShardMetadata], size: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """(bytes this rank must send, bytes it must receive): elements whose owner changes."""
    me = dist.get_rank()
    before, after = _owner_map(old, size), _owner_map(new, size)
    moved = before != after
    sent = int((moved & (before == me)).sum()) * itemsize
    received = int((moved & (after == me)).sum()) * itemsize
    return sent, received


# -- chunk to chunk: upstream's exact result ---------------------------------------------------


@distributed(world_size=4)
@pytest.mark.parametrize(("dim", "redim"), [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_chunk_to_chunk_matches_shard_tensor(dim: int, redim: int) -> None:
    for seed, size in enumerate([[13, 21], [14, 23], [15, 26], [12, 24]]):
        full = _full(size)
        spec = _chunk(dim, _shuffled(5 + 2 * seed))
        spec2 = _chunk(redim, _shuffled(6 + 2 * seed))
        st = sw.shard_tensor(full, spec)
        compare = sw.shard_tensor(full, spec2)
        assert st.reshard(spec2) is st
        compare.metadata().shards_metadata.sort(key=lambda md: md.placement.rank())
        assert st.metadata() == compare.metadata()
        assert st.sharding_spec() is spec2
        assert len(st.local_shards()) == len(compare.local_shards()) == 1
        assert torch.equal(st.local_tensor(), compare.local_tensor())
        assert st.local_shards()[0].metadata == compare.local_shards()[0].metadata
        # The metadata list is indexed by rank, as upstream stores it.
        assert [md.placement.rank() for md in st.metadata().shards_metadata] == [0, 1, 2, 3]
        _assert_holds(st, full)


@distributed(world_size=4)
def test_uneven_cross_dim_on_gloo() -> None:
    # Upstream fails here on gloo ("ProcessGroupGloo::scatter: invalid tensor size").
    full = _full([13, 21])
    for spec, spec2 in [
        (_chunk(0, [0, 1, 2, 3]), _chunk(1, [0, 1, 2, 3])),
        (_chunk(1, [3, 1, 0, 2]), _chunk(0, [2, 0, 3, 1])),
    ]:
        st = sw.shard_tensor(full, spec)
        st.reshard(spec2)
        assert [md.shard_sizes for md in _by_rank(st.metadata())] == [
            md.shard_sizes for md in _by_rank(sw.shard_tensor(full, spec2).metadata())
        ]
        _assert_holds(st, full)
        # And back again: the original layout and data.
        st.reshard(spec)
        assert st.metadata() == sw.ShardedTensorMetadata(
            _by_rank(sw.shard_tensor(full, spec).metadata()),
            full.size(),
            st.metadata().tensor_properties,
        )
        _assert_holds(st, full)


@distributed(world_size=4)
def test_same_dim_and_placements_is_a_no_op() -> None:
    full = _full([10, 6])
    spec = _chunk(1, [2, 0, 3, 1])
    st = sw.shard_tensor(full, spec)
    local = st.local_tensor()
    metadata = st.metadata()
    with _counting_bytes() as traffic:
        # An equal spec (another object) counts as the same layout.
        assert st.reshard(_chunk(1, [2, 0, 3, 1])) is st
    assert traffic["calls"] == 0
    assert st.local_tensor() is local
    assert st.metadata() is metadata
    assert st.sharding_spec() is spec
    # Same dim written negatively is another spec (upstream compares dims as given).
    st.reshard(_chunk(-1, [2, 0, 3, 1]))
    assert torch.equal(st.local_tensor(), local)
    _assert_holds(st, full)


@distributed(world_size=4)
def test_same_dim_permuted_placements_uneven() -> None:
    for dim in (0, 1):
        full = _full([13, 21])
        st = sw.shard_tensor(full, _chunk(dim, [0, 1, 2, 3]))
        spec2 = _chunk(dim, [3, 0, 2, 1])
        st.reshard(spec2)
        me = dist.get_rank()
        chunk_index = [3, 0, 2, 1].index(me)
        split = (full.size(dim) + 3) // 4
        expected = full.narrow(
            dim, split * chunk_index, min(split, full.size(dim) - split * chunk_index)
        )
        assert torch.equal(st.local_tensor(), expected)
        _assert_holds(st, full)


# -- any layout to any layout ------------------------------------------------------------------

GRID = [
    ([0, 0], [5, 5], 0),
    ([0, 5], [5, 5], 1),
    ([5, 0], [5, 5], 2),
    ([5, 5], [5, 5], 3),
]


def _grid(order: Sequence[int] = (0, 1, 2, 3)) -> EnumerableShardingSpec:
    return EnumerableShardingSpec([ShardMetadata(o, s, f"rank:{order[r]}/cpu") for o, s, r in GRID])


@distributed(world_size=4)
def test_enumerable_grid_to_chunk_and_back() -> None:
    full = _full([10, 10], torch.float64)
    grid = _grid()
    st = sw.shard_tensor(full, grid)
    spec = _chunk(1, [3, 2, 1, 0])
    assert st.reshard(spec) is st
    compare = sw.shard_tensor(full, spec)
    assert st.metadata().shards_metadata == _by_rank(compare.metadata())
    assert st.metadata().tensor_properties.dtype == torch.float64
    _assert_holds(st, full)

    grid2 = _grid([3, 2, 0, 1])
    assert st.reshard(grid2) is st
    assert st.sharding_spec() is grid2
    # An enumerable target keeps the spec's own order.
    assert st.metadata().shards_metadata == grid2.shards
    assert len(st.local_shards()) == 1
    _assert_holds(st, full)
    # Enumerable to enumerable again.
    st.reshard(grid)
    assert st.metadata().shards_metadata == grid.shards
    _assert_holds(st, full)


@distributed(world_size=4)
def test_several_shards_per_rank_on_either_side() -> None:
    full = _full([16, 12])
    many = _chunk(0, [0, 1, 2, 3, 3, 2, 1, 0])
    st = sw.shard_tensor(full, many)
    assert len(st.local_shards()) == 2
    st.reshard(_chunk(1, [1, 3, 0, 2]))
    assert len(st.local_shards()) == 1
    _assert_holds(st, full)

    # Back to several shards per rank, this time with an enumerable layout.
    blocks = EnumerableShardingSpec(
        [
            ShardMetadata([r * 4, c * 6], [4, 6], f"rank:{(r + c) % 4}/cpu")
            for r in range(4)
            for c in range(2)
        ]
    )
    st.reshard(blocks)
    assert len(st.local_shards()) == 2
    _assert_holds(st, full)
    # Chunk with repeated placements as the target: metadata sorted by rank (stable within a
    # rank, so in chunk order), the same as upstream would sort it.
    st.reshard(many)
    assert st.metadata().shards_metadata == _by_rank(sw.shard_tensor(full, many).metadata())
    assert [md.shard_offsets[0] for md in st.metadata().shards_metadata] == [
        0,
        14,
        2,
        12,
        4,
        10,
        6,
        8,
    ]
    _assert_holds(st, full)


@distributed(world_size=4)
def test_empty_trailing_chunks() -> None:
    # 5 rows over 4 ranks: 2, 2, 1, 0 at offsets 0, 2, 4, 6; 3 columns over 4 ranks: 1, 1, 1, 0.
    full = _full([5, 3])
    st = sw.shard_tensor(full, _chunk(0, [0, 1, 2, 3]))
    spec2 = _chunk(1, [1, 2, 3, 0])
    st.reshard(spec2)
    compare = sw.shard_tensor(full, spec2)
    assert st.metadata().shards_metadata == _by_rank(compare.metadata())
    assert st.metadata().shards_metadata[0] == ShardMetadata([0, 3], [5, 0], "rank:0/cpu")
    assert list(st.local_tensor().shape) == ([5, 0] if dist.get_rank() == 0 else [5, 1])
    _assert_holds(st, full)
    # Back to rows, in reverse placement order: the empty chunk (offset 6) lands on rank 0.
    st.reshard(_chunk(0, [3, 2, 1, 0]))
    assert [(md.shard_offsets, md.shard_sizes) for md in st.metadata().shards_metadata] == [
        ([6, 0], [0, 3]),
        ([4, 0], [1, 3]),
        ([2, 0], [2, 3]),
        ([0, 0], [2, 3]),
    ]
    _assert_holds(st, full)
    # 2 rows over 4 ranks: two empty chunks, at offsets 2 and 3.
    full = _full([2, 5])
    st = sw.shard_tensor(full, _chunk(1, [0, 1, 2, 3]))
    st.reshard(_chunk(0, [0, 1, 2, 3]))
    assert [(md.shard_offsets, md.shard_sizes) for md in st.metadata().shards_metadata] == [
        ([0, 0], [1, 5]),
        ([1, 0], [1, 5]),
        ([2, 0], [0, 5]),
        ([3, 0], [0, 5]),
    ]
    _assert_holds(st, full)


@distributed(world_size=4)
def test_partial_world_placements() -> None:
    full = _full([9, 8])
    me = dist.get_rank()
    st = sw.shard_tensor(full, _chunk(0, [1, 3]))
    assert len(st.local_shards()) == (1 if me in (1, 3) else 0)
    st.reshard(_chunk(1, [2, 0]))
    assert len(st.local_shards()) == (1 if me in (0, 2) else 0)
    assert [md.placement.rank() for md in st.metadata().shards_metadata] == [0, 2]
    _assert_holds(st, full)
    # Ten placements, several per rank and two empty chunks (24 rows, split 3: offsets 24, 27).
    full = _full([24, 4])
    ten = _chunk(0, [0, 0, 1, 1, 1, 2, 2, 2, 3, 3])
    st = sw.shard_tensor(full, _chunk(1, [3, 1]))
    st.reshard(ten)
    assert len(st.local_shards()) == [2, 3, 3, 2][me]
    assert st.metadata().shards_metadata == _by_rank(sw.shard_tensor(full, ten).metadata())
    _assert_holds(st, full)


@distributed(world_size=4)
def test_sub_group_tensor() -> None:
    group = dist.new_group([1, 2, 3])
    me = dist.get_rank()
    full = _full([11, 7])
    # Every rank creates it; rank 0 is outside the group and owns nothing.
    st = sw.empty(_chunk(0, [3, 1, 2]), 11, 7, process_group=group)
    for shard in st.local_shards():
        shard.tensor.copy_(_region(full, shard.metadata))
    # Rank 0 only updates its metadata (no communication over a group it is not in).
    assert st.reshard(_chunk(1, [2, 3, 1])) is st
    assert len(st.local_shards()) == (0 if me == 0 else 1)
    # Chunks of 3, 3, 1 columns on ranks 2, 3, 1, listed by rank.
    assert [md.shard_sizes for md in st.metadata().shards_metadata] == [[11, 1], [11, 3], [11, 3]]
    _assert_holds(st, full)
    st.reshard(_grid_like_for_group(full.shape))
    assert st.metadata().shards_metadata == _grid_like_for_group(full.shape).shards
    _assert_holds(st, full)
    # A placement outside the group fails everywhere: members on the rank check, rank 0 because
    # it would be given a shard of a group it is not in.
    with pytest.raises(ValueError, match=re.escape("0")) as raised:
        st.reshard(_chunk(0, [0, 1, 2, 3]))
    expected = (
        "reshard: rank 0 is not a member of the tensor's process group"
        if me == 0
        else "Global rank 0 does not exist in input process group: [1, 2, 3]"
    )
    assert expected in str(raised.value)
    _assert_holds(st, full)

    if me == 0:
        return
    # Scattered by the members only; src_rank is a group rank (group rank 2 = global rank 3).
    st = sw.shard_tensor(full, _chunk(0, [3, 1, 2]), src_rank=2, process_group=group)
    st.reshard(_chunk(1, [1, 2, 3]))
    assert st._process_group is group
    _assert_holds(st, full)


def _grid_like_for_group(size: torch.Size) -> EnumerableShardingSpec:
    rows, cols = size
    return EnumerableShardingSpec(
        [
            ShardMetadata([0, 0], [rows, 2], "rank:3/cpu"),
            ShardMetadata([0, 2], [rows // 2, cols - 2], "rank:1/cpu"),
            ShardMetadata([rows // 2, 2], [rows - rows // 2, cols - 2], "rank:2/cpu"),
        ]
    )


# -- properties kept ---------------------------------------------------------------------------


@distributed(world_size=4)
def test_dtype_and_requires_grad_kept() -> None:
    for dtype in (torch.int32, torch.bool, torch.complex64):
        full = _full([6, 8]).remainder(3).to(dtype)
        st = sw.shard_tensor(full, _chunk(0, [0, 1, 2, 3]))
        st.reshard(_chunk(1, [3, 2, 1, 0]))
        assert st.dtype == dtype
        _assert_holds(st, full)
    full = _full([8, 8])
    st = sw.rand(_chunk(0, [0, 1, 2, 3]), 8, 8, requires_grad=True)
    st.reshard(_chunk(1, [1, 0, 3, 2]))
    assert st.requires_grad
    assert st.local_tensor().requires_grad
    assert st.local_tensor().is_leaf


# -- bytes moved -------------------------------------------------------------------------------


def _moves(
    build: Callable[[torch.Tensor], ShardedTensor],
    target: sw.ShardingSpec,
    full: torch.Tensor,
) -> tuple[dict[str, int], tuple[int, int]]:
    st = build(full)
    old = list(st.metadata().shards_metadata)
    new = target.build_metadata(full.size(), st.metadata().tensor_properties).shards_metadata
    expected = _expected_traffic(old, new, full.shape, full.element_size())
    with _counting_bytes() as traffic:
        st.reshard(target)
    _assert_holds(st, full)
    return traffic, expected


@distributed(world_size=4)
def test_only_bytes_that_change_owner_move() -> None:
    full = _full([10, 10], torch.float64)
    cases: list[tuple[sw.ShardingSpec, sw.ShardingSpec]] = [
        (_chunk(0, [0, 1, 2, 3]), _chunk(1, [0, 1, 2, 3])),
        (_chunk(0, [0, 1, 2, 3]), _chunk(0, [1, 0, 2, 3])),
        (_chunk(1, [2, 0, 3, 1]), _chunk(0, [3, 3, 0, 1, 2])),
        (_grid(), _chunk(0, [0, 2])),
        (_chunk(0, [0, 0, 1, 1, 2, 2, 3, 3]), _chunk(0, [0, 1, 2, 3])),
    ]
    for source, target in cases:
        traffic, (sent, received) = _moves(lambda f, s=source: sw.shard_tensor(f, s), target, full)
        assert (traffic["sent"], traffic["received"]) == (sent, received), (source, target)
    # Swapping ranks 0 and 1 leaves ranks 2 and 3 out of the traffic entirely.
    traffic, _ = _moves(
        lambda f: sw.shard_tensor(f, _chunk(0, [0, 1, 2, 3])), _chunk(0, [1, 0, 2, 3]), full
    )
    if dist.get_rank() in (2, 3):
        assert traffic["sent"] == traffic["received"] == 0
    else:
        assert traffic["sent"] == traffic["received"] == 3 * 10 * 8


@distributed(world_size=4)
def test_same_boxes_under_another_spec_move_nothing() -> None:
    full = _full([8, 8])
    chunk = _chunk(0, [0, 1, 2, 3])
    same_boxes = EnumerableShardingSpec(
        [ShardMetadata([2 * r, 0], [2, 8], f"rank:{r}/cpu") for r in range(4)]
    )
    st = sw.shard_tensor(full, chunk)
    with _counting_bytes() as traffic:
        st.reshard(same_boxes)
        st.reshard(chunk)
    assert traffic["sent"] == traffic["received"] == 0
    _assert_holds(st, full)


# -- errors ------------------------------------------------------------------------------------


@distributed(world_size=4)
def test_ranks_disagreeing_on_the_spec_all_raise() -> None:
    st = sw.shard_tensor(_full([8, 8]), _chunk(0, [0, 1, 2, 3]))
    local = st.local_tensor()
    # Rank 3 asks for another layout: every rank raises, nobody hangs, nothing changed.
    spec = _chunk(1, [0, 1, 2, 3] if dist.get_rank() != 3 else [3, 2, 1, 0])
    with pytest.raises(ValueError, match=re.escape("reshard: ranks passed different specs")):
        st.reshard(spec)
    assert st.local_tensor() is local


@distributed(world_size=4)
def test_invalid_target_raises_on_every_rank() -> None:
    st = sw.shard_tensor(_full([8, 8]), _chunk(0, [0, 1, 2, 3]))
    with pytest.raises(ValueError, match=re.escape("Invalid sharding dim: 2")):
        st.reshard(_chunk(2, [0, 1, 2, 3]))
    with pytest.raises(
        ValueError, match=re.escape("Global rank 5 does not exist in input process group")
    ):
        st.reshard(_chunk(0, [0, 5]))
    holes = EnumerableShardingSpec([ShardMetadata([0, 0], [4, 8], "rank:0/cpu")])
    with pytest.raises(ValueError, match="do not cover the entire tensor"):
        st.reshard(holes)
    assert st.sharding_spec() == _chunk(0, [0, 1, 2, 3])
