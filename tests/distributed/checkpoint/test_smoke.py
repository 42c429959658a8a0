"""End-to-end checkpoint round trips across layouts and world sizes (real gloo ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardwise as sw
import shardwise.checkpoint as ckpt
from tests.harness import distributed


def _full() -> torch.Tensor:
    return torch.arange(13 * 6, dtype=torch.float32).reshape(13, 6)


@distributed(world_size=4)
def test_sharded_rows_saved_loaded_as_columns_dtensor_and_plain(tmp_path):
    rank = dist.get_rank()
    rows = sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(4)])
    cols = sw.ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in (3, 1, 0, 2)])
    st = sw.shard_tensor(_full(), rows)
    ckpt.save({"w": st, "plain": torch.ones(3) * 5, "step": 3}, tmp_path / "c")

    target = sw.zeros(cols, 13, 6)
    mesh = init_device_mesh("cpu", (4,))
    dt = distribute_tensor(torch.zeros(13, 6), mesh, [Shard(1)])
    state = {"w": target, "plain": torch.zeros(3), "step": 0}
    ckpt.load(state, tmp_path / "c")
    out = torch.zeros(13, 6) if rank == 0 else None
    target.gather(dst=0, out=out)
    if rank == 0:
        assert torch.equal(out, _full())
    assert torch.equal(state["plain"], torch.ones(3) * 5)
    assert state["step"] == 3

    dstate = {"w": dt}
    # A subset loads; the checkpoint's other keys are reported (and warned about with
    # strict=False), never an error.
    result = ckpt.load(dstate, tmp_path / "c")
    assert result.missing_keys == [] and sorted(result.unexpected_keys) == ["plain", "step"]
    assert torch.equal(dt.full_tensor(), _full())
    rep = DTensor.from_local(torch.zeros(13, 6), mesh, [Replicate()], run_check=False)
    ckpt.load({"w": rep}, tmp_path / "c")
    assert torch.equal(rep.to_local(), _full())
