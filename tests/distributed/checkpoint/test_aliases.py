"""Tied tensors across ranks: written once only when every rank holding elements of them
sees one tensor; loaded back into any layout."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.loading.reader import CheckpointReader
from tests.harness import distributed


def _full() -> torch.Tensor:
    return torch.arange(3 * 5, dtype=torch.float32).reshape(3, 5)


@distributed(world_size=4)
def test_tied_dtensor_with_an_empty_shard_is_written_once(tmp_path):
    mesh = init_device_mesh("cpu", (4,))
    weight = distribute_tensor(_full(), mesh, [Shard(0)])  # rank 3 holds no row
    state = {"embed.weight": weight.detach(), "head.weight": weight.detach(), "step": 2}
    ckpt.save(state, tmp_path / "c")
    with CheckpointReader.open(tmp_path / "c") as reader:
        assert reader.index.aliases == {"head.weight": "embed.weight"}

    other = init_device_mesh("cpu", (2, 2))
    fresh = {
        "embed.weight": distribute_tensor(torch.zeros(3, 5), other, [Shard(1), Shard(0)]),
        "head.weight": distribute_tensor(torch.zeros(3, 5), mesh, [Shard(1)]),
        "step": 0,
    }
    ckpt.load(fresh, tmp_path / "c")
    assert torch.equal(fresh["embed.weight"].full_tensor(), _full())
    assert torch.equal(fresh["head.weight"].full_tensor(), _full())


@distributed(world_size=2)
def test_one_rank_seeing_two_tensors_keeps_them_apart(tmp_path):
    mesh = init_device_mesh("cpu", (2,))
    weight = distribute_tensor(_full(), mesh, [Shard(0)])
    # Rank 1's "head" is its own copy (same values): the ranks disagree, nothing is tied.
    head = weight.detach() if dist.get_rank() == 0 else weight.detach().clone()
    ckpt.save({"embed.weight": weight.detach(), "head.weight": head}, tmp_path / "c")
    with CheckpointReader.open(tmp_path / "c") as reader:
        assert reader.index.aliases == {}
        assert len(reader.index.tensors) == 2
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "head.weight"), _full())
