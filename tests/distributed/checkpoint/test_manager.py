"""``CheckpointManager`` on 2 real gloo ranks: every rank follows rank 0's save decision and
listing, a preemption signal that reached one rank (or all) saves on all, a corrupt latest
checkpoint is skipped on every rank, a background save that fails raises on every rank at the
next call, and a series on S3 (moto's server) with retention and ``shardwise ls``."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.cli import main
from tests._s3 import S3Bucket, s3_bucket, s3_server  # noqa: F401 (fixtures)
from tests.harness import distributed, run_on_ranks

WORLD = 2
ROWS = sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(WORLD)])


def _full(step: int) -> torch.Tensor:
    return torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6) + 1000 * step


def _state(step: int) -> dict[str, Any]:
    """This rank's state at ``step`` (collective: scatters a row-sharded tensor)."""
    return {
        "model": {"sharded": sw.shard_tensor(_full(step), ROWS), "bias": torch.full((3,), step)},
        "step": step,
    }


def _check(state: dict[str, Any], step: int) -> None:
    for shard in state["model"]["sharded"].local_shards():
        first, count = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        assert torch.equal(shard.tensor, _full(step)[first : first + count])
    assert torch.equal(state["model"]["bias"], torch.full((3,), step))
    assert state["step"] == step


def _shared_dir(tmp_path: Path) -> Path:
    """``tmp_path`` of rank 0 (each rank's pytest fixture would be another directory)."""
    path = [str(tmp_path)]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


@distributed(world_size=WORLD, timeout=60)
def test_series_on_two_ranks(tmp_path: Path) -> None:
    root = _shared_dir(tmp_path) / "run"
    retention = ckpt.RetentionPolicy(keep_last=2)
    policy = ckpt.SavePolicy(every_steps=2)
    with ckpt.CheckpointManager(root, save_policy=policy, retention=retention) as manager:
        assert manager.restore(_state(0)) is None
        saved = [step for step in range(1, 8) if manager.save(step, _state(step))]
    assert saved == [2, 4, 6]
    manager = ckpt.CheckpointManager(root)
    assert manager.steps() == [4, 6]
    state = _state(0)
    assert manager.restore(state) == 6
    _check(state, 6)
    # A rank-dependent should_save: rank 0's verdict is every rank's.
    rank = dist.get_rank()
    for saver, expected in ((0, True), (1, False)):
        follows = ckpt.CheckpointManager(
            root, save_policy=ckpt.SavePolicy(should_save=lambda step, r=saver: rank == r)
        )
        assert follows.save(10 + saver, _state(10 + saver)) is expected
        follows.close()
    assert manager.latest_step() == 10
    manager.close()


@distributed(world_size=WORLD, timeout=60)
@pytest.mark.parametrize("signalled", ["rank 1", "every rank"])
def test_a_preemption_signal_saves_on_every_rank(tmp_path: Path, signalled: str) -> None:
    root = _shared_dir(tmp_path) / "run"
    manager = ckpt.CheckpointManager(
        root, save_policy=ckpt.SavePolicy(every_steps=1000), preemption_signals=[signal.SIGTERM]
    )
    try:
        assert not manager.save(1, _state(1))
        if signalled == "every rank" or dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only raises a flag
        assert manager.save(2, _state(2))
        assert manager.preempted
        assert manager.steps() == [2]  # finished before save returned, on every rank
        assert not manager.save(3, _state(3))
    finally:
        manager.close()
    assert signal.getsignal(signal.SIGTERM) is not manager._notice._handle
    state = _state(0)
    assert ckpt.CheckpointManager(root).restore(state) == 2
    _check(state, 2)


@distributed(world_size=WORLD, timeout=60)
def test_a_corrupt_latest_is_skipped_on_every_rank(tmp_path: Path) -> None:
    root = _shared_dir(tmp_path) / "run"
    with ckpt.CheckpointManager(root) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    if dist.get_rank() == 0:
        for data_file in (root / "step-00000002" / "data").iterdir():
            raw = bytearray(data_file.read_bytes())
            raw[-3] ^= 0x01
            data_file.write_bytes(bytes(raw))
    dist.barrier()
    state = _state(0)
    manager = ckpt.CheckpointManager(root)
    with pytest.warns(ckpt.RestoreFallbackWarning, match=r"step-00000002.*checksum"):
        assert manager.restore(state) == 1
    _check(state, 1)
    assert manager.latest_step() == 1
    manager.close()


@distributed(world_size=WORLD, timeout=60)
def test_a_failed_background_save_raises_on_every_rank(tmp_path: Path) -> None:
    root = _shared_dir(tmp_path) / "run"
    if dist.get_rank() == 0:
        (root / "step-00000002").mkdir(parents=True)
        (root / "step-00000002" / "data").write_text("a file where data/ must be")
    dist.barrier()
    manager = ckpt.CheckpointManager(root, save_policy=ckpt.SavePolicy(every_steps=2))
    assert manager.save(2, _state(2))
    if dist.get_rank() == 0:  # rank 0 has seen its save fail; rank 1 may not have yet
        concurrent.futures.wait([manager._in_flight])  # type: ignore[list-item]
    with pytest.raises(ckpt.CheckpointDataError, match="not a real directory"):
        # Step 3 is not due, but the failure is raised at this next call, on every rank.
        manager.save(3, _state(3))
    assert manager.save(4, _state(4))
    manager.close()
    assert ckpt.CheckpointManager(root).steps() == [4]


def _series_on_s3(s3: S3Bucket) -> list[int]:
    url = s3.url("run")
    retention = ckpt.RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss")
    with ckpt.CheckpointManager(url, retention=retention, storage_options=s3.options) as manager:
        for step, loss in ((1, 0.5), (2, 0.9), (3, 0.7)):
            manager.save(step, _state(step), metrics={"loss": loss})
    manager = ckpt.CheckpointManager(url, storage_options=s3.options)
    state = _state(0)
    assert manager.restore(state) == 3
    _check(state, 3)
    steps = manager.steps()
    manager.close()
    return steps


def test_a_series_on_s3(s3: S3Bucket, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_on_ranks(_series_on_s3, WORLD, args=(s3,), timeout=90) == [[1, 3], [1, 3]]
    keys = s3.keys("run")
    assert not [key for key in keys if key.startswith("run/step-00000002")]
    assert main(["ls", s3.url("run"), "--json", "--storage-options", json.dumps(s3.options)]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(row["step"], row["state"], row["kept"]) for row in listed] == [
        (1, "committed", True),
        (3, "committed", True),
    ]
    assert listed[0]["metrics"] == {"loss": 0.5}
