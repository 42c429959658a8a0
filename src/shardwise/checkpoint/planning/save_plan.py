"""Who writes what in a save (:func:`plan_save`: O(tensors + ranks + irregular chunks x log),
not O(ranks x tensors); data file numbers are group ranks), from each tensor's **layout**, the
same on every rank that holds it:

- ``["mesh", mesh_number, placements]``: a DTensor (or a ``ChunkShardingSpec`` tensor) whose
  placements are ``"R"`` or ``"S<dim>"`` per mesh axis, each dim sharded by at most one axis;
  ``meshes[mesh_number]`` is ``[shape, group ranks in row-major order]``.
- ``["whole"]``: a plain tensor, replicated on every rank that has the key.
- ``["local"]``: anything else; the rank sends its own boxes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise._boxes import Box
from shardwise.checkpoint.index.layouts import Grid, ceil_grid_steps
from shardwise.checkpoint.index.tiling import check_tiling

__all__ = ["Mesh", "SavePlan", "TableRow", "mesh_grid", "plan_save"]

Mesh = tuple[tuple[int, ...], tuple[int, ...]]


def _sharded_dims(placements: Sequence[str], ndim: int) -> list[int] | None:
    """Per mesh axis, the tensor dim it shards (-1: replicates); ``None`` when a placement is
    unknown, a dim is out of range or sharded by two axes (nested: not a grid)."""
    dims = []
    for placement in placements:
        if placement == "R":
            dims.append(-1)
        elif placement[:1] == "S" and placement[1:].isdigit() and int(placement[1:]) < ndim:
            dims.append(int(placement[1:]))
        else:
            return None
    sharded = [d for d in dims if d >= 0]
    return dims if len(sharded) == len(set(sharded)) else None


def mesh_grid(
    size: Sequence[int],
    mesh: Mesh,
    placements: Sequence[str],
    replica: int = 0,
    rules: dict[Any, Any] | None = None,
) -> Grid | None:
    """The grid of a tensor of ``size`` laid out on ``mesh`` by ``placements`` (file number =
    group rank; dims cut by the ceil rule, as DTensor's ``Shard`` does), or ``None`` for a
    placement not ``"R"``/``"S<d>"``, a dim sharded twice, or cells' ranks not affine in their
    coordinates (a mesh over a permuted rank list). Of the replicas (ranks along ``Replicate``
    axes), number ``replica`` modulo their count writes; ``rules`` (one dict per mesh, kept by
    the caller) memoizes the O(mesh ranks) affine check and each grid: a model repeats shapes."""
    shape, ranks = mesh
    placements = tuple(placements)
    size = tuple(size)
    rules = {} if rules is None else rules
    # Replicas that choose the same writers share a grid: the choice, not the number, is
    # the memo's key (every key of a fully sharded mesh has choice 0).
    kinds = ("replicas", placements, len(size))
    count = rules.get(kinds)
    if count is None:
        dims = _sharded_dims(placements, len(size))
        count = 1
        if dims is not None and len(dims) == len(shape):
            count = math.prod(shape[axis] for axis, dim in enumerate(dims) if dim < 0)
        rules[kinds] = count
    choice = replica % count
    memo = ("grid", size, placements, choice)
    found = rules.get(memo, rules)  # the dict itself: not there
    if found is rules:
        found = rules[memo] = _mesh_grid(size, shape, ranks, placements, choice, rules)
    return found  # type: ignore[no-any-return]


def _mesh_grid(
    size: tuple[int, ...],
    shape: Sequence[int],
    ranks: Sequence[int],
    placements: tuple[str, ...],
    choice: int,
    rules: dict[Any, Any],
) -> Grid | None:
    dims = _sharded_dims(placements, len(size))
    if dims is None or len(placements) != len(shape) or math.prod(shape) != len(ranks):
        return None
    parts = [1] * len(size)
    for axis, dim in enumerate(dims):
        if dim >= 0:
            parts[dim] = shape[axis]
    steps = ceil_grid_steps(size, parts)
    probe = Grid(size, steps, 0, (0,) * len(size))
    axis_strides = [math.prod(shape[axis + 1 :]) for axis in range(len(shape))]
    replicas = [axis for axis, dim in enumerate(dims) if dim < 0]
    coordinate = [0] * len(shape)
    rest = choice
    for axis in reversed(replicas):
        rest, coordinate[axis] = divmod(rest, shape[axis])

    def rank_of(cell: Sequence[int]) -> int:
        position = coordinate[:]
        for axis, dim in enumerate(dims):
            if dim >= 0:
                position[axis] = cell[dim]
        return ranks[sum(c * s for c, s in zip(position, axis_strides, strict=True))]

    key = ("rule", placements, probe.counts, choice)
    if key not in rules:
        rules[key] = _rule(probe, rank_of)
    rule = rules[key]
    return None if rule is None else Grid(size, steps, rule[0], rule[1])


def _rule(
    probe: Grid, rank_of: Callable[[Sequence[int]], int]
) -> tuple[int, tuple[int, ...]] | None:
    """``(first, strides)`` when ``rank_of`` is affine in the cells of ``probe`` with
    non-negative strides, else ``None`` (checked on every cell: O(cells))."""
    ndim = len(probe.counts)
    first = rank_of((0,) * ndim)
    strides = []
    for dim, count in enumerate(probe.counts):
        unit = tuple(int(d == dim) for d in range(ndim))
        strides.append(rank_of(unit) - first if count > 1 else 0)
    if any(stride < 0 for stride in strides):
        return None
    grid = Grid(probe.size, probe.steps, first, tuple(strides))
    cells = itertools.product(*(range(count) for count in probe.counts))
    if any(grid.file_of(cell) != rank_of(cell) for cell in cells):
        return None
    return first, tuple(strides)


@dataclass(slots=True)
class TableRow:
    """One key of a rank's table: its global facts and layout (``local`` boxes travel apart).
    Treated as immutable; not frozen, which costs a fifth of a microsecond per field per key."""

    key: str
    dtype: str
    itemsize: int
    size: tuple[int, ...]
    properties: dict[str, Any]
    layout: tuple[Any, ...]

    def to_json(self) -> list[Any]:
        """This row as JSON (what a rank sends; :meth:`from_json` reads it back)."""
        size, layout = list(self.size), list(self.layout)
        return [self.key, self.dtype, self.itemsize, size, self.properties, layout]

    @classmethod
    def from_json(cls, row: list[Any]) -> TableRow:
        """A row another rank of the same job sent (trusted: a peer, not a file)."""
        key, dtype, itemsize, size, properties, layout = row
        return cls(key, dtype, itemsize, tuple(size), properties, tuple(layout))


@dataclass(slots=True)
class SavePlan:
    """The coordinator's decisions for one save: ``rows``, one per key in the order first
    seen; keys saved as ``grids``, one ``whole`` chunk (-> writer) or boxes (``chunks``:
    ``[(box, writer), ...]``); and ``loads``, per rank the bytes outside grids, blobs included."""

    rows: dict[str, TableRow]
    grids: dict[str, Grid] = field(default_factory=dict)
    whole: dict[str, int] = field(default_factory=dict)
    chunks: dict[str, list[tuple[Box, int]]] = field(default_factory=dict)
    loads: list[int] = field(default_factory=list)

    def assignments(self) -> list[dict[str, Any]]:
        """Per rank, what it writes besides its grid cells (which it derives itself):
        ``{"whole": [keys], "chunks": [[key, offsets], ...]}``."""
        per_rank: list[dict[str, Any]] = [{"whole": [], "chunks": []} for _ in self.loads]
        for key, rank in self.whole.items():
            per_rank[rank]["whole"].append(key)
        for key, boxes in self.chunks.items():
            for (offsets, _), rank in boxes:
                per_rank[rank]["chunks"].append([key, list(offsets)])
        return per_rank


def plan_save(
    tables: Sequence[Sequence[TableRow]],
    holders: Sequence[Sequence[int]],
    meshes: Sequence[Mesh],
    local: Mapping[int, Mapping[str, Sequence[Box]]],
    world_size: int,
    preassigned: Mapping[int, int] | None = None,
    skip: Collection[str] = (),
) -> SavePlan:
    """Plan a save from the distinct tables of its ranks.

    Args:
        tables: The distinct tables (ranks with equal tables send one, by digest).
        holders: For each table, the group ranks that have it.
        local: Per rank, its own boxes of each key with a ``local`` layout.
        preassigned: Bytes already given to a rank (object blobs).
        skip: Keys checked like the others but written by no rank (tied tensors); they keep
            their number, so the others' numbers do not move.

    Raises:
        ValueError: Tables disagree on a key's facts, a layout names a mesh or rank that
            does not exist, or a key's boxes do not tile it (the message names the key).
    """
    rows: dict[str, TableRow] = {}
    # Per key, the tables that have it (not their ranks: O(ranks) per key).
    key_tables: dict[str, list[int]] = {}
    for number, table in enumerate(tables):
        for row in table:
            known = rows.setdefault(row.key, row)
            if known != row:
                first = holders[key_tables[row.key][0]]
                raise ValueError(
                    f"cannot save {row.key!r}: ranks {list(first)[:4]} describe it as "
                    f"{_facts(known)}, ranks {list(holders[number])[:4]} as {_facts(row)}"
                )
            key_tables.setdefault(row.key, []).append(number)
    everyone = frozenset(range(world_size))
    # The object `everyone` itself for a table every rank has: tested by identity, O(1).
    held = [everyone if set(ranks) == everyone else frozenset(ranks) for ranks in holders]

    def holding(key: str) -> frozenset[int]:
        numbers = key_tables[key]
        if len(numbers) == 1:
            return held[numbers[0]]
        union = frozenset().union(*(held[number] for number in numbers))
        return everyone if union == everyone else union

    plan = SavePlan(rows, loads=[0] * world_size)
    for rank, nbytes in (preassigned or {}).items():
        plan.loads[rank] += nbytes
    whole: list[tuple[int, str]] = []
    rules: dict[int, tuple[Mesh, dict[Any, Any]]] = {}
    for number, row in enumerate(rows.values()):
        kind = row.layout[0]
        written = row.key not in skip
        if kind == "mesh":
            grid = _grid(row, meshes, world_size, number, rules)
            if written:
                plan.grids[row.key] = grid
        elif kind == "whole":
            if written:
                whole.append((number, row.key))
        elif kind == "local":
            loads = plan.loads if written else list(plan.loads)
            assigned = _assign_local(row, holding(row.key), local, loads)
            if written:
                plan.chunks[row.key] = assigned
        else:
            raise ValueError(f"cannot save {row.key!r}: unknown layout {kind!r}")
    _assign_whole(plan, [(number, key, holding(key)) for number, key in whole], everyone)
    return plan


def _facts(row: TableRow) -> str:
    return f"{row.dtype} of size {list(row.size)} laid out as {list(row.layout)}"


def _grid(
    row: TableRow,
    meshes: Sequence[Mesh],
    world_size: int,
    number: int,
    rules: dict[int, tuple[Mesh, dict[Any, Any]]],
) -> Grid:
    _, mesh_number, placements = row.layout
    if not 0 <= mesh_number < len(meshes):
        raise ValueError(f"cannot save {row.key!r}: mesh {mesh_number} does not exist")
    shape, ranks = meshes[mesh_number]
    if mesh_number not in rules:  # checked once per mesh
        if not all(0 <= rank < world_size for rank in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"cannot save {row.key!r}: its mesh's ranks {list(ranks)[:8]} are not "
                f"distinct ranks of the group of {world_size}"
            )
        rules[mesh_number] = ((tuple(shape), tuple(ranks)), {})
    mesh, known = rules[mesh_number]
    grid = mesh_grid(row.size, mesh, placements, replica=number, rules=known)
    if grid is None:
        raise ValueError(
            f"cannot save {row.key!r}: placements {list(placements)} on a mesh of shape "
            f"{list(shape)} are not a grid (a rank must describe it as 'local')"
        )
    return grid


def _assign_local(
    row: TableRow,
    ranks: Collection[int],
    local: Mapping[int, Mapping[str, Sequence[Box]]],
    loads: list[int],
) -> list[tuple[Box, int]]:
    """Each distinct box of a ``local`` key to its least loaded holder, largest first."""
    box_holders: dict[Box, list[int]] = {}
    for rank in sorted(ranks):
        for offsets, sizes in local.get(rank, {}).get(row.key, ()):
            box_holders.setdefault((tuple(offsets), tuple(sizes)), []).append(rank)
    try:
        check_tiling(row.size, list(box_holders))
    except ValueError as err:
        raise ValueError(f"cannot save {row.key!r}: its chunks do not tile it: {err}") from err
    assigned = []
    for box in sorted(box_holders, key=lambda b: (-math.prod(b[1]), b[0])):
        writer = min(box_holders[box], key=lambda rank: (loads[rank], rank))
        loads[writer] += math.prod(box[1]) * row.itemsize
        assigned.append((box, writer))
    return assigned


def _assign_whole(
    plan: SavePlan, whole: list[tuple[int, str, frozenset[int]]], everyone: frozenset[int]
) -> None:
    """Whole (replicated) tensors, largest first, each to its least loaded holder: from a heap
    of ``(load, rank)`` when every rank holds it (O(log ranks) each), else by a scan."""
    heap = [(load, rank) for rank, load in enumerate(plan.loads)]
    heapq.heapify(heap)
    loads, rows, assigned = plan.loads, plan.rows, plan.whole
    # Sorted as plain tuples (largest first, then by number: never compares further).
    order = sorted(
        (-math.prod(rows[key].size) * rows[key].itemsize, number, key, ranks)
        for number, key, ranks in whole
    )
    for negative, _, key, ranks in order:
        if ranks is everyone:
            while True:  # skip stale heap entries (loads changed by a scan)
                load, writer = heapq.heappop(heap)
                if load == loads[writer]:
                    break
        else:
            writer = min(ranks, key=lambda rank: (loads[rank], rank))
        loads[writer] -= negative
        heapq.heappush(heap, (loads[writer], writer))
        assigned[key] = writer
