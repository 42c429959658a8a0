"""The layout rule (a DTensor-style mesh layout as a version-4 grid, checked against
``torch.chunk``, the rule DTensor's ``Shard`` follows) and the coordinator's planning of a
save from tables of layouts."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint.index.layouts import FileOrder, Grid, file_cells
from shardwise.checkpoint.planning.save_plan import Mesh, TableRow, mesh_grid, plan_save


def _chunk_box(
    size: tuple[int, ...], shape, dims, position
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A rank's box by ``torch.chunk`` along each sharded dim (an empty box past the end)."""
    offsets, sizes = [0] * len(size), list(size)
    for axis, dim in enumerate(dims):
        if dim < 0:
            continue
        pieces = torch.arange(size[dim]).chunk(shape[axis])
        k = position[axis]
        if k < len(pieces):
            offsets[dim], sizes[dim] = int(pieces[k][0]) if len(pieces[k]) else 0, len(pieces[k])
        else:
            offsets[dim], sizes[dim] = size[dim], 0
    return tuple(offsets), tuple(sizes)


@st.composite
def _layouts(draw: st.DrawFn):
    ndim = draw(st.integers(1, 3))
    size = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    free = list(range(ndim))
    dims = []
    for _ in shape:
        choice = draw(st.sampled_from([-1, *free]))
        if choice >= 0:
            free.remove(choice)
        dims.append(choice)
    return size, shape, dims, draw(st.integers(0, 20))


@settings(max_examples=300, deadline=None)
@given(layout=_layouts())
def test_mesh_grid_cells_are_the_ranks_torch_chunk_shards(layout) -> None:
    size, shape, dims, replica = layout
    ranks = tuple(range(math.prod(shape)))
    placements = ["R" if d < 0 else f"S{d}" for d in dims]
    grid = mesh_grid(size, (shape, ranks), placements, replica)
    assert grid is not None
    replicas = [axis for axis, d in enumerate(dims) if d < 0]
    chosen = replica % math.prod([shape[a] for a in replicas] or [1])
    seen = set()
    for position in itertools.product(*(range(n) for n in shape)):
        rank = sum(p * math.prod(shape[a + 1 :]) for a, p in enumerate(position))
        choice = 0
        for axis in replicas:
            choice = choice * shape[axis] + position[axis]
        offsets, sizes = _chunk_box(size, shape, dims, position)
        if choice != chosen or not math.prod(sizes):
            continue
        cell = tuple(
            next((position[a] for a, d in enumerate(dims) if d == dim), 0)
            for dim in range(len(size))
        )
        assert grid.box(cell) == (offsets, sizes)
        assert grid.file_of(cell) == rank
        seen.add(cell)
    if math.prod(size):  # every non-empty cell is some rank's shard
        assert seen == set(itertools.product(*(range(n) for n in grid.counts)))


@settings(max_examples=200, deadline=None)
@given(
    layouts=st.lists(_layouts(), min_size=1, max_size=12),
    mesh_shape=st.sampled_from([(4,), (2, 2), (2, 3), (3, 2, 2)]),
)
def test_mesh_grid_with_a_rules_cache_is_mesh_grid_without(layouts, mesh_shape) -> None:
    # One cache per mesh, shared by every key in any order (as rank_table, own_file_writes and
    # plan_save keep it): each answer is the uncached one. The cache once keyed rules by
    # what was left of the replica choice after it was taken apart, so every replica got
    # the first one's writers: ranks whose keys came in another order disagreed.
    mesh = (mesh_shape, tuple(range(math.prod(mesh_shape))))
    rules: dict = {}
    for size, _, dims, replica in layouts:
        dims = dims[: len(mesh_shape)] + [-1] * (len(mesh_shape) - len(dims))
        placements = ["R" if d < 0 else f"S{d}" for d in dims]
        expected = mesh_grid(size, mesh, placements, replica)
        assert mesh_grid(size, mesh, placements, replica, rules) == expected
        assert mesh_grid(size, mesh, placements, replica, rules) == expected  # memo hit


def test_mesh_grid_of_common_layouts() -> None:
    fsdp: Mesh = ((4,), (0, 1, 2, 3))
    assert mesh_grid((10, 3), fsdp, ["S0"]) == Grid((10, 3), (3, 3), 0, (1, 0))
    # TP x FSDP on different dims of a 2 x 3 mesh: cell (i, j) is rank 3 i + j.
    assert mesh_grid((4, 6), ((2, 3), tuple(range(6))), ["S0", "S1"]) == Grid(
        (4, 6), (2, 2), 0, (3, 1)
    )
    # HSDP: replicas along axis 0; replica 1 (of 2) writes, from rank 4 on.
    hsdp: Mesh = ((2, 4), tuple(range(8)))
    assert mesh_grid((8,), hsdp, ["R", "S0"], replica=1) == Grid((8,), (2,), 4, (1,))
    assert mesh_grid((8,), hsdp, ["R", "S0"], replica=2) == Grid((8,), (2,), 0, (1,))
    # A sub-mesh of the group: ranks 4..7.
    assert mesh_grid((8,), ((4,), (4, 5, 6, 7)), ["S0"]) == Grid((8,), (2,), 4, (1,))
    # Not grids: nested sharding of one dim, a permuted rank list, unknown placements.
    assert mesh_grid((8,), ((2, 2), (0, 1, 2, 3)), ["S0", "S0"]) is None
    assert mesh_grid((8,), ((4,), (1, 0, 2, 3)), ["S0"]) is None
    assert mesh_grid((8,), fsdp, ["P"]) is None
    assert mesh_grid((8,), fsdp, ["S1"]) is None
    assert mesh_grid((8,), fsdp, ["S0", "R"]) is None


def _row(key: str, size: tuple[int, ...], layout: tuple, itemsize: int = 4) -> TableRow:
    return TableRow(key, "float32", itemsize, size, {"requires_grad": False}, layout)


def test_plan_save_from_one_fsdp_table() -> None:
    world = 4
    table = [_row("w", (10, 3), ("mesh", 0, ["S0"]))]
    table += [_row(f"step{i}", (), ("whole",), itemsize=8) for i in range(6)]
    table += [_row("odd", (4, 2), ("local",))]
    local = {0: {"odd": [((0, 0), (1, 2))]}, 1: {"odd": [((1, 0), (3, 2)), ((0, 0), (1, 2))]}}
    plan = plan_save(
        [table],
        [range(world)],
        [((world,), tuple(range(world)))],
        local,
        world,
        preassigned={0: 100},
    )
    assert plan.grids == {"w": Grid((10, 3), (3, 3), 0, (1, 0))}
    # Rank 0 starts with 100 B of blobs. The 3-row box (24 B) goes to its only holder, 1; the
    # duplicated 1-row box (8 B) to the less loaded of its holders: 1 again.
    assert plan.chunks == {"odd": [(((1, 0), (3, 2)), 1), (((0, 0), (1, 2)), 1)]}
    # The six 8-byte steps, held by every rank, each to the least loaded rank (the lowest on
    # a tie): ranks 2 and 3 in turn.
    assert [plan.whole[f"step{i}"] for i in range(6)] == [2, 3, 2, 3, 2, 3]
    assert plan.loads == [100, 32, 24, 24]
    tell = plan.assignments()
    assert tell[0] == {"whole": [], "chunks": []}
    assert tell[1] == {"whole": [], "chunks": [["odd", [1, 0]], ["odd", [0, 0]]]}
    assert tell[2] == {"whole": ["step0", "step2", "step4"], "chunks": []}


def test_plan_save_merges_tables_and_refuses_disagreements() -> None:
    mesh: list[Mesh] = [((2,), (0, 1))]
    first = [_row("w", (4,), ("mesh", 0, ["S0"])), _row("a", (2,), ("whole",))]
    second = [_row("w", (4,), ("mesh", 0, ["S0"])), _row("b", (2,), ("whole",))]
    plan = plan_save([first, second], [[0], [1]], mesh, {}, 2)
    assert list(plan.rows) == ["w", "a", "b"]
    assert plan.whole == {"a": 0, "b": 1}  # each held by one rank only
    other = [_row("w", (5,), ("mesh", 0, ["S0"]))]
    with pytest.raises(ValueError, match=r"cannot save 'w': ranks \[0\] describe it as"):
        plan_save([first, other], [[0], [1]], mesh, {}, 2)
    with pytest.raises(ValueError, match="mesh 3 does not exist"):
        plan_save([[_row("w", (4,), ("mesh", 3, ["S0"]))]], [[0, 1]], mesh, {}, 2)
    with pytest.raises(ValueError, match="not distinct ranks of the group of 2"):
        plan_save([first], [[0, 1]], [((2,), (0, 5))], {}, 2)
    with pytest.raises(ValueError, match="are not a grid"):
        plan_save([[_row("w", (4,), ("mesh", 0, ["S1"]))]], [[0, 1]], mesh, {}, 2)
    gap = {0: {"o": [((0,), (1,))]}, 1: {"o": [((2,), (2,))]}}
    with pytest.raises(ValueError, match="'o': its chunks do not tile it"):
        plan_save([[_row("o", (4,), ("local",))]], [[0, 1]], mesh, gap, 2)
    with pytest.raises(ValueError, match="unknown layout 'rows'"):
        plan_save([[_row("e", (4,), ("rows",))]], [[0, 1]], mesh, {}, 2)


def test_tables_travel_as_json() -> None:
    table = [_row("w", (10, 3), ("mesh", 0, ["S0"])), _row("s", (), ("whole",))]
    sent = json.loads(json.dumps([row.to_json() for row in table]))
    assert [TableRow.from_json(row) for row in sent] == table


def test_a_writer_lays_its_grid_cells_out_as_the_reader_finds_them() -> None:
    # What rank 1 writes, in order, from its data start: each grid key's cells in its file,
    # in row order; the index's reader finds each at the prefix sum (FileOrder).
    world = 4
    table = [
        _row("a", (10, 3), ("mesh", 0, ["S0"])),
        _row("s", (), ("whole",)),
        _row("b", (4, 8), ("mesh", 1, ["S0", "S1"])),
    ]
    meshes: list[Mesh] = [((world,), tuple(range(world))), ((2, 2), tuple(range(world)))]
    plan = plan_save([table], [range(world)], meshes, {}, world)
    assert sum(grid.num_cells for grid in plan.grids.values()) + len(plan.whole) == 4 + 1 + 4
    grids = [(key, grid, plan.rows[key].itemsize) for key, grid in plan.grids.items()]
    assert [key for key, _, _ in grids] == ["a", "b"]
    written = list(file_cells(grids, 1))
    assert written == [("a", 1, ((3, 0), (3, 3)), 36), ("b", 1, ((0, 4), (2, 4)), 32)]
    order = FileOrder(grids, 1, 64, 64 + 36 + 32)
    assert (order.begin("a", 1), order.begin("b", 1)) == (64, 100)
