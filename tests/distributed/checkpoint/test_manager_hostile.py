"""``CheckpointManager`` on 2 real gloo ranks given what no rank should be: a step that only
one rank finds invalid, ranks that disagree on the step, a link named like a step, a storage
failure that only one rank sees while restoring. Every rank raises the same kind of error at
the same call (none waits alone in a collective); nothing is committed, rejected or read
through the link."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.storage import LocalStorage
from tests.distributed.checkpoint.test_manager import _shared_dir
from tests.harness import distributed

WORLD = 2


@distributed(world_size=WORLD, timeout=60)
def test_the_ranks_agree_on_the_step_before_saving(tmp_path: Path) -> None:
    root = _shared_dir(tmp_path) / "run"
    rank = dist.get_rank()
    state = {"w": torch.full((4,), float(rank))}
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        # Rank 1 alone passes a bad step: both raise at once, rank 0 does not wait for it.
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            manager.save(-1 if rank == 1 else 1, state)
        with pytest.raises(ckpt.CheckpointError, match="different steps"):
            manager.save(2 + rank, state)
        assert manager.steps() == []
        assert manager.save(4, state)  # the manager is still usable, on every rank
        assert manager.steps() == [4]
        # A link named like a step, to a checkpoint outside the root: refused on every rank.
        ckpt.save({"w": torch.full((4,), 42.0)}, root.parent / "outside")
        if rank == 0:
            (root / "step-00000005").symlink_to(root.parent / "outside")
        dist.barrier()
        with pytest.raises(ckpt.CheckpointNotFoundError, match="not a real directory"):
            manager.restore(state, step=5)
        # restore's step, like save's: checked and compared on every rank before any load.
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            manager.restore(state, step=True if rank == 1 else 4)
        with pytest.raises(ckpt.CheckpointError, match="different steps"):
            manager.restore(state, step=4 if rank == 1 else None)
        assert torch.equal(state["w"], torch.full((4,), float(rank)))
    assert sorted(entry.name for entry in root.iterdir()) == ["step-00000004", "step-00000005"]


@distributed(world_size=WORLD, timeout=60)
def test_a_storage_failure_on_one_rank_while_restoring_is_raised_on_every_rank(
    tmp_path: Path,
) -> None:
    root = _shared_dir(tmp_path) / "run"
    rank = dist.get_rank()
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        for step in (1, 2):
            manager.save(step, {"w": torch.full((4,), float(step))})
    opened = LocalStorage.open_reader

    def refused(self: LocalStorage, path: str) -> Any:
        if f"step-00000002{os.sep}data" in path:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return opened(self, path)

    if rank == 1:  # only rank 1 knows the cause: rank 0 gets a copy of its error
        LocalStorage.open_reader = refused  # type: ignore[method-assign]
    try:
        state = {"w": torch.zeros(4)}
        manager = ckpt.CheckpointManager(root, async_save=False)
        with pytest.raises(ckpt.CheckpointDataError, match="Permission denied"):
            manager.restore(state)  # no fallback on either rank, nothing rejected
    finally:
        LocalStorage.open_reader = opened  # type: ignore[method-assign]
    assert manager.steps() == [1, 2]
    assert manager.restore(state) == 2 and torch.equal(state["w"], torch.full((4,), 2.0))
    manager.close()
