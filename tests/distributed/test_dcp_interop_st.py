"""torch.distributed.checkpoint (DCP) saves and loads shardwise ShardedTensors (it does the I/O).

DCP recognizes the object protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), so a state dict of ShardedTensors saved in one layout loads into
other layouts and into plain tensors.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardwise as sw
from tests.harness import distributed

ROWS, COLS = 13, 10


def _full(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(ROWS * COLS).reshape(ROWS, COLS).to(dtype)


def _placements(order: list[int]) -> list[str]:
    return [f"rank:{r}/cpu" for r in order]


def _layouts() -> dict[str, sw.ShardingSpec]:
    grid = sw.EnumerableShardingSpec(
        [
            sw.ShardMetadata([0, 0], [6, 3], "rank:0/cpu"),
            sw.ShardMetadata([0, 3], [6, 7], "rank:1/cpu"),
            sw.ShardMetadata([6, 0], [7, 3], "rank:2/cpu"),
            sw.ShardMetadata([6, 3], [7, 7], "rank:3/cpu"),
        ]
    )
    return {
        "chunk_dim0": sw.ChunkShardingSpec(0, _placements([0, 1, 2, 3])),
        "chunk_dim1": sw.ChunkShardingSpec(1, _placements([2, 0, 3, 1])),
        "grid": grid,
        "multi_shard": sw.ChunkShardingSpec(0, _placements([0, 1, 2, 3, 3, 2, 1, 0])),
        "uneven_partial": sw.ChunkShardingSpec(1, _placements([1, 3])),
    }


def _assemble(st: sw.ShardedTensor) -> torch.Tensor:
    out = torch.zeros(ROWS, COLS, dtype=st.dtype) if dist.get_rank() == 0 else None
    st.gather(dst=0, out=out)
    full = out if out is not None else torch.zeros(ROWS, COLS, dtype=st.dtype)
    dist.broadcast(full, src=0)
    return full


@distributed(world_size=4, timeout=120)
@pytest.mark.parametrize("source", ["chunk_dim0", "chunk_dim1", "grid", "multi_shard"])
def test_dcp_saves_sharded_tensor_and_loads_every_layout(source, tmp_path):
    layouts = _layouts()
    path = str(tmp_path / source)
    st = sw.shard_tensor(_full(), layouts[source])
    dcp.save(
        {"w": st, "d": sw.shard_tensor(_full(torch.float64), layouts[source])}, checkpoint_id=path
    )

    for name, spec in layouts.items():
        target = sw.zeros(spec, ROWS, COLS)
        target64 = sw.zeros(spec, ROWS, COLS, dtype=torch.float64)
        dcp.load({"w": target, "d": target64}, checkpoint_id=path)
        assert torch.equal(_assemble(target), _full()), name
        assert torch.equal(_assemble(target64), _full(torch.float64)), name

    plain = {"w": torch.zeros(ROWS, COLS), "d": torch.zeros(ROWS, COLS, dtype=torch.float64)}
    dcp.load(plain, checkpoint_id=path)
    assert torch.equal(plain["w"], _full())
    assert torch.equal(plain["d"], _full(torch.float64))


@distributed(world_size=4)
def test_dcp_protocol_methods():
    st = sw.shard_tensor(_full(), _layouts()["multi_shard"])
    items = st.__create_write_items__("w", st)
    chunks = st.__create_chunk_list__()
    assert [list(i.index.offset) for i in items] == [list(c.offsets) for c in chunks]
    assert all(i.tensor_data.size == torch.Size([ROWS, COLS]) for i in items)
    from torch.distributed.checkpoint.metadata import MetadataIndex

    for shard in st.local_shards():
        index = MetadataIndex("w", shard.metadata.shard_offsets)
        assert st.__get_tensor_shard__(index) is shard.tensor
    message = "Could not find shard at 'torch.Size([99, 0])' for FQN: 'w'"
    with pytest.raises(ValueError, match=re.escape(message)):
        st.__get_tensor_shard__(MetadataIndex("w", [99, 0]))
