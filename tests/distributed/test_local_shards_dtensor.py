"""A :class:`LocalShardsWrapper` as the local tensor of a DTensor on a 4-rank CPU mesh:
construction, the checkpoint protocol reached through the DTensor, and gathering the full
tensor (which goes through the wrapper's all-gather)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as DCPChunk
from torch.distributed.checkpoint.metadata import MetadataIndex as DCPIndex
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwise.local_shards import LocalShardsWrapper
from tests.harness import distributed

#: (offset, length) of the rows of a 16x1 tensor that each rank holds.
ROWS = [(0, 4), (4, 3), (7, 4), (11, 5)]


def _mesh() -> object:
    return init_device_mesh("cpu", (dist.get_world_size(),))


@distributed(world_size=4)
def test_from_local_keeps_the_wrapper_and_the_global_shape() -> None:
    rank = dist.get_rank()
    offset, length = ROWS[rank]
    shard = torch.arange(offset, offset + length, dtype=torch.float32).view(-1, 1)
    wrapper = LocalShardsWrapper([shard], [(offset, 0)])
    dt = DTensor.from_local(
        wrapper, _mesh(), [Shard(0)], shape=torch.Size([16, 1]), stride=(1, 1), run_check=False
    )
    assert dt.shape == torch.Size([16, 1])
    assert dt.placements == (Shard(0),)
    assert dt.device.type == "cpu"
    local = dt.to_local()
    assert isinstance(local, LocalShardsWrapper)
    assert local.local_offsets() == [torch.Size([offset, 0])]
    assert torch.equal(local.local_shards()[0], shard)
    # The view DTensor takes of its input shares the shard's memory.
    assert local.local_shards()[0].data_ptr() == shard.data_ptr()


@distributed(world_size=4)
def test_checkpoint_protocol_through_the_dtensor() -> None:
    rank = dist.get_rank()
    offset, length = ROWS[rank]
    shard = torch.full((length, 1), float(rank))
    dt = DTensor.from_local(
        LocalShardsWrapper([shard], [(offset, 0)]),
        _mesh(),
        [Shard(0)],
        shape=torch.Size([16, 1]),
        stride=(1, 1),
        run_check=False,
    )
    chunks = dt.__create_chunk_list__()
    assert chunks == [DCPChunk(offsets=torch.Size([offset, 0]), sizes=torch.Size([length, 1]))]

    (item,) = dt.__create_write_items__("w", dt)
    assert item.index == DCPIndex("w", [offset, 0])
    assert item.type == WriteItemType.SHARD
    assert item.tensor_data is not None
    assert item.tensor_data.size == torch.Size([16, 1])  # the DTensor's global size
    assert item.tensor_data.chunk == chunks[0]

    found = dt.__get_tensor_shard__(DCPIndex("w", [offset, 0]))
    assert torch.equal(found, shard)
    with pytest.raises(
        ValueError, match=r"Could not find shard at 'torch\.Size\(\[99, 0\]\)' for FQN: 'w'"
    ):
        dt.__get_tensor_shard__(DCPIndex("w", [99, 0]))


@distributed(world_size=4)
def test_full_tensor_of_row_blocks() -> None:
    # 1-D: rank r holds elements [4r, 4r+2) and [4r+2, 4r+4) as two shards.
    rank = dist.get_rank()
    full = torch.arange(16, dtype=torch.float32)
    shards = [full[4 * rank : 4 * rank + 2].clone(), full[4 * rank + 2 : 4 * rank + 4].clone()]
    wrapper = LocalShardsWrapper(shards, [(4 * rank,), (4 * rank + 2,)])
    assert wrapper.shape == torch.Size([4])
    dt = DTensor.from_local(
        wrapper, _mesh(), [Shard(0)], shape=torch.Size([16]), stride=(1,), run_check=False
    )
    assert torch.equal(dt.full_tensor(), full)


@distributed(world_size=4)
def test_full_tensor_of_column_blocks() -> None:
    # 2-D: rank r holds columns [4r, 4r+1) and [4r+1, 4r+4) of a 3x16 matrix as two shards.
    rank = dist.get_rank()
    full = torch.arange(48, dtype=torch.float32).view(3, 16)
    shards = [full[:, 4 * rank : 4 * rank + 1].clone(), full[:, 4 * rank + 1 : 4 * rank + 4]]
    wrapper = LocalShardsWrapper([s.clone() for s in shards], [(0, 4 * rank), (0, 4 * rank + 1)])
    assert wrapper.shape == torch.Size([3, 4])
    dt = DTensor.from_local(
        wrapper, _mesh(), [Shard(1)], shape=torch.Size([3, 16]), stride=(16, 1), run_check=False
    )
    assert torch.equal(dt.full_tensor(), full)
    replicated = dt.redistribute(placements=[Replicate()])
    assert torch.equal(replicated.to_local(), full)


@distributed(world_size=4)
def test_rank_without_shards() -> None:
    # Rank 3 holds nothing: an empty wrapper is a valid (meta) local tensor.
    rank = dist.get_rank()
    rows = [(0, 6), (6, 5), (11, 5), None][rank]
    if rows is None:
        wrapper = LocalShardsWrapper([], [])
    else:
        wrapper = LocalShardsWrapper([torch.ones(rows[1], 2)], [(rows[0], 0)])
    dt = DTensor.from_local(
        wrapper, _mesh(), [Shard(0)], shape=torch.Size([16, 2]), stride=(2, 1), run_check=False
    )
    local = dt.to_local()
    assert isinstance(local, LocalShardsWrapper)
    assert local.is_empty_shard() == (rows is None)
    items = dt.__create_write_items__("e", dt)
    assert len(items) == (0 if rows is None else 1)
    if rows is None:
        assert dt.__get_tensor_shard__(DCPIndex("e", [0, 0])).numel() == 0
