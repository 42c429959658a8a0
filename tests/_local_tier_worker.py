"""The local tier's torchrun worker (``tests/distributed/test_multinode.py``).

``train``: steps 1 to 6 of a sharded state that is a function of the step, the durable tier
every 4 steps, the local tier every 2 (its directory ``<base>/node<GROUP_RANK>``, its job id
torchrun's ``--rdzv-id``); once step 6 is held, every worker kills itself (SIGKILL: no
cleanup, no close), as a job dies when a node does. ``restore``: a restart of the same job restores
and reports the step, where it came from, and whether every value is step 6's.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardwise as sw
import shardwise.checkpoint as ckpt

SHAPE = (16, 6)


def _full(step: int) -> torch.Tensor:
    return torch.arange(16 * 6, dtype=torch.float32).reshape(SHAPE) * 0.5 + 1000 * step


def _state(step: int) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(world)])
    metadata = spec.build_metadata(torch.Size(SHAPE), sw.TensorProperties(dtype=torch.float32))
    full = _full(step)
    local = [
        sw.Shard(full[md.shard_offsets[0] : md.shard_offsets[0] + md.shard_sizes[0]].clone(), md)
        for md in metadata.shards_metadata
        if md.placement is not None and md.placement.rank() == rank
    ]
    sharded = sw.init_from_local_shards_and_global_metadata(local, metadata)
    return {"model": {"w": sharded, "bias": torch.full((3,), float(step))}, "step": step}


def _equals(state: dict[str, Any], step: int) -> bool:
    full = _full(step)
    for shard in state["model"]["w"].local_shards():
        first, count = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        if not torch.equal(shard.tensor, full[first : first + count]):
            return False
    return bool(torch.equal(state["model"]["bias"], torch.full((3,), float(step))))


def _manager(base: Path) -> ckpt.CheckpointManager:
    node = int(os.environ["GROUP_RANK"])
    tier = ckpt.LocalTier(every_steps=2, directory=base / f"node{node}")  # job id: --rdzv-id
    return ckpt.CheckpointManager(
        base / "run", save_policy=ckpt.SavePolicy(every_steps=4), local_tier=tier
    )


def _report(reports: Path, mode: str, report: dict[str, Any]) -> None:
    final = reports / f"{mode}-rank{report['rank']}.json"
    temporary = final.with_suffix(".tmp")
    temporary.write_text(json.dumps(report))
    temporary.rename(final)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["train", "restore"])
    parser.add_argument("path", type=Path)
    parser.add_argument("reports", type=Path)
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    (args.reports / f"pid-{os.getpid()}").touch()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["GROUP_RANK"])
    report: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "node": node,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "launcher": os.getppid(),
        "job": os.environ.get("TORCHELASTIC_RUN_ID"),
    }
    if args.mode == "train":
        manager = _manager(args.path)
        for step in range(1, 7):
            manager.save(step, _state(step))
        manager.wait()  # step 6 is held on both nodes
        dist.barrier()
        _report(args.reports, args.mode, report)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no cleanup
    manager = _manager(args.path)
    state = _state(0)
    step = manager.restore(None, state)
    report.update(step=step, source=manager.restored_from, equal=_equals(state, 6))
    manager.close()
    dist.destroy_process_group()
    _report(args.reports, args.mode, report)


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # see tests/_multinode_worker.py's _exit: skip the interpreter's teardown
