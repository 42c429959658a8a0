"""The pure resharding planner: ``intersect``, ``plan_reshard`` and upstream's two helpers
``get_idx_from_placements`` and ``build_reshard_metadata`` (no processes, no process group).

The property tests check the plan against a brute-force owner map of every element: each
element of every new shard is delivered by exactly one transfer, and the elements that cross
ranks are exactly those whose owner changes (the minimum a reshard must move).
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise import ChunkShardingSpec, EnumerableShardingSpec, RemoteDevice, ShardMetadata
from shardwise.metadata import TensorProperties
from shardwise.sharded_tensor.reshard import (
    Transfer,
    build_reshard_metadata,
    get_idx_from_placements,
    intersect,
    plan_reshard,
)

WORLD = 4


def _md(offsets: list[int], sizes: list[int], rank: int = 0) -> ShardMetadata:
    return ShardMetadata(offsets, sizes, f"rank:{rank}/cpu")


def _owner(md: ShardMetadata) -> int:
    assert md.placement is not None
    rank = md.placement.rank()
    assert rank is not None
    return rank


def _chunks(size: list[int], dim: int, ranks: list[int]) -> list[ShardMetadata]:
    spec = ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])
    return spec.build_metadata(torch.Size(size), TensorProperties()).shards_metadata


# -- intersect ---------------------------------------------------------------------------------


def test_intersect_overlapping_boxes() -> None:
    a = _md([0, 0], [4, 6])
    b = _md([2, 3], [5, 5])
    assert intersect(a, b) == ((2, 3), (2, 3))
    # Symmetric, and placements play no part.
    assert intersect(_md([2, 3], [5, 5], rank=3), a) == ((2, 3), (2, 3))


def test_intersect_containment_and_identity() -> None:
    outer = _md([0, 0, 0], [4, 4, 4])
    inner = _md([1, 2, 0], [2, 1, 4])
    assert intersect(outer, inner) == ((1, 2, 0), (2, 1, 4))
    assert intersect(inner, inner) == ((1, 2, 0), (2, 1, 4))


def test_intersect_empty_cases() -> None:
    # Touching boxes share no element.
    assert intersect(_md([0, 0], [3, 4]), _md([3, 0], [3, 4])) is None
    # Disjoint along one dim only is enough.
    assert intersect(_md([0, 0], [6, 2]), _md([0, 4], [6, 2])) is None
    # A zero-size shard (an empty trailing chunk) intersects nothing, even inside another box.
    assert intersect(_md([0, 0], [6, 6]), _md([2, 0], [0, 6])) is None
    # Offsets past the end of the tensor (chunk offsets are split * i) are harmless.
    assert intersect(_md([0], [5]), _md([6], [0])) is None


def test_intersect_one_dim_and_zero_dim() -> None:
    assert intersect(_md([3], [4]), _md([5], [10])) == ((5,), (2,))
    # Two 0-d "boxes" share their single element.
    assert intersect(ShardMetadata([], [], "rank:0/cpu"), ShardMetadata([], [], "rank:1/cpu")) == (
        (),
        (),
    )


def test_intersect_rejects_mismatched_ndims() -> None:
    with pytest.raises(ValueError, match="zip"):
        intersect(_md([0, 0], [2, 2]), _md([0], [2]))


# -- plan_reshard on hand-checked layouts ------------------------------------------------------


def test_plan_dim0_to_dim1_every_pair_meets() -> None:
    old = _chunks([8, 8], 0, [0, 1, 2, 3])
    new = _chunks([8, 8], 1, [0, 1, 2, 3])
    plan = plan_reshard(old, new)
    # Every row chunk meets every column chunk in a 2 x 2 block.
    assert len(plan) == 16
    assert [(t.target, t.source) for t in plan] == sorted(itertools.product(range(4), range(4)))
    assert plan[0] == Transfer(source=0, target=0, offsets=(0, 0), sizes=(2, 2))
    assert plan[6] == Transfer(source=2, target=1, offsets=(4, 2), sizes=(2, 2))
    assert all(t.sizes == (2, 2) for t in plan)


def test_plan_same_layout_is_identity() -> None:
    old = _chunks([13, 21], 1, [2, 0, 3, 1])
    plan = plan_reshard(old, list(old))
    assert [(t.source, t.target) for t in plan] == [(i, i) for i in range(4)]
    assert [t.sizes for t in plan] == [(13, 6), (13, 6), (13, 6), (13, 3)]


def test_plan_permuted_placements_moves_whole_chunks() -> None:
    old = _chunks([12, 5], 0, [0, 1, 2, 3])
    new = _chunks([12, 5], 0, [3, 2, 1, 0])
    plan = plan_reshard(old, new)
    # Same boxes, new owners: chunk i goes from rank i to rank 3 - i, untouched.
    assert [(t.source, t.target, t.offsets, t.sizes) for t in plan] == [
        (i, i, (3 * i, 0), (3, 5)) for i in range(4)
    ]
    assert [(_owner(old[t.source]), _owner(new[t.target])) for t in plan] == [
        (0, 3),
        (1, 2),
        (2, 1),
        (3, 0),
    ]


def test_plan_uneven_chunks_and_empty_trailing_chunks() -> None:
    # 5 rows over 4 placements: sizes 2, 2, 1, 0 at offsets 0, 2, 4, 6.
    old = _chunks([5, 3], 0, [0, 1, 2, 3])
    new = _chunks([5, 3], 0, [0, 1])
    plan = plan_reshard(old, new)
    assert [(t.source, t.target, t.offsets, t.sizes) for t in plan] == [
        (0, 0, (0, 0), (2, 3)),
        (1, 0, (2, 0), (1, 3)),
        (1, 1, (3, 0), (1, 3)),
        (2, 1, (4, 0), (1, 3)),
    ]
    # The empty chunk (source 3) never appears, in either direction.
    assert all(t.source != 3 for t in plan)
    assert all(t.target != 3 for t in plan_reshard(new, old))


def test_plan_grid_to_chunk() -> None:
    grid = [
        _md([0, 0], [5, 5], 0),
        _md([0, 5], [5, 5], 1),
        _md([5, 0], [5, 5], 2),
        _md([5, 5], [5, 5], 3),
    ]
    new = _chunks([10, 10], 1, [3, 2, 1, 0])
    plan = plan_reshard(grid, new)
    assert [(t.source, t.target, t.offsets, t.sizes) for t in plan] == [
        (0, 0, (0, 0), (5, 3)),
        (2, 0, (5, 0), (5, 3)),
        (0, 1, (0, 3), (5, 2)),
        (1, 1, (0, 5), (5, 1)),
        (2, 1, (5, 3), (5, 2)),
        (3, 1, (5, 5), (5, 1)),
        (1, 2, (0, 6), (5, 3)),
        (3, 2, (5, 6), (5, 3)),
        (1, 3, (0, 9), (5, 1)),
        (3, 3, (5, 9), (5, 1)),
    ]


def test_plan_empty_inputs() -> None:
    shards = _chunks([4], 0, [0, 1])
    assert plan_reshard([], shards) == []
    assert plan_reshard(shards, []) == []


def test_transfer_is_a_frozen_value() -> None:
    transfer = Transfer(1, 2, (0, 3), (4, 5))
    assert transfer == Transfer(source=1, target=2, offsets=(0, 3), sizes=(4, 5))
    with pytest.raises(AttributeError):
        transfer.source = 3  # type: ignore[misc]


# -- plan_reshard properties -------------------------------------------------------------------


@st.composite
def _layouts(draw: st.DrawFn, size: list[int]) -> list[ShardMetadata]:
    """A chunk layout (any dim, any placements, repeats allowed) or a random grid tiling."""
    if draw(st.booleans()):
        dim = draw(st.integers(0, len(size) - 1))
        ranks = draw(st.lists(st.integers(0, WORLD - 1), min_size=1, max_size=6))
        return _chunks(size, dim, ranks)
    cuts_per_dim = []
    for extent in size:
        inner = (
            draw(st.sets(st.integers(1, max(extent - 1, 1)), max_size=3)) if extent > 1 else set()
        )
        cuts_per_dim.append([0, *sorted(inner), extent])
    shards = []
    for corner in itertools.product(*(range(len(c) - 1) for c in cuts_per_dim)):
        offsets = [cuts[i] for cuts, i in zip(cuts_per_dim, corner, strict=True)]
        sizes = [cuts[i + 1] - cuts[i] for cuts, i in zip(cuts_per_dim, corner, strict=True)]
        shards.append(_md(offsets, sizes, draw(st.integers(0, WORLD - 1))))
    # Validated like any user layout.
    EnumerableShardingSpec(shards).build_metadata(torch.Size(size), TensorProperties())
    return shards


def _owner_map(shards: list[ShardMetadata], size: list[int]) -> torch.Tensor:
    owners = torch.full(size, -1, dtype=torch.int64)
    for md in shards:
        view = owners
        for dim, (offset, extent) in enumerate(zip(md.shard_offsets, md.shard_sizes, strict=True)):
            view = view.narrow(dim, offset, extent) if extent else view.narrow(dim, 0, 0)
        view.fill_(_owner(md))
    return owners


def _box_mask(offsets: tuple[int, ...], sizes: tuple[int, ...], size: list[int]) -> torch.Tensor:
    mask = torch.zeros(size, dtype=torch.bool)
    view = mask
    for dim, (offset, extent) in enumerate(zip(offsets, sizes, strict=True)):
        view = view.narrow(dim, offset, extent)
    view.fill_(True)
    return mask


@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[int], list[ShardMetadata], list[ShardMetadata]]:
    size = draw(st.lists(st.integers(0, 7), min_size=1, max_size=3))
    return size, draw(_layouts(size)), draw(_layouts(size))


@settings(max_examples=80, deadline=None)
@given(_cases())
def test_plan_delivers_every_element_once_and_moves_only_changed_owners(
    case: tuple[list[int], list[ShardMetadata], list[ShardMetadata]],
) -> None:
    size, old, new = case
    plan = plan_reshard(old, new)
    assert [(t.target, t.source) for t in plan] == sorted((t.target, t.source) for t in plan)
    delivered = torch.zeros(size, dtype=torch.int64)
    crossing = torch.zeros(size, dtype=torch.int64)
    for t in plan:
        assert all(extent > 0 for extent in t.sizes)
        # The box lies inside both its source and its target shard.
        assert intersect(old[t.source], new[t.target]) == (t.offsets, t.sizes)
        mask = _box_mask(t.offsets, t.sizes, size)
        delivered += mask
        if _owner(old[t.source]) != _owner(new[t.target]):
            crossing += mask
    # Every element is delivered exactly once ...
    assert torch.equal(delivered, torch.ones(size, dtype=torch.int64))
    # ... and crosses ranks exactly when its owner changes: no rank receives what it holds.
    changed = (_owner_map(old, size) != _owner_map(new, size)).to(torch.int64)
    assert torch.equal(crossing, changed)


@settings(max_examples=50, deadline=None)
@given(_cases())
def test_plan_equals_all_pairs_intersection(
    case: tuple[list[int], list[ShardMetadata], list[ShardMetadata]],
) -> None:
    # The dim-0 pruning must not drop any overlapping pair.
    _, old, new = case
    brute = []
    for target, source in itertools.product(range(len(new)), range(len(old))):
        box = intersect(old[source], new[target])
        if box is not None:
            brute.append(Transfer(source, target, *box))
    assert plan_reshard(old, new) == brute


def test_plan_identical_layout_never_crosses_ranks() -> None:
    for dim, ranks in [(0, [0, 1, 2, 3]), (1, [3, 3, 0, 2, 1]), (0, [1])]:
        layout = _chunks([9, 6], dim, ranks)
        plan = plan_reshard(layout, layout)
        assert all(_owner(layout[t.source]) == _owner(layout[t.target]) for t in plan)
        assert sum(t.sizes[0] * t.sizes[1] for t in plan) == 54


# -- upstream helpers --------------------------------------------------------------------------


def test_get_idx_from_placements() -> None:
    placements = ["rank:2/cpu", "rank:0/cpu", "rank:3/cpu", "rank:0/cpu", "rank:1/cpu"]
    assert get_idx_from_placements(placements, 2) == 0
    # The first placement on the rank wins.
    assert get_idx_from_placements(placements, 0) == 1
    assert get_idx_from_placements(placements, 1) == 4
    as_devices = [RemoteDevice(p) for p in placements]
    assert get_idx_from_placements(as_devices, 3) == 2
    spec = ChunkShardingSpec(dim=0, placements=list(placements))
    assert get_idx_from_placements(spec.placements, 1) == 4  # type: ignore[arg-type]


def test_get_idx_from_placements_missing_rank() -> None:
    with pytest.raises(RuntimeError, match=re.escape("current_rank not in the placement.")):
        get_idx_from_placements(["rank:0/cpu", "rank:1/cpu"], 2)
    with pytest.raises(RuntimeError, match=re.escape("current_rank not in the placement.")):
        get_idx_from_placements([], 0)


def test_build_reshard_metadata_indexed_by_rank() -> None:
    spec = ChunkShardingSpec(
        dim=1, placements=["rank:2/cpu", "rank:0/cpu", "rank:3/cpu", "rank:1/cpu"]
    )
    by_rank, ranks = build_reshard_metadata(torch.Size([13, 21]), spec, 4)
    assert ranks == [2, 0, 3, 1]
    # Chunk i (offset 6 * i) belongs to ranks[i]; the list is indexed by rank.
    assert by_rank == [
        ShardMetadata([0, 6], [13, 6], "rank:0/cpu"),
        ShardMetadata([0, 18], [13, 3], "rank:1/cpu"),
        ShardMetadata([0, 0], [13, 6], "rank:2/cpu"),
        ShardMetadata([0, 12], [13, 6], "rank:3/cpu"),
    ]


def test_build_reshard_metadata_identity_and_even() -> None:
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(4)])
    by_rank, ranks = build_reshard_metadata(torch.Size([12, 24]), spec, 4)
    assert ranks == [0, 1, 2, 3]
    assert [md.shard_offsets for md in by_rank] == [[0, 0], [3, 0], [6, 0], [9, 0]]
    assert all(md.shard_sizes == [3, 24] for md in by_rank)
    assert [_owner(md) for md in by_rank] == [0, 1, 2, 3]
