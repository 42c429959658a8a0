"""``CheckpointManager`` on 2 real gloo ranks given what no rank should be: a step that only
one rank finds invalid, ranks that disagree on the step, a link named like a step. Every rank
raises the same kind of error at the same call (none waits alone in a collective), and nothing
is committed or read through the link."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise.checkpoint as ckpt
from tests.harness import distributed

WORLD = 2


def _shared_dir(tmp_path: Path) -> Path:
    """``tmp_path`` of rank 0 (each rank's pytest fixture would be another directory)."""
    path = [str(tmp_path)]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


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
        assert torch.equal(state["w"], torch.full((4,), float(rank)))
    assert sorted(entry.name for entry in root.iterdir()) == ["step-00000004", "step-00000005"]
