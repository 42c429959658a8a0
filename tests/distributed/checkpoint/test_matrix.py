"""The resharding matrix: a checkpoint saved in every layout loads exactly into every layout.

Layouts: ChunkShardingSpec on dim 0 and dim 1 over 2, 3 and 4 ranks (sub-groups of the 4-rank
world for 2 and 3), an uneven EnumerableShardingSpec grid, several shards per rank, DTensor
Shard(0)/Shard(1)/Replicate on a 1-D mesh and three placements on a 2x2 mesh, a
LocalShardsWrapper alone and as a DTensor's local tensor, plain (replicated) tensors, and a
single process without any process group. Each state dict holds a 5x7 tensor of every dtype
below (uneven splits, empty trailing shards) and a 0-d tensor; every element is compared.

To stay fast, one 4-rank body saves one checkpoint per source layout and loads each into every
target layout; the pytest process itself saves the single-process source first and loads
every source at the end (it has no process group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.local_shards import LocalShardsWrapper
from tests.harness import run_on_ranks

SHAPE = (5, 7)
DTYPES = {
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "f64": torch.float64,
    "i64": torch.int64,
    "bool": torch.bool,
    "c64": torch.complex64,
}
SCALAR = "scalar"  # a 0-d float64 tensor in every layout

#: 1-D-mesh and 2x2-mesh DTensor placements.
MESH_1D: dict[str, list[Placement]] = {
    "dt_shard0": [Shard(0)],
    "dt_shard1": [Shard(1)],
    "dt_replicate": [Replicate()],
}
MESH_2D: dict[str, list[Placement]] = {
    "dt2_shard0_shard1": [Shard(0), Shard(1)],
    "dt2_shard1_replicate": [Shard(1), Replicate()],
    "dt2_shard0_shard0": [Shard(0), Shard(0)],
}
#: ChunkShardingSpec layouts: (dim, placements as global ranks); 2 and 3 ranks use sub-groups.
CHUNKED: dict[str, tuple[int, list[int]]] = {
    "rows2": (0, [0, 1]),
    "rows3": (0, [2, 0, 1]),
    "rows4": (0, [0, 1, 2, 3]),  # 2, 2, 1, 0 rows: rank 3's shard is empty (offset 6)
    "cols2": (1, [1, 0]),
    "cols3": (1, [0, 1, 2]),
    "cols4": (1, [3, 1, 0, 2]),
}
#: EnumerableShardingSpec layouts: boxes (offsets, sizes) and their global ranks.
ENUMERABLE: dict[str, list[tuple[tuple[int, int], tuple[int, int], int]]] = {
    # An uneven 2x2 grid, placed out of order.
    "grid": [
        ((0, 0), (3, 2), 2),
        ((0, 2), (3, 5), 0),
        ((3, 0), (2, 2), 3),
        ((3, 2), (2, 5), 1),
    ],
    # Eight boxes, two per rank, not adjacent.
    "multi": [
        ((0, 0), (1, 4), 0),
        ((0, 4), (1, 3), 1),
        ((1, 0), (2, 4), 2),
        ((1, 4), (2, 3), 3),
        ((3, 0), (1, 4), 1),
        ((3, 4), (1, 3), 0),
        ((4, 0), (1, 4), 3),
        ((4, 4), (1, 3), 2),
    ],
}
#: Rows held by each rank in the LocalShardsWrapper layouts (each as two column blocks).
WRAPPER_ROWS = [(0, 2), (2, 1), (3, 1), (4, 1)]
WRAPPER_COLS = [(0, 3), (3, 4)]

DIST_LAYOUTS = [
    *CHUNKED,
    *ENUMERABLE,
    *MESH_1D,
    *MESH_2D,
    "lsw",
    "dt_lsw",
    "plain",
]
#: Layouts of the pytest process (no process group): plain tensors, and a wrapper of 3 shards.
SINGLE_LAYOUTS = ["single", "single_lsw"]
SINGLE_SEED = 1000


# -- data ------------------------------------------------------------------------------------


def _expected(seed: int) -> dict[str, torch.Tensor]:
    """The full tensors of the source saved with ``seed`` (small integers: exact everywhere)."""
    out = {}
    for index, (name, dtype) in enumerate(DTYPES.items()):
        g = torch.Generator().manual_seed(seed * 31 + index)
        values = torch.randint(-50, 51, SHAPE, generator=g)
        if dtype == torch.bool:
            out[name] = values > 0
        elif dtype.is_complex:
            out[name] = torch.complex(values.float(), (values % 7).float()).to(dtype)
        else:
            out[name] = values.to(dtype)
    out[SCALAR] = torch.tensor(seed + 0.25, dtype=torch.float64)
    return out


def _perturbed(fulls: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Different from ``fulls`` in every element, so a load that skips one is caught."""
    return {k: ~t if t.dtype == torch.bool else t + 1 for k, t in fulls.items()}


def _region(full: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    if math.prod(sizes) == 0:
        return torch.empty(sizes, dtype=full.dtype)  # an empty shard may lie past the end
    view = full
    for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        view = view.narrow(dim, o, n)
    return view


def _ceil_split(length: int, parts: int) -> list[tuple[int, int]]:
    """(offset, size) of each part when ``length`` is cut the torch.chunk way."""
    step = -(-length // parts)
    return [(min(i * step, length), max(0, min(step, length - i * step))) for i in range(parts)]


def _dtensor_box(mesh: DeviceMesh, placements: list[Placement]) -> tuple[tuple[int, ...], ...]:
    """This rank's box of a DTensor of SHAPE, computed independently of shardwise."""
    offsets, sizes = [0, 0], list(SHAPE)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            dim = placement.dim
            start, size = _ceil_split(sizes[dim], mesh.size(mesh_dim))[coordinate[mesh_dim]]
            offsets[dim] += start
            sizes[dim] = size
    return tuple(offsets), tuple(sizes)


# -- layouts ---------------------------------------------------------------------------------


@dataclass
class Context:
    """Process groups and meshes, created once per body (collectively)."""

    rank: int
    groups: dict[int, Any]
    mesh_1d: DeviceMesh
    mesh_2d: DeviceMesh

    @classmethod
    def create(cls) -> Context:
        groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: None}
        return cls(
            dist.get_rank(),
            groups,
            init_device_mesh("cpu", (4,)),
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")),
        )

    def group(self, layout: str) -> Any:
        """The process group a layout saves and loads over (None: the default group)."""
        if layout in CHUNKED:
            return self.groups[len(CHUNKED[layout][1])]
        return None

    def member(self, layout: str) -> bool:
        if layout in CHUNKED:
            return self.rank < len(CHUNKED[layout][1])
        return True


def _sharded(full: torch.Tensor, spec: sw.ShardingSpec, group: Any) -> sw.ShardedTensor:
    """A ShardedTensor of ``full`` in ``spec``, built without communication."""
    rank = dist.get_rank()
    metadata = spec.build_metadata(torch.Size(SHAPE), sw.TensorProperties(dtype=full.dtype))
    local = [
        sw.Shard(_region(full, tuple(md.shard_offsets), tuple(md.shard_sizes)).clone(), md)
        for md in metadata.shards_metadata
        if md.placement is not None and md.placement.rank() == rank
    ]
    return sw.init_from_local_shards_and_global_metadata(local, metadata, process_group=group)


def _wrapper(full: torch.Tensor, rank: int) -> LocalShardsWrapper:
    row, rows = WRAPPER_ROWS[rank]
    shards = [_region(full, (row, c), (rows, n)).clone() for c, n in WRAPPER_COLS]
    return LocalShardsWrapper(shards, [(row, c) for c, _ in WRAPPER_COLS])


def _value(layout: str, full: torch.Tensor, ctx: Context | None) -> Any:
    """``full`` as ``layout`` holds it on this rank."""
    if layout in ("single", "plain") or (full.dim() == 0 and layout in ("lsw", "single_lsw")):
        return full.clone()
    if layout == "single_lsw":
        boxes = [((0, 0), (2, 7)), ((2, 0), (3, 3)), ((2, 3), (3, 4))]
        return LocalShardsWrapper(
            [_region(full, o, s).clone() for o, s in boxes], [o for o, _ in boxes]
        )
    assert ctx is not None
    if full.dim() == 0:
        # The scalar rides along as a replicated DTensor in DTensor layouts, plain otherwise.
        if layout in MESH_1D or layout == "dt_lsw":
            return DTensor.from_local(full.clone(), ctx.mesh_1d, [Replicate()], run_check=False)
        if layout in MESH_2D:
            return DTensor.from_local(
                full.clone(), ctx.mesh_2d, [Replicate(), Replicate()], run_check=False
            )
        return full.clone()
    if layout in CHUNKED:
        dim, ranks = CHUNKED[layout]
        spec = sw.ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in ranks])
        return _sharded(full, spec, ctx.group(layout))
    if layout in ENUMERABLE:
        boxes = [
            sw.ShardMetadata(list(o), list(n), f"rank:{r}/cpu") for o, n, r in ENUMERABLE[layout]
        ]
        return _sharded(full, sw.EnumerableShardingSpec(boxes), None)
    if layout == "lsw":
        return _wrapper(full, ctx.rank)
    if layout == "dt_lsw":
        return DTensor.from_local(
            _wrapper(full, ctx.rank),
            ctx.mesh_1d,
            [Shard(0)],
            shape=torch.Size(SHAPE),
            stride=(SHAPE[1], 1),
            run_check=False,
        )
    mesh, placements = (
        (ctx.mesh_1d, MESH_1D[layout]) if layout in MESH_1D else (ctx.mesh_2d, MESH_2D[layout])
    )
    offsets, sizes = _dtensor_box(mesh, placements)
    local = _region(full, offsets, sizes).clone()
    return DTensor.from_local(
        local, mesh, placements, shape=torch.Size(SHAPE), stride=(SHAPE[1], 1), run_check=False
    )


def _build(layout: str, fulls: dict[str, torch.Tensor], ctx: Context | None) -> dict[str, Any]:
    return {"tensors": {key: _value(layout, full, ctx) for key, full in fulls.items()}}


def _local_pieces(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Every local tensor a value holds, with its global offsets (read back from the value)."""
    if isinstance(value, sw.ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = value.to_local()
        if isinstance(local, LocalShardsWrapper):
            return _local_pieces(local)
        if value.dim() == 0:
            return [((), local)]
        offsets, sizes = _dtensor_box(value.device_mesh, list(value.placements))
        assert tuple(local.shape) == sizes
        return [(offsets, local)]
    if isinstance(value, LocalShardsWrapper):
        return [
            (tuple(int(o) for o in offsets), shard)
            for offsets, shard in zip(value.local_offsets(), value.local_shards(), strict=True)
        ]
    return [((0,) * value.dim(), value)]


def _check(layout: str, state: dict[str, Any], fulls: dict[str, torch.Tensor], what: str) -> int:
    """Compare every element this rank holds; returns the number of elements compared."""
    compared = 0
    for key, full in fulls.items():
        for offsets, local in _local_pieces(state["tensors"][key]):
            expected = _region(full, offsets, tuple(local.shape)) if offsets else full
            assert local.dtype == full.dtype, f"{what}: {key} dtype {local.dtype}"
            assert torch.equal(local, expected), f"{what}: {key} at {offsets} differs"
            compared += local.numel()
    return compared


# -- the matrix ------------------------------------------------------------------------------


def _matrix_body(root: str) -> dict[str, int]:
    ctx = Context.create()
    for seed, layout in enumerate(DIST_LAYOUTS):
        if ctx.member(layout):
            state = _build(layout, _expected(seed), ctx)
            ckpt.save(state, f"{root}/{layout}", process_group=ctx.group(layout))
    dist.barrier()  # every source is committed before anyone loads it

    sources = [(layout, seed) for seed, layout in enumerate(DIST_LAYOUTS)]
    sources += [("single", SINGLE_SEED)]
    compared: dict[str, int] = {}
    for source, seed in sources:
        fulls = _expected(seed)
        for target in DIST_LAYOUTS:
            if not ctx.member(target):
                continue
            state = _build(target, _perturbed(fulls), ctx)
            ckpt.load(state, f"{root}/{source}", process_group=ctx.group(target))
            compared[f"{source}->{target}"] = _check(target, state, fulls, f"{source}->{target}")
    return compared


def test_every_layout_loads_into_every_layout(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    ckpt.save(_build("single", _expected(SINGLE_SEED), None), tmp_path / "single")

    per_rank = run_on_ranks(_matrix_body, 4, args=(str(tmp_path),), timeout=240)

    # Every pair ran, and over the ranks of each target every element was compared at least
    # once (replicated layouts compare it on several ranks).
    sources = [*DIST_LAYOUTS, "single"]
    elements = len(DTYPES) * math.prod(SHAPE) + 1
    for source in sources:
        for target in DIST_LAYOUTS:
            counts = [c.get(f"{source}->{target}") for c in per_rank]
            held = [n for n in counts if n is not None]
            assert len(held) == (len(CHUNKED[target][1]) if target in CHUNKED else 4)
            assert sum(held) >= elements, (source, target, counts)

    # The index records the saving world, and replicated layouts store each tensor once.
    for source in sources:
        metadata = ckpt.read_metadata(tmp_path / source)
        world = len(CHUNKED[source][1]) if source in CHUNKED else (1 if source == "single" else 4)
        assert metadata.planner_data["world_size"] == world, source
        if source in ("plain", "dt_replicate", "single"):
            for fqn, entry in metadata.state_dict_metadata.items():
                assert len(entry.chunks) == 1, (source, fqn)

    # The single process (no process group) loads every source, plain and as a wrapper.
    for seed, source in [*enumerate(DIST_LAYOUTS), (SINGLE_SEED, "single")]:
        fulls = _expected(seed)
        for target in SINGLE_LAYOUTS:
            state = _build(target, _perturbed(fulls), None)
            ckpt.load(state, tmp_path / source)
            assert _check(target, state, fulls, f"{source}->{target}") == elements
