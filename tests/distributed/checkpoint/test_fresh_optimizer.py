"""An optimizer passed itself (Stateful) that has not stepped yet resumes with its saved state,
allocated like its parameters: under FSDP2 the state is sharded as the parameters are (a
DTensor), so the next step runs; before, it was a whole plain tensor on every rank and the first
step failed ("got mixed torch.Tensor and DTensor")."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import shardwise.checkpoint as ckpt
from tests.harness import distributed

WORLD = 2


def _model_and_optimizer(mesh: object, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))  # 5 rows: uneven
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@distributed(world_size=WORLD, timeout=60)
def test_a_fresh_fsdp_optimizer_resumes_with_state_sharded_like_its_parameters(
    tmp_path: Path,
) -> None:
    mesh = init_device_mesh("cpu", (WORLD,))
    model, optimizer = _model_and_optimizer(mesh, seed=0)
    for step in range(2):
        _step(model, optimizer, seed=step)
    path = tmp_path / "c"
    ckpt.save({"model": model, "optim": optimizer}, path)

    fresh_model, fresh_optimizer = _model_and_optimizer(mesh, seed=1)
    assert not fresh_optimizer.state_dict()["state"]
    ckpt.load({"model": fresh_model, "optim": fresh_optimizer}, path)

    saved = optimizer.state_dict()["state"]
    loaded = fresh_optimizer.state_dict()["state"]
    params = list(fresh_model.parameters())
    assert sorted(loaded) == sorted(saved) == list(range(len(params)))
    for number, param in enumerate(params):
        for name in ("exp_avg", "exp_avg_sq"):
            state = loaded[number][name]
            assert isinstance(state, DTensor) and state.placements == param.placements
            assert state.to_local().shape == param.to_local().shape
            assert torch.equal(state.to_local(), saved[number][name].to_local())
        assert torch.equal(torch.as_tensor(loaded[number]["step"]), saved[number]["step"])

    # Both go on as one run: the same step gives the same parameters, bit for bit.
    _step(model, optimizer, seed=7)
    _step(fresh_model, fresh_optimizer, seed=7)
    for mine, theirs in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(mine.to_local(), theirs.to_local())
    dist.barrier()
