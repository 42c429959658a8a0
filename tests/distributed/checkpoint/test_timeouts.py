"""A rank that never joins a save, async save or load: the others give up after the process
group's timeout, with an error that says the call is collective, and nothing is committed.

Each test makes a group with a short timeout (``SHORT``) for the one-sided call; the ranks that
skip it wait on the default group (the harness's, with a long timeout) meanwhile. The broken
short group is destroyed by the harness's post-test check, so the pooled ranks stay usable.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import shardwise.checkpoint as ckpt
from shardwise.checkpoint import CheckpointError, CheckpointTimeoutError
from tests.harness import distributed

SHORT = timedelta(seconds=3)
# Far below the default group's timeout (the harness's 120 s) and torch's default (30 min):
# giving up sooner than this shows that the short timeout applied.
PROMPTLY = 20.0


def _short_group() -> ProcessGroup:
    group = dist.new_group(list(range(dist.get_world_size())), timeout=SHORT, backend="gloo")
    assert group is not None
    return group


def _state(rank: int) -> dict[str, object]:
    return {"w": torch.arange(8.0) + rank, "step": 7}


def _check_failure(error: CheckpointTimeoutError, operation: str, started: float) -> None:
    elapsed = time.monotonic() - started
    assert elapsed < PROMPTLY, f"gave up after {elapsed:.1f} s"
    message = str(error)
    assert f"shardwise.checkpoint.{operation} is collective" in message, message
    assert "every rank of the process group must call it" in message, message
    assert "within 3 s (the process group's timeout)" in message, message
    assert isinstance(error, CheckpointError) and isinstance(error, RuntimeError)
    assert isinstance(error.__cause__, RuntimeError)  # torch's own error


def _names_the_other_rank(error: CheckpointTimeoutError) -> None:
    other = 1 - dist.get_rank()
    assert f"rank {other} did not arrive" in str(error), str(error)
    assert f"this is rank {dist.get_rank()}" in str(error), str(error)


@distributed(world_size=2, timeout=40)
@pytest.mark.parametrize("caller", [0, 1], ids=["coordinator", "other"])
def test_save_on_one_rank_only_fails_promptly_and_commits_nothing(
    caller: int, tmp_path: Path
) -> None:
    rank = dist.get_rank()
    short = _short_group()
    path = tmp_path / "ckpt"
    if rank == caller:
        started = time.monotonic()
        with pytest.raises(CheckpointTimeoutError) as caught:
            ckpt.save(_state(rank), path, process_group=short)
        _check_failure(caught.value, "save", started)
        _names_the_other_rank(caught.value)
        assert not (path / "shardwise.json").exists()
    # Nothing is lost: the save lock the failed save took is released, the next save commits.
    metadata = ckpt.save(_state(rank), path)
    assert set(metadata.state_dict_metadata) == {"w", "step"}


@distributed(world_size=2, timeout=40)
def test_a_local_error_is_still_raised_when_the_others_never_come(tmp_path: Path) -> None:
    short = _short_group()
    if dist.get_rank() == 0:
        started = time.monotonic()
        with pytest.raises(TypeError, match="allow_pickle=True") as caught:
            ckpt.save({"w": torch.ones(2), "obj": object()}, tmp_path / "ckpt", process_group=short)
        assert time.monotonic() - started < PROMPTLY
        # What this rank must fix comes first; that nobody heard of it, second.
        (note,) = caught.value.__notes__
        assert note.startswith("It was not shared with the other ranks: ")
        assert "is collective: every rank of the process group must call it" in note
    dist.barrier()


@distributed(world_size=2, timeout=40)
@pytest.mark.parametrize("caller", [0, 1], ids=["index-reader", "other"])
def test_load_on_one_rank_only_fails_promptly(caller: int, tmp_path: Path) -> None:
    rank = dist.get_rank()
    path = tmp_path / "ckpt"
    ckpt.save({"w": torch.arange(8.0)}, path)
    short = _short_group()
    target = {"w": torch.zeros(8)}
    if rank == caller:
        started = time.monotonic()
        with pytest.raises(CheckpointTimeoutError) as caught:
            ckpt.load(target, path, process_group=short)
        _check_failure(caught.value, "load", started)
        _names_the_other_rank(caught.value)
    dist.barrier()
    ckpt.load(target, path)
    assert torch.equal(target["w"], torch.arange(8.0))


@distributed(world_size=4, timeout=40)
def test_a_rank_that_raises_before_save_fails_the_others_promptly(tmp_path: Path) -> None:
    rank = dist.get_rank()
    short = _short_group()
    path = tmp_path / "ckpt"

    def step_then_save() -> None:
        if rank == 2:
            raise ValueError("the data loader failed")
        ckpt.save(_state(rank), path, process_group=short)

    started = time.monotonic()
    if rank == 2:
        with pytest.raises(ValueError, match="data loader"):
            step_then_save()
    else:
        with pytest.raises(CheckpointTimeoutError) as caught:
            step_then_save()
        _check_failure(caught.value, "save", started)
        # Any of the others may be the missing one: an all-gather does not say.
        others = ", ".join(str(other) for other in range(4) if other != rank)
        assert f"one or more of ranks {others} did not arrive" in str(caught.value)
        assert "which ones cannot be known from here" in str(caught.value)
    dist.barrier()
    assert not (path / "shardwise.json").exists()
    ckpt.save(_state(rank), path)
    assert (path / "shardwise.json").exists()


@distributed(world_size=2, timeout=40)
def test_async_save_on_one_rank_only_fails_its_future_promptly(tmp_path: Path) -> None:
    rank = dist.get_rank()
    short = _short_group()
    # Both ranks: the background group is made (collectively) and a save over it works.
    ckpt.async_save(_state(rank), tmp_path / "first", process_group=short).result(timeout=30)
    if rank == 0:
        started = time.monotonic()
        future = ckpt.async_save(_state(rank), tmp_path / "second", process_group=short)
        with pytest.raises(CheckpointTimeoutError) as caught:
            future.result(timeout=60)
        # The background group inherited the short timeout, not torch's 30 minutes.
        _check_failure(caught.value, "async_save", started)
        _names_the_other_rank(caught.value)
        assert not (tmp_path / "second" / "shardwise.json").exists()
    dist.barrier()
    assert (tmp_path / "first" / "shardwise.json").exists()
