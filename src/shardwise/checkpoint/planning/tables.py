"""The save protocol's two halves (``docs/architecture.md``, *Save*): a rank's table and the
chunks it writes, in O(its own entries) (:func:`rank_table`, :func:`own_file_writes`), and the
coordinator's plan from the distinct tables (:func:`plan_from_tables`)."""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from shardwise._boxes import Box, origin
from shardwise.checkpoint.entries.items import TensorValue
from shardwise.checkpoint.entries.pyjson import compact
from shardwise.checkpoint.index.layouts import Grid
from shardwise.checkpoint.planning import planner
from shardwise.checkpoint.planning.planner import TensorPlan, WriteAssignment
from shardwise.checkpoint.planning.save_plan import Mesh, SavePlan, TableRow, mesh_grid, plan_save
from shardwise.metadata import dtype_name

__all__ = ["CoordinatorPlan", "RankTable", "own_file_writes", "plan_from_tables", "rank_table"]

# The layout of a standalone LocalShardsWrapper: the coordinator fills in the bounding size.
_UNSIZED = ("local", "bounds")
_LOCAL = ("local",)


@dataclass(slots=True)
class RankTable:
    """One rank's description of what it holds: a row per tensor key in state-dict order, the
    meshes the ``mesh`` rows name (as group ranks), its boxes of each ``local`` key, its grid
    cell of each ``mesh`` key (``None``: no element), and the xxh3-128 ``digest`` of its JSON."""

    rows: list[TableRow]
    meshes: list[Mesh]
    local: dict[str, list[list[list[int]]]]
    cells: dict[str, tuple[int, ...] | None]
    digest: str = ""

    def to_json(self) -> dict[str, Any]:
        """The table as the coordinator receives it when its digest differs."""
        return {
            "rows": [row.to_json() for row in self.rows],
            "meshes": [[list(shape), list(ranks)] for shape, ranks in self.meshes],
        }


def own_cell(
    grid: Grid, mesh: Mesh, placements: Sequence[str], rank: int, position: int | None = None
) -> tuple[int, ...] | None:
    """The grid cell group rank ``rank`` (at ``position`` in the mesh's ranks, if known; -1:
    not there) holds on ``mesh``; ``None``: none, or an empty shard past the end of a dim."""
    shape, ranks = mesh
    if position is None:
        position = ranks.index(rank) if rank in ranks else -1
    if position < 0:
        return None
    cell = [0] * len(grid.size)
    for axis in range(len(shape) - 1, -1, -1):
        position, coordinate = divmod(position, shape[axis])
        if placements[axis] != "R":
            cell[int(placements[axis][1:])] = coordinate
    if any(k >= count for k, count in zip(cell, grid.counts, strict=True)):
        return None
    return tuple(cell)


class _Meshes:
    """The meshes of one rank's table, numbered in order of first use, with rules per mesh."""

    def __init__(self, group_rank_of: Callable[[int], int]) -> None:
        self._group_rank_of = group_rank_of
        self.meshes: list[Mesh] = []
        self._numbers: dict[Mesh, int] = {}
        self._by_object: dict[int, tuple[Any, int | None]] = {}
        self.rules: list[dict[Any, Any]] = []
        #: Per mesh, this rank's place in its ranks (-1: not there).
        self.positions: list[int] = []

    def number(self, device_mesh: Any, rank: int) -> int | None:
        """The number of ``device_mesh`` (a DeviceMesh or ``(shape, global ranks)``), ``None``
        when it has a rank outside the save's group."""
        known = self._by_object.get(id(device_mesh))
        if known is not None and known[0] is device_mesh:
            return known[1]
        if isinstance(device_mesh, tuple):
            shape, global_ranks = device_mesh
        else:
            shape, global_ranks = device_mesh.mesh.shape, device_mesh.mesh.flatten().tolist()
        ranks = tuple(self._group_rank_of(int(r)) for r in global_ranks)
        number = None
        if all(r >= 0 for r in ranks):
            mesh = (tuple(int(n) for n in shape), ranks)
            number = self._numbers.get(mesh)
            if number is None:
                number = self._numbers[mesh] = len(self.meshes)
                self.meshes.append(mesh)
                self.rules.append({})
                self.positions.append(ranks.index(rank) if rank in ranks else -1)
        self._by_object[id(device_mesh)] = (device_mesh, number)
        return number


# Properties are one object per distinct value (``items._properties``): their JSON form is
# computed once per object, not per key (the object is kept, so its id is not reused).
_FACTS: dict[tuple[int, torch.dtype], tuple[Any, str, int, dict[str, Any]]] = {}


def _row(key: str, value: TensorValue, size: Sequence[int], layout: tuple[Any, ...]) -> TableRow:
    properties = value.properties
    memo = (id(properties), value.dtype)
    known = _FACTS.get(memo)
    if known is None or known[0] is not properties:
        if len(_FACTS) > 256:  # only shared objects repeat; never grow without bound
            _FACTS.clear()
        dtype = value.dtype
        known = _FACTS[memo] = (properties, dtype_name(dtype), dtype.itemsize, properties.to_dict())
    return TableRow(key, known[1], known[2], tuple(size), known[3], layout)


def rank_table(
    tensors: Mapping[str, TensorValue], rank: int, group_rank_of: Callable[[int], int]
) -> RankTable:
    """This rank's table: plain tensors ``whole``, DTensors ``mesh`` when their rule gives
    this rank exactly the boxes it holds, anything else ``local`` with its boxes.

    Args:
        rank: This rank's rank in the save's group.
        group_rank_of: The save group's rank of a global rank (-1: not a member).
    """
    meshes = _Meshes(group_rank_of)
    table = RankTable([], [], {}, {})
    for key, value in tensors.items():
        layout = value.layout
        if layout is not None and layout[0] == "whole" and value.size is not None:
            table.rows.append(_row(key, value, value.size, ("whole",)))
            continue
        if layout is not None and layout[0] == "mesh" and value.size is not None:
            found = _mesh_row(key, value, layout, rank, meshes)
            if found is not None:
                row, cell = found
                table.rows.append(row)
                table.cells[key] = cell
                continue
        local_layout = _UNSIZED if value.size is None else _LOCAL
        table.rows.append(_row(key, value, value.size or (), local_layout))
        table.local[key] = [[list(box.offsets), list(box.sizes)] for box in value.boxes]
    table.meshes = meshes.meshes
    table.digest = str(xxhash.xxh3_128_hexdigest(compact(table.to_json(), sort_keys=True)))
    return table


def _mesh_row(
    key: str, value: TensorValue, layout: tuple[Any, ...], rank: int, meshes: _Meshes
) -> tuple[TableRow, tuple[int, ...] | None] | None:
    """The ``mesh`` row of a DTensor and this rank's cell, or ``None`` when its boxes are not
    what the rule gives this rank."""
    assert value.size is not None
    _, device_mesh, placements = layout
    number = meshes.number(device_mesh, rank)
    if number is None:
        return None
    mesh = meshes.meshes[number]
    grid = mesh_grid(value.size, mesh, placements, rules=meshes.rules[number])
    if grid is None:
        return None
    cell = own_cell(grid, mesh, placements, rank, meshes.positions[number])
    if cell is None:
        if len(value.boxes) > 1 or any(math.prod(box.sizes) for box in value.boxes):
            return None
    elif len(value.boxes) != 1 or value.boxes[0].box != grid.box(cell):
        return None
    return _row(key, value, value.size, ("mesh", number, list(placements))), cell


def own_file_writes(
    table: RankTable, tensors: Mapping[str, TensorValue], assignment: Mapping[str, Any], rank: int
) -> tuple[list[WriteAssignment], int]:
    """What this rank writes in the order of its data file (``docs/format.md``), and how many
    grid cells lead it: its grid cells (the key's number in the plan chooses the replica) by
    key, then the ``whole`` keys and ``local`` boxes it was given, by key and offsets."""
    skip = set(assignment.get("demoted", ())) | set(assignment.get("aliases", ()))
    numbers = assignment.get("numbers")
    rules: list[dict[Any, Any]] = [{} for _ in table.meshes]
    cells = []
    for position, row in enumerate(table.rows):
        if row.layout[0] != "mesh" or row.key in skip:
            continue
        cell = table.cells[row.key]
        if cell is None:
            continue
        _, number, placements = row.layout
        replica = position if numbers is None else numbers[position]
        grid = mesh_grid(row.size, table.meshes[number], placements, replica, rules[number])
        assert grid is not None  # checked when the table was built
        if grid.file_of(cell) == rank:
            offsets, sizes = grid.box(cell)
            cells.append(WriteAssignment(row.key, offsets, sizes, math.prod(sizes) * row.itemsize))
    others = []
    for key in assignment.get("whole", ()):
        value = tensors[key]
        assert value.size is not None
        size = tuple(value.size)
        nbytes = math.prod(size) * value.dtype.itemsize
        others.append(WriteAssignment(key, origin(len(size)), size, nbytes))
    for key, offsets in assignment.get("chunks", ()):
        value = tensors[key]
        wanted = tuple(offsets)
        box = next(box for box in value.boxes if box.offsets == wanted)
        nbytes = math.prod(box.sizes) * value.dtype.itemsize
        others.append(WriteAssignment(key, box.offsets, box.sizes, nbytes))
    order = operator.attrgetter("fqn", "offsets")
    return sorted(cells, key=order) + sorted(others, key=order), len(cells)


@dataclass(slots=True)
class CoordinatorPlan:
    """The coordinator's plan of a save: who writes what, tied keys -> their targets (not
    written), what to tell each rank, and ``total``, the tensor bytes all ranks write."""

    plan: SavePlan
    aliases: dict[str, str]
    assignments: list[dict[str, Any]]
    total: int


def plan_from_tables(
    coordinator: RankTable,
    envelopes: Sequence[Mapping[str, Any]],
    world_size: int,
    blob_bytes: Mapping[int, int],
) -> CoordinatorPlan:
    """Plan a save from every rank's envelope ``{"digest", "local", "table"?, "aliases"?}``
    (``"table"`` when its digest is not the coordinator's), in group-rank order.

    Raises:
        ValueError: Ranks disagree on a key's facts, or its chunks do not tile it (names it).
    """
    # The distinct tables, the coordinator's first, their meshes numbered in one list.
    mesh_numbers: dict[Mesh, int] = {}

    def renumber(rows: list[TableRow], own: Sequence[Mesh]) -> list[TableRow]:
        mapping = []
        for shape, ranks in own:
            mesh = (tuple(int(n) for n in shape), tuple(int(r) for r in ranks))
            mapping.append(mesh_numbers.setdefault(mesh, len(mesh_numbers)))
        if all(number == position for position, number in enumerate(mapping)):
            return list(rows)
        return [
            dataclasses.replace(r, layout=("mesh", mapping[r.layout[1]], r.layout[2]))
            if r.layout[0] == "mesh"
            else r
            for r in rows
        ]

    tables: list[list[TableRow]] = [renumber(coordinator.rows, coordinator.meshes)]
    holders: list[list[int]] = [[]]
    table_of: dict[str, int] = {coordinator.digest: 0}
    rank_tables = []
    local: dict[int, dict[str, list[Box]]] = {}
    for rank, envelope in enumerate(envelopes):
        number = table_of.get(envelope["digest"])
        if number is None:
            sent = envelope["table"]
            rows = [TableRow.from_json(row) for row in sent["rows"]]
            number = table_of[envelope["digest"]] = len(tables)
            tables.append(renumber(rows, sent["meshes"]))
            holders.append([])
        holders[number].append(rank)
        rank_tables.append(number)
        if envelope["local"]:
            local[rank] = {
                key: [(tuple(o), tuple(s)) for o, s in boxes]
                for key, boxes in envelope["local"].items()
            }
    meshes = list(mesh_numbers)
    demoted = _reconcile(tables, holders, meshes, local)
    _fill_sizes(tables, local)
    aliases = _agree_aliases(tables, holders, meshes, local, envelopes)
    plan = plan_save(tables, holders, meshes, local, world_size, blob_bytes, skip=aliases)
    # A rank with the coordinator's table numbers keys by their position in it.
    numbers = {key: number for number, key in enumerate(plan.rows)}
    per_table = [[numbers[row.key] for row in table] for table in tables[1:]]
    assignments = plan.assignments()
    for rank, assignment in enumerate(assignments):
        if rank_tables[rank]:
            assignment["numbers"] = per_table[rank_tables[rank] - 1]
        if rank in demoted:
            assignment["demoted"] = sorted(demoted[rank])
        if aliases:
            assignment["aliases"] = sorted(aliases)
    total = sum(plan.loads) - sum(blob_bytes.values())
    total += sum(math.prod(plan.rows[key].size) * plan.rows[key].itemsize for key in plan.grids)
    return CoordinatorPlan(plan, aliases, assignments, total)


def _reconcile(
    tables: list[list[TableRow]],
    holders: Sequence[Sequence[int]],
    meshes: Sequence[Mesh],
    local: dict[int, dict[str, list[Box]]],
) -> dict[int, set[str]]:
    """Make ``local`` in every table a key that ranks describe by different layouts (a failed
    rule check, a plain tensor here and a wrapper there), the facts being equal; the first
    rank's properties win. Returns, per rank, its ``mesh`` keys now ``local``."""
    demoted: dict[int, set[str]] = {}
    if len(tables) < 2:
        return demoted
    first: dict[str, TableRow] = {}
    conflicts: set[str] = set()
    for table in tables:
        for row in table:
            known = first.setdefault(row.key, row)
            if known is not row and known != row:
                conflicts.add(row.key)
    for key in sorted(conflicts):  # the same key named in every run
        found = [
            (holders[n][0], n, i, row)
            for n, table in enumerate(tables)
            for i, row in enumerate(table)
            if row.key == key
        ]
        found.sort(key=lambda item: item[0])
        first_rank, _, _, first_row = found[0]
        for rank, _, _, row in found[1:]:
            if (row.dtype, row.size) != (first_row.dtype, first_row.size):
                raise ValueError(
                    f"cannot save {key!r}: rank {first_rank} has dtype {first_row.dtype} and "
                    f"size {list(first_row.size)}, rank {rank} has dtype {row.dtype} and size "
                    f"{list(row.size)}"
                )
        demote = len({json.dumps(row.layout) for *_, row in found}) > 1
        for _, n, i, row in found:
            layout = row.layout
            if demote and layout[0] != "local":
                for rank in holders[n]:
                    local.setdefault(rank, {})[key] = _boxes_of(row, rank, meshes, local)
                    if layout[0] == "mesh":
                        demoted.setdefault(rank, set()).add(key)
                layout = _LOCAL
            tables[n][i] = dataclasses.replace(row, properties=first_row.properties, layout=layout)
    return demoted


def _fill_sizes(
    tables: list[list[TableRow]], local: Mapping[int, Mapping[str, Sequence[Box]]]
) -> None:
    """Give an unsized ``local`` key the bounding size of every rank's filled boxes."""
    unsized = {row.key for table in tables for row in table if tuple(row.layout) == _UNSIZED}
    if not unsized:
        return
    bounds: dict[str, list[int]] = {}
    for boxes in local.values():
        for key in boxes.keys() & unsized:
            for offsets, sizes in boxes[key]:
                if math.prod(sizes):
                    stops = [o + s for o, s in zip(offsets, sizes, strict=True)]
                    bounds[key] = list(map(max, bounds.get(key, stops), stops))
    for n, table in enumerate(tables):
        tables[n] = [
            dataclasses.replace(r, size=tuple(bounds.get(r.key, [])), layout=_LOCAL)
            if tuple(r.layout) == _UNSIZED
            else r
            for r in table
        ]


def _agree_aliases(
    tables: Sequence[Sequence[TableRow]],
    holders: Sequence[Sequence[int]],
    meshes: Sequence[Mesh],
    local: Mapping[int, Mapping[str, Sequence[Box]]],
    envelopes: Sequence[Mapping[str, Any]],
) -> dict[str, str]:
    """:func:`planner.agree_aliases` on the keys some rank sees tied, their holders derived
    from the layouts (O(ranks) per such key; tied keys are few)."""
    per_rank = [envelope.get("aliases") or {} for envelope in envelopes]
    involved = {key for aliases in per_rank for pair in aliases.items() for key in pair}
    if not involved:
        return {}
    found: dict[str, tuple[TableRow, list[int]]] = {}
    for n, table in enumerate(tables):
        for row in table:
            if row.key in involved:
                found.setdefault(row.key, (row, []))[1].extend(holders[n])
    merged = {}
    for key, (row, ranks) in found.items():
        boxes: dict[Box, list[int]] = {}
        for rank in sorted(ranks):
            for box in _boxes_of(row, rank, meshes, local):
                boxes.setdefault(box, []).append(rank)
        merged[key] = TensorPlan(row.dtype, row.size, row.properties, boxes)
    return planner.agree_aliases(per_rank, merged)


def _boxes_of(
    row: TableRow,
    rank: int,
    meshes: Sequence[Mesh],
    local: Mapping[int, Mapping[str, Sequence[Box]]],
) -> list[Box]:
    """The boxes of ``row``'s key that ``rank`` holds, by its layout."""
    kind = row.layout[0]
    if kind == "whole":
        return [((0,) * len(row.size), row.size)]
    if kind == "mesh":
        _, number, placements = row.layout
        grid = mesh_grid(row.size, meshes[number], placements)
        cell = None if grid is None else own_cell(grid, meshes[number], placements, rank)
        return [] if grid is None or cell is None else [grid.box(cell)]
    return [(tuple(o), tuple(s)) for o, s in local.get(rank, {}).get(row.key, ())]
