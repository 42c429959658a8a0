"""``torch.distributed.checkpoint`` saves and loads DTensors whose local tensor is a
:class:`LocalShardsWrapper`, through the wrapper's checkpoint protocol (SPEC "DCP
interoperability"): DCP does all the I/O, the wrapper tells it which global rows each rank
holds, so uneven and several-per-rank shards reshard on load.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from shardwise.local_shards import LocalShardsWrapper
from tests.harness import distributed

#: (offset, length) of the rows each rank holds, indexed by rank.
SAVE_ROWS = [(0, 4), (4, 3), (7, 4), (11, 5)]
LOAD_ROWS = [(0, 6), (6, 2), (8, 1), (9, 7)]


def _row_dtensor(rows: tuple[int, int], values: torch.Tensor) -> DTensor:
    """A 16x1 DTensor whose local tensor wraps this rank's rows (``values``)."""
    offset, _ = rows
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    wrapper = LocalShardsWrapper([values], [(offset, 0)])
    return DTensor.from_local(
        wrapper, mesh, [Shard(0)], shape=torch.Size([16, 1]), stride=(1, 1), run_check=False
    )


@distributed(world_size=4)
def test_uneven_rows_reshard_on_load(tmp_path: Path) -> None:
    rank = dist.get_rank()
    path = str(tmp_path / "dcp")  # the same directory on every rank
    offset, length = SAVE_ROWS[rank]
    saved = _row_dtensor(SAVE_ROWS[rank], torch.arange(offset, offset + length).view(-1, 1).float())
    dcp.save({"t": saved}, storage_writer=dcp.FileSystemWriter(path))

    offset, length = LOAD_ROWS[rank]
    target = torch.full((length, 1), -1.0)
    loaded = _row_dtensor(LOAD_ROWS[rank], target)
    dcp.load({"t": loaded}, storage_reader=dcp.FileSystemReader(path))

    expected = torch.arange(offset, offset + length, dtype=torch.float32).view(-1, 1)
    assert torch.equal(target, expected)  # filled in place, through the wrapper's shard
    assert torch.equal(loaded.to_local().local_shards()[0], expected)

    # The checkpoint describes the saved rows, chunk by chunk, under the global size.
    metadata = dcp.FileSystemReader(path).read_metadata()
    entry = metadata.state_dict_metadata["t"]
    assert entry.size == torch.Size([16, 1])
    assert entry.properties.dtype == torch.float32
    saved_chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
    assert saved_chunks == [((o, 0), (n, 1)) for o, n in SAVE_ROWS]


@distributed(world_size=4)
def test_several_shards_per_rank_and_integer_dtype(tmp_path: Path) -> None:
    # Rank r saves rows {r, r+4, r+8, r+12} of a 16x3 int64 matrix as four 1-row shards
    # (offsets far apart: round-robin), and loads them back as one block of 4 rows.
    rank = dist.get_rank()
    world = dist.get_world_size()
    path = str(tmp_path / "dcp")  # the same directory on every rank
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(48, dtype=torch.int64).view(16, 3)
    rows = [rank + world * i for i in range(4)]
    # Column blocks are what several 2-D shards mean to the wrapper's size; the offsets are
    # what DCP uses, so the wrapper's logical size does not matter here.
    wrapper = LocalShardsWrapper([full[r : r + 1].clone() for r in rows], [(r, 0) for r in rows])
    saved = DTensor.from_local(
        wrapper, mesh, [Shard(0)], shape=torch.Size([16, 3]), stride=(3, 1), run_check=False
    )
    dcp.save({"m": saved, "step": 7}, storage_writer=dcp.FileSystemWriter(path))

    block = torch.zeros(4, 3, dtype=torch.int64)
    target = LocalShardsWrapper([block], [(4 * rank, 0)])
    loaded = DTensor.from_local(
        target, mesh, [Shard(0)], shape=torch.Size([16, 3]), stride=(3, 1), run_check=False
    )
    state = {"m": loaded, "step": 0}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    assert torch.equal(block, full[4 * rank : 4 * rank + 4])
    assert state["step"] == 7

    entry = dcp.FileSystemReader(path).read_metadata().state_dict_metadata["m"]
    assert entry.properties.dtype == torch.int64  # the shards' dtype, not the wrapper's
    assert len(entry.chunks) == 16


@distributed(world_size=4)
def test_rank_without_shards_saves_nothing(tmp_path: Path) -> None:
    # Rank 3 holds no rows at save time (an empty wrapper); every rank holds rows at load time.
    rank = dist.get_rank()
    path = str(tmp_path / "dcp")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = [(0, 6), (6, 5), (11, 5), None][rank]
    if rows is None:
        wrapper = LocalShardsWrapper([], [])
    else:
        offset, length = rows
        values = torch.arange(offset, offset + length, dtype=torch.float32).view(-1, 1)
        wrapper = LocalShardsWrapper([values], [(offset, 0)])
    saved = DTensor.from_local(
        wrapper, mesh, [Shard(0)], shape=torch.Size([16, 1]), stride=(1, 1), run_check=False
    )
    dcp.save({"t": saved}, storage_writer=dcp.FileSystemWriter(path))

    offset, length = LOAD_ROWS[rank]
    target = torch.zeros(length, 1)
    dcp.load(
        {"t": _row_dtensor(LOAD_ROWS[rank], target)}, storage_reader=dcp.FileSystemReader(path)
    )
    assert torch.equal(
        target, torch.arange(offset, offset + length, dtype=torch.float32).view(-1, 1)
    )
    entry = dcp.FileSystemReader(path).read_metadata().state_dict_metadata["t"]
    assert len(entry.chunks) == 3
