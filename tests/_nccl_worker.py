"""Checkpoints over an NCCL group of one, CUDA tensors throughout (``tests/distributed/
checkpoint/test_nccl.py``; needs a GPU). One GPU holds one NCCL rank, so the group is of one:
what it proves is that every collective of a save, a load, an async save and the manager's two
tiers runs on an NCCL group (its object exchanges on the GPU, the tier's own gloo group made
beside it), not how ranks share the bytes (the gloo tests do that).

``python tests/_nccl_worker.py DIR`` prints one line per check that passed, then ``ok``.
"""

from __future__ import annotations

import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shardwise.checkpoint as ckpt

ROWS, COLS = 64, 48


def _state(step: int, mesh: Any) -> dict[str, Any]:
    full = torch.arange(ROWS * COLS, dtype=torch.float32, device="cuda").reshape(ROWS, COLS)
    return {
        "model": {
            "w": distribute_tensor(full + step, mesh, [Shard(0)]),
            "bias": torch.full((COLS,), float(step), device="cuda", dtype=torch.bfloat16),
        },
        "step": step,
    }


def _blank(mesh: Any) -> dict[str, Any]:
    return {
        "model": {
            "w": distribute_tensor(torch.zeros(ROWS, COLS, device="cuda"), mesh, [Shard(0)]),
            "bias": torch.zeros(COLS, device="cuda", dtype=torch.bfloat16),
        },
        "step": 0,
    }


def _check(state: dict[str, Any], step: int, mesh: Any, what: str) -> None:
    want = _state(step, mesh)
    got_w, want_w = state["model"]["w"], want["model"]["w"]
    assert isinstance(got_w, DTensor) and got_w.device.type == "cuda", what
    assert torch.equal(got_w.to_local(), want_w.to_local()), what
    assert state["model"]["bias"].device.type == "cuda", what
    assert torch.equal(state["model"]["bias"], want["model"]["bias"]), what
    assert state["step"] == step, what
    print(what, flush=True)


def main(base: Path) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{base / 'store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=120),
        device_id=torch.device("cuda", 0),
    )
    try:
        mesh = init_device_mesh("cuda", (1,))
        ckpt.save(_state(1, mesh), base / "save")
        loaded = _blank(mesh)
        ckpt.load(loaded, base / "save")
        _check(loaded, 1, mesh, "save and load")

        state = _state(2, mesh)
        future = ckpt.async_save(state, base / "async")
        state["model"]["w"].to_local().add_(1)  # after the call: must not reach the save
        future.result(timeout=120)
        loaded = _blank(mesh)
        ckpt.load(loaded, base / "async")
        _check(loaded, 2, mesh, "async_save")

        tier = ckpt.LocalTier(
            every_steps=2, replicas=0, job_id="nccl", directory=base / "shm", min_free_bytes=0
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", ckpt.LocalTierWarning)  # nothing skipped
            with ckpt.CheckpointManager(
                base / "run", save_policy=ckpt.SavePolicy(every_steps=3), local_tier=tier
            ) as manager:
                for step in range(1, 5):
                    state = _state(step, mesh)
                    manager.save(step, state)
                    state["model"]["w"].to_local().zero_()  # an optimizer step, in place
            loaded = _blank(mesh)
            manager = ckpt.CheckpointManager(base / "run", local_tier=tier)
            assert manager.restore(None, loaded) == 4
            assert manager.restored_from == "local"
            manager.close()
        _check(loaded, 4, mesh, "local tier")

        loaded = _blank(mesh)
        manager = ckpt.CheckpointManager(base / "run")
        assert manager.restore(None, loaded) == 3
        assert manager.restored_from == "durable"
        manager.close()
        _check(loaded, 3, mesh, "durable tier")
    finally:
        dist.destroy_process_group()
    print("ok", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
