"""A training run with a ``CheckpointManager`` that a test kills: one rank of
``tests/distributed/checkpoint/test_manager_kill.py``.

Run as ``python -m tests._manager_worker ROOT LAST_STEP [--kill-at POINT]`` from the
repository root, with ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the
environment (a gloo group through ``env://``). It restores the latest checkpoint of ROOT (and
checks that every value is that step's), then "trains" up to LAST_STEP, saving every step and
keeping the last two.

``--incremental`` saves incrementally (``CheckpointManager(incremental=True)``), with a frozen
sharded tensor that never changes: later checkpoints reference its bytes in the first one.

``--kill-at delete`` makes rank 0 SIGKILL itself right after a retention deletion removed a
checkpoint's index; ``--kill-at save:N`` right after it renamed its data file of step N into
place (before the index is written). The kill is real; only its moment is chosen by a hook on
the local storage. Protocol on stdout, one line each: ``restored N`` (or ``restored none``),
then ``saved N`` per save.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: A backstop only: the test kills every rank once rank 0 has killed itself.
GROUP_TIMEOUT = timedelta(seconds=60)


def full(step: int) -> torch.Tensor:
    """The whole row-sharded tensor at ``step``."""
    return torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + 1000 * step


def _state(step: int, world_size: int, incremental: bool = False) -> dict[str, Any]:
    import shardwise as sw

    rows = sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(world_size)])
    state = {
        "weight": sw.shard_tensor(full(step), rows),
        "bias": torch.full((4,), step),
        "step": step,
    }
    if incremental:
        state["frozen"] = sw.shard_tensor(-full(0), rows)
    return state


def _check(state: dict[str, Any], step: int) -> None:
    for shard in state["weight"].local_shards():
        first, count = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        assert torch.equal(shard.tensor, full(step)[first : first + count]), "weight differs"
    for shard in state["frozen"].local_shards() if "frozen" in state else ():
        first, count = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        assert torch.equal(shard.tensor, -full(0)[first : first + count]), "frozen differs"
    assert torch.equal(state["bias"], torch.full((4,), step)), "bias differs"
    assert state["step"] == step


def _die_at(point: str) -> None:
    """Hook the local storage so that this process SIGKILLs itself at ``point``."""
    from shardwise.checkpoint.storage import LocalStorage

    if point == "delete":
        remove = LocalStorage.remove

        def remove_then_die(self: LocalStorage, path: str) -> None:
            remove(self, path)
            if os.path.basename(path) == "shardwise.json":  # only a deletion removes an index
                os.kill(os.getpid(), signal.SIGKILL)

        LocalStorage.remove = remove_then_die  # type: ignore[method-assign]
        return
    step = int(point.removeprefix("save:"))
    rename = LocalStorage.rename

    def rename_then_die(self: LocalStorage, source: str, target: str) -> None:
        rename(self, source, target)
        if f"step-{step:08d}{os.sep}data{os.sep}" in target:
            os.kill(os.getpid(), signal.SIGKILL)

    LocalStorage.rename = rename_then_die  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("last_step", type=int)
    parser.add_argument("--kill-at", default=None)
    parser.add_argument("--incremental", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=GROUP_TIMEOUT)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    import shardwise.checkpoint as ckpt

    if args.kill_at is not None and rank == 0:
        _die_at(args.kill_at)
    manager = ckpt.CheckpointManager(
        args.root,
        retention=ckpt.RetentionPolicy(keep_last=2),
        async_save=False,
        incremental=args.incremental,
    )
    state = _state(0, world_size, args.incremental)
    if args.incremental:  # filled by the restore, or by nothing
        for shard in state["frozen"].local_shards():
            shard.tensor.zero_()
    start = manager.restore(state)
    if start is not None:
        _check(state, start)
    print(f"restored {start if start is not None else 'none'}", flush=True)
    for step in range((start or 0) + 1, args.last_step + 1):
        if manager.save(step, _state(step, world_size, args.incremental)):
            print(f"saved {step}", flush=True)
    manager.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
