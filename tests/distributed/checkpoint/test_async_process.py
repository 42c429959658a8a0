"""``async_save`` on real ranks: each rank's writer process writes while the training group
runs its own collectives; the writers of a sub-group number their ranks their own way; a
writer killed mid-save or while idle fails the save on every rank, naming the rank, and the
previous checkpoint still loads."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.saving import background
from shardwise.errors import CheckpointError
from tests.harness import distributed


def _writer() -> background.WriterProcess:
    (writer,) = background._writers.values()
    return writer


def _short_group() -> dist.ProcessGroup:
    ranks = list(range(dist.get_world_size()))
    group = dist.new_group(ranks, timeout=timedelta(seconds=20), backend="gloo")
    assert group is not None
    return group


def _wait_dead(writer: background.WriterProcess, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not writer.dead and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.dead


@distributed(world_size=2, timeout=90)
def test_writers_save_while_the_training_group_runs_its_own_collectives(tmp_path: Path) -> None:
    background.shutdown_writers()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    state = {
        "rows": distribute_tensor(full, mesh, [Shard(0)]),
        "cols": distribute_tensor(full * 2, mesh, [Shard(1)]),
        "rep": distribute_tensor(full[:4], mesh, [Replicate()]),
        "mine": torch.full((3,), float(rank)),
        "step": 5,
    }
    future = ckpt.async_save(state, tmp_path / "c")
    total = torch.zeros(1)
    for _ in range(50):  # the training job's collectives, while the writers write
        one = torch.ones(1)
        dist.all_reduce(one)
        total += one
    assert total.item() == 100
    metadata = future.result(timeout=60)
    assert metadata.planner_data["world_size"] == 2
    assert _writer().process.pid != os.getpid()
    target = {
        "rows": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(1)]),
        "cols": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]),
        "rep": distribute_tensor(torch.zeros(4, 8), mesh, [Shard(0)]),
        "mine": torch.zeros(3),
        "step": 0,
    }
    ckpt.load(target, tmp_path / "c")
    assert torch.equal(target["rows"].full_tensor(), full)
    assert torch.equal(target["cols"].full_tensor(), full * 2)
    assert torch.equal(target["rep"].full_tensor(), full[:4])
    assert torch.equal(target["mine"], torch.zeros(3))  # rank 0's copy of a replicated key
    assert target["step"] == 5
    background.shutdown_writers()


@distributed(world_size=4, timeout=90)
def test_a_sub_group_of_ranks_saves_through_writers_of_its_own(tmp_path: Path) -> None:
    background.shutdown_writers()
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [2, 3])  # every rank makes it; ranks 2 and 3 are in it
    if rank in (2, 3):
        full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
        state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 9}
        group = mesh.get_group()
        metadata = ckpt.async_save(state, tmp_path / "c", process_group=group).result(timeout=60)
        assert metadata.planner_data["world_size"] == 2
        target = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]), "step": 0}
        ckpt.load(target, tmp_path / "c", process_group=group)
        assert torch.equal(target["w"].full_tensor(), full) and target["step"] == 9
        background.shutdown_writers()
    dist.barrier()


@distributed(world_size=2, timeout=120)
def test_a_writer_killed_mid_save_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    background.shutdown_writers()
    rank = dist.get_rank()
    group = _short_group()
    ckpt.async_save({"w": torch.full((4,), float(rank))}, tmp_path / "a", process_group=group)
    background.in_flight()[0].result(timeout=60)
    writer = _writer()
    if rank == 0:  # the save handed over below cannot progress past rank 0
        os.kill(writer.process.pid, signal.SIGSTOP)
    dist.barrier()
    future = ckpt.async_save({"w": torch.ones(4)}, tmp_path / "b", process_group=group)
    if rank == 1:
        os.kill(writer.process.pid, signal.SIGKILL)
        _wait_dead(writer)
    dist.barrier()
    if rank == 0:
        os.kill(writer.process.pid, signal.SIGCONT)
    with pytest.raises(CheckpointError, match=r"rank 1\b.*killed by SIGKILL.*not committed"):
        future.result(timeout=60)
    dist.barrier()
    assert not (tmp_path / "b" / "shardwise.json").exists()
    target = {"w": torch.zeros(4)}
    ckpt.load(target, tmp_path / "a", process_group=group)  # the previous one loads
    assert torch.equal(target["w"], torch.zeros(4))
    # The next call starts new writers on every rank.
    metadata = ckpt.async_save({"w": torch.full((4,), 3.0)}, tmp_path / "b", process_group=group)
    assert metadata.result(timeout=60).planner_data["world_size"] == 2
    assert _writer().process.pid != writer.process.pid
    background.shutdown_writers()


@distributed(world_size=2, timeout=120)
def test_a_writer_killed_while_idle_fails_the_next_call_on_every_rank(tmp_path: Path) -> None:
    background.shutdown_writers()
    rank = dist.get_rank()
    group = _short_group()
    ckpt.async_save({"w": torch.ones(2)}, tmp_path / "a", process_group=group).result(timeout=60)
    writer = _writer()
    if rank == 1:
        os.kill(writer.process.pid, signal.SIGKILL)
    _wait_dead(writer)  # rank 0's writer was aborted through the store
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"rank 1\b.*killed by SIGKILL"):
        ckpt.async_save({"w": torch.ones(2)}, tmp_path / "b", process_group=group)
    assert not (tmp_path / "b").exists()
    future = ckpt.async_save({"w": torch.full((2,), 4.0)}, tmp_path / "b", process_group=group)
    future.result(timeout=60)
    target = {"w": torch.zeros(2)}
    ckpt.load(target, tmp_path / "b", process_group=group)
    assert torch.equal(target["w"], torch.full((2,), 4.0))
    background.shutdown_writers()
