"""Failures on some ranks reach every rank, named, before anything is written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise.checkpoint as ckpt
from tests.harness import distributed

WORLD = 4


class _Unpicklable:
    """A value whose pickling fails with an AttributeError (not a TypeError/ValueError)."""

    def __reduce__(self) -> Any:
        raise AttributeError("no attribute 'weights' while pickling")


class _BrokenStateful:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("a DTensor helper failed")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("never called")


def _assert_nothing_committed(path: Path) -> None:
    assert not (path / "shardwise.json").exists()


@distributed(world_size=WORLD, timeout=40)
def test_any_error_while_describing_is_shared_by_every_rank(tmp_path: Path) -> None:
    rank = dist.get_rank()
    state: dict[str, Any] = {"w": torch.ones(4), "obj": 1}
    if rank == 2:
        state["obj"] = _Unpicklable()
    with pytest.raises(ckpt.CheckpointError) as caught:
        ckpt.save(state, tmp_path / "a", allow_pickle=True)
    error = caught.value
    assert error.key == "obj" and error.rank == (None if rank == 2 else 2)
    assert "AttributeError" in str(error) and "no attribute 'weights'" in str(error)
    _assert_nothing_committed(tmp_path / "a")

    state = {"w": torch.ones(4), "sched": {"lr": 1.0}}
    if rank == 1:
        state["sched"] = _BrokenStateful()
    with pytest.raises(ckpt.CheckpointError) as caught:
        ckpt.save(state, tmp_path / "b")
    assert "RuntimeError" in str(caught.value) and "a DTensor helper failed" in str(caught.value)
    assert caught.value.rank == (None if rank == 1 else 1)
    _assert_nothing_committed(tmp_path / "b")


@distributed(world_size=WORLD, timeout=40)
def test_a_process_local_store_is_refused_for_a_group(tmp_path: Path) -> None:
    url = f"memory://shardwise-failures/{os.getpid()}"
    with pytest.raises(ckpt.CheckpointError, match="only this process sees"):
        ckpt.save({"w": torch.ones(2)}, url)
    with pytest.raises(ckpt.CheckpointError, match="only this process sees"):
        ckpt.load({"w": torch.zeros(2)}, url)
