"""``save`` writing the index in real process groups: DTensor meshes and
``ChunkShardingSpec`` tensors saved as grids (file number = group rank; a rank that holds
nothing writes no file, its number is null), replicated tensors as ``whole``, irregular local
chunks as ``chunks``, blobs and ties; loaded back by the same world, resharded, and by fewer
ranks; a corrupt file refused on every rank with no Python value replaced."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.checkpoint import tuning as tuning_module
from shardwise.checkpoint.index import INDEX_NAME
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.cli import main
from shardwise.errors import CheckpointDataError
from shardwise.local_shards import LocalShardsWrapper
from tests.harness import distributed, run_on_ranks

outcome_module = importlib.import_module("shardwise.checkpoint.saving.outcome")

WORLD = 4
BLOB = b"\x00\xffbytes of a blob " * 100


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` for the body of the ``with`` (the pooled workers live on)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _full(rows: int, cols: int, shift: float = 0.0) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + shift


# key -> the full tensor every rank's piece comes from.
FULLS = {
    "fsdp": _full(10, 3),  # rows 3, 3, 3, 1
    "uneven": _full(5, 4, 100.0),  # rows 2, 2, 1, and an empty shard past the end on rank 3
    "nothing": torch.zeros(0, 3),
    "hsdp": _full(6, 5, 200.0),  # 2-D mesh: Replicate, Shard(0)
    "tp": _full(7, 9, 300.0),  # 2-D mesh: Shard(0), Shard(1)
    "chunked": _full(4, 10, 400.0),  # ChunkShardingSpec on dim 1
    "wrapper": _full(8, 5, 500.0),  # LocalShardsWrapper: two column pieces of 2 rows per rank
    "plain": torch.arange(7.0),  # replicated
    "tied": torch.arange(7.0),  # the same tensor as plain on every rank
}


def _sharded(full: torch.Tensor, spec: sw.ShardingSpec) -> sw.ShardedTensor:
    rank = dist.get_rank()
    metadata = spec.build_metadata(full.size(), sw.TensorProperties(dtype=full.dtype))
    local = []
    for md in metadata.shards_metadata:
        if md.placement is not None and md.placement.rank() == rank:
            box = tuple(
                slice(o, o + n) for o, n in zip(md.shard_offsets, md.shard_sizes, strict=True)
            )
            local.append(sw.Shard(full[box].clone(), md))
    return sw.init_from_local_shards_and_global_metadata(local, metadata)


def _wrapper(full: torch.Tensor, rank: int) -> LocalShardsWrapper:
    rows = slice(2 * rank, 2 * rank + 2)
    return LocalShardsWrapper(
        [full[rows, :2].clone(), full[rows, 2:].clone()], [(2 * rank, 0), (2 * rank, 2)]
    )


def _state(fill: float | None = None) -> dict[str, Any]:
    """This rank's state dict (``fill``: the same layouts, every element ``fill``)."""
    rank = dist.get_rank()
    flat = init_device_mesh("cpu", (WORLD,))
    mesh = init_device_mesh("cpu", (2, 2))

    def full(key: str) -> torch.Tensor:
        value = FULLS[key]
        return value if fill is None else torch.full_like(value, fill)

    plain = full("plain")
    return {
        "model": {
            "fsdp": distribute_tensor(full("fsdp"), flat, [Shard(0)]),
            "uneven": distribute_tensor(full("uneven"), flat, [Shard(0)]),
            "nothing": distribute_tensor(full("nothing"), flat, [Shard(0)]),
            "hsdp": distribute_tensor(full("hsdp"), mesh, [Replicate(), Shard(0)]),
            "tp": distribute_tensor(full("tp"), mesh, [Shard(0), Shard(1)]),
            "chunked": _sharded(
                full("chunked"), sw.ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in range(WORLD)])
            ),
            "wrapper": _wrapper(full("wrapper"), rank),
            "plain": plain,
            "tied": plain if fill is None else plain.clone(),
        },
        "step": 7 if fill is None else 0,
        "rng": BLOB if fill is None else b"",
    }


def _held(value: Any) -> torch.Tensor:
    """The whole tensor a loaded value holds (collective for DTensors and ShardedTensors)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, sw.ShardedTensor):
        size = value.size()
        out = torch.zeros(size) if dist.get_rank() == 0 else None
        value.gather(0, out)
        gathered = out if out is not None else torch.zeros(size)
        dist.broadcast(gathered, 0)
        return gathered
    return value


def _check(state: dict[str, Any]) -> None:
    rank = dist.get_rank()
    model = state["model"]
    for key in ("fsdp", "uneven", "nothing", "hsdp", "tp", "chunked", "plain", "tied"):
        assert torch.equal(_held(model[key]), FULLS[key]), key
    for offsets, shard in zip(
        model["wrapper"].local_offsets(), model["wrapper"].local_shards(), strict=True
    ):
        row, col = (int(o) for o in offsets)
        part = FULLS["wrapper"][row : row + shard.size(0), col : col + shard.size(1)]
        assert torch.equal(shard, part), (rank, offsets)
    assert state["step"] == 7 and state["rng"] == BLOB


@distributed(world_size=WORLD, timeout=150)
def test_grids_wholes_chunks_and_blobs_round_trip(tmp_path: Path) -> None:
    rank = dist.get_rank()
    path = tmp_path / "c"
    returned = ckpt.save(_state(), path)
    document = json.loads((path / INDEX_NAME).read_bytes())
    assert document["format_version"] == 4
    # One file per rank, in rank order: grid file numbers are group ranks.
    assert [row[0].split(".")[0] for row in document["files"]] == [
        f"data/rank-{r:05d}" for r in range(WORLD)
    ]
    kinds = {row[0]: row[3][0] for row in document["tensors"]}
    assert kinds == {
        "model.fsdp": "grid",
        "model.uneven": "grid",
        "model.nothing": "grid",
        "model.hsdp": "grid",
        "model.tp": "grid",
        "model.chunked": "grid",
        "model.wrapper": "chunks",
        "model.plain": "whole",
    }
    assert document["aliases"] == [["model.tied", "model.plain"]]
    assert returned == ckpt.read_metadata(path)
    with CheckpointReader.open(path) as reader:
        # The empty shard past the end is no cell: three chunks of 2, 2 and 1 rows.
        chunks = reader.index.tensors["model.uneven"].chunks
        assert [(c.offsets, c.sizes) for c in chunks] == [
            ((0, 0), (2, 4)),
            ((2, 0), (2, 4)),
            ((4, 0), (1, 4)),
        ]
        assert len(reader.index.tensors["model.nothing"].chunks) == 1

    state = _state(fill=-1.0)
    ckpt.load(state, path)
    _check(state)
    for key, full in FULLS.items():
        assert torch.equal(ckpt.load_tensor(path, f"model.{key}"), full), key
    # Resharded: rows -> columns, 2-D -> 1-D, replicated -> sharded.
    flat = init_device_mesh("cpu", (WORLD,))
    mesh = init_device_mesh("cpu", (2, 2))
    other = {
        "model": {
            "fsdp": distribute_tensor(torch.zeros(10, 3), flat, [Shard(1)]),
            "uneven": distribute_tensor(torch.zeros(5, 4), mesh, [Shard(1), Shard(0)]),
            "hsdp": distribute_tensor(torch.zeros(6, 5), flat, [Shard(1)]),
            "tp": distribute_tensor(torch.zeros(7, 9), mesh, [Shard(1), Replicate()]),
            "chunked": distribute_tensor(torch.zeros(4, 10), flat, [Shard(0)]),
            "plain": distribute_tensor(torch.zeros(7), flat, [Shard(0)]),
        }
    }
    ckpt.load(other, path)
    for key, value in other["model"].items():
        assert torch.equal(value.full_tensor(), FULLS[key]), key
    if rank == 0:
        assert main(["verify", str(path)]) == 0
    dist.barrier()

    # A flipped bit in rank 2's file (a grid cell of "fsdp"): refused on every rank, no
    # Python value replaced.
    if rank == 0:
        with CheckpointReader.open(path) as reader:
            cell = reader.index.tensors["model.fsdp"].chunks[2]
        target = path / cell.file
        data = bytearray(target.read_bytes())
        data[cell.begin + 5] ^= 0x20
        target.write_bytes(bytes(data))
    dist.barrier()
    state = _state(fill=-1.0)
    with pytest.raises(CheckpointDataError) as caught:
        ckpt.load(state, path)
    assert isinstance(caught.value, ckpt.ChecksumError), caught.value
    assert state["step"] == 0 and state["rng"] == b""
    if rank == 0:
        assert main(["verify", str(path)]) == 1


@distributed(world_size=2, timeout=90)
def test_a_large_index_is_read_from_storage_by_the_other_ranks(tmp_path: Path) -> None:
    # The index is not sent with the outcome: rank 1's return value reads it when walked.
    flat = init_device_mesh("cpu", (2,))
    state = {"w": distribute_tensor(_full(5, 2), flat, [Shard(0)]), "b": torch.ones(3)}
    unsent = dataclasses.replace(tuning_module.TUNING, sent_index_bytes=1)
    with _patched(tuning_module, "TUNING", unsent):
        returned = ckpt.save(state, tmp_path / "c")
    assert returned == ckpt.read_metadata(tmp_path / "c")
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "w"), _full(5, 2))


@distributed(world_size=2, timeout=90)
def test_a_rank_with_nothing_to_write_writes_no_data_file(tmp_path: Path) -> None:
    # One row each: rank 1 holds empty shards past the end, so it writes no file and its
    # number in the index is null; so does the coordinator when it holds nothing.
    flat = init_device_mesh("cpu", (2,))
    state = {
        "x": distribute_tensor(_full(1, 3), flat, [Shard(0)]),
        "y": distribute_tensor(_full(1, 2, 9.0), flat, [Shard(0)]),
        "step": 5,
    }
    for name, coordinator in (("c", 0), ("d", 1)):
        path = tmp_path / name
        returned = ckpt.save(state, path, coordinator_rank=coordinator)
        document = json.loads((path / INDEX_NAME).read_bytes())
        assert document["format_version"] == 4 and document["files"][1] is None
        (first,) = sorted((path / "data").iterdir())
        assert document["files"][0][0] == f"data/{first.name}"
        assert first.name.startswith("rank-00000.")
        assert returned == ckpt.read_metadata(path)
        loaded = {
            "x": distribute_tensor(torch.zeros(1, 3), flat, [Shard(1)]),
            "y": distribute_tensor(torch.zeros(1, 2), flat, [Shard(0)]),
            "step": 0,
        }
        ckpt.load(loaded, path)
        assert torch.equal(loaded["x"].full_tensor(), _full(1, 3))
        assert torch.equal(loaded["y"].full_tensor(), _full(1, 2, 9.0))
        assert loaded["step"] == 5
        if dist.get_rank() == 1:
            assert main(["verify", str(path)]) == 0
        dist.barrier()
    # A second save to the same path, where rank 1 now holds rows: its file appears, rank
    # 0's old file is cleaned up.
    wide = {"x": distribute_tensor(_full(4, 3), flat, [Shard(0)])}
    ckpt.save(wide, tmp_path / "c")
    dist.barrier()  # the coordinator removes leftovers after every rank learned the outcome
    files = json.loads((tmp_path / "c" / INDEX_NAME).read_bytes())["files"]
    names = sorted(f"data/{p.name}" for p in (tmp_path / "c" / "data").iterdir())
    assert [row[0] for row in files] == names and len(names) == 2


# -- saved by 4 ranks, loaded by 2 ----------------------------------------------------------


def _stage_state() -> dict[str, Any]:
    """Pipeline-like: stage 0 (ranks 0, 1) and stage 1 (ranks 2, 3) hold different layers,
    each sharded over its stage's two ranks (grids starting at file 0 and at file 2)."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = rank // 2
    state: dict[str, Any] = {"epoch": 3, "rng": BLOB}
    for layer in range(2):
        full = _full(5, 3, 10.0 * layer + 100.0 * stage)
        state[f"stage{stage}.layer{layer}"] = distribute_tensor(full, mesh["dp"], [Shard(0)])
    return state


def _save_by_four(root: str) -> str:
    # The coordinator, rank 1, writes the blob after its grid cells.
    ckpt.save(_stage_state(), f"{root}/c", coordinator_rank=1)
    return str(json.loads(Path(f"{root}/c/{INDEX_NAME}").read_bytes())["format_version"])


def _load_by_two(root: str) -> None:
    flat = init_device_mesh("cpu", (2,))
    state: dict[str, Any] = {"epoch": 0, "rng": b""}
    for stage in range(2):
        for layer in range(2):
            state[f"stage{stage}.layer{layer}"] = distribute_tensor(
                torch.zeros(5, 3), flat, [Shard(1)]
            )
    ckpt.load(state, f"{root}/c")
    assert state["epoch"] == 3 and state["rng"] == BLOB
    for stage in range(2):
        for layer in range(2):
            expected = _full(5, 3, 10.0 * layer + 100.0 * stage)
            assert torch.equal(state[f"stage{stage}.layer{layer}"].full_tensor(), expected)


def test_four_ranks_save_two_ranks_load(tmp_path: Path) -> None:
    assert run_on_ranks(_save_by_four, 4, args=(str(tmp_path),), timeout=90) == ["4"] * 4
    with CheckpointReader.open(tmp_path / "c") as reader:
        grid = reader.index.tensors["stage1.layer0"].chunks
        assert sorted(chunk.file.split(".")[0] for chunk in grid) == [
            "data/rank-00002",
            "data/rank-00003",
        ]
        assert reader.index.objects["rng"].blob.file.startswith("data/rank-00001")
    run_on_ranks(_load_by_two, 2, args=(str(tmp_path),), timeout=90)
