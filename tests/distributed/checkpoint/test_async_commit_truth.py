"""``async_save`` on 2 real ranks whose coordinator's writer process is SIGKILLed at a point of
the commit (``tests/_commit_kill.py``): every rank reaches the same verdict, the true one.
Before the index is renamed into place, every future fails saying the save did not commit and
the previous checkpoint loads; after it (no reply yet, on the coordinator's side at least),
every future succeeds with the save's Metadata and the new checkpoint loads. The next call
starts new writers on every rank, with no error left over. A CheckpointManager counts such a
save as committed on every rank, and warns once (on rank 0) when ``keep_best`` never gets its
metric."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.saving import background
from shardwise.errors import CheckpointError
from tests._commit_kill import COMMITTED, POINTS, writers_killed_at
from tests.distributed.checkpoint.test_async_process import _short_group, _writer
from tests.harness import distributed


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((4,), float(step + dist.get_rank())), "step": step}


def _loaded(path: Path, group: dist.ProcessGroup) -> dict[str, Any]:
    target = {"w": torch.zeros(4), "step": -1}
    ckpt.load(target, path, process_group=group)
    return target


def _everyone(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


@distributed(world_size=2, timeout=120)
@pytest.mark.parametrize("point", POINTS)
def test_every_rank_learns_whether_the_save_committed(tmp_path: Path, point: str) -> None:
    group = _short_group()
    path = tmp_path / "c"
    ckpt.save(_state(1), path, process_group=group)  # the previous checkpoint at the path
    previous = ckpt.read_metadata(path).storage_meta
    with writers_killed_at(point):
        future = ckpt.async_save(_state(2), path, process_group=group)
    killed = _writer()
    if COMMITTED[point]:
        metadata = future.result(timeout=60)
        assert metadata.storage_meta is not None and metadata.planner_data["world_size"] == 2
        verdict = metadata.storage_meta.save_id
        assert verdict != previous.save_id  # type: ignore[union-attr]
        assert verdict == ckpt.read_metadata(path).storage_meta.save_id  # type: ignore[union-attr]
        assert sorted(metadata.state_dict_metadata) == ["step", "w"]
    else:
        pattern = r"rank 0\b.*killed by SIGKILL.*was not committed \(the previous checkpoint"
        with pytest.raises(CheckpointError, match=pattern):
            future.result(timeout=60)
        verdict = "not committed"
    assert _everyone(verdict) == [verdict, verdict]
    loaded = _loaded(path, group)
    step = 2 if COMMITTED[point] else 1
    assert loaded["step"] == step and torch.equal(loaded["w"], torch.full((4,), float(step)))
    dist.barrier()
    # New writers on every rank at the next call; nothing left to raise from the killed ones.
    future = ckpt.async_save(_state(3), path, process_group=group)
    assert future.result(timeout=60).planner_data["world_size"] == 2
    assert _writer() is not killed and killed.dead
    assert _loaded(path, group)["step"] == 3
    background.shutdown_writers()


@distributed(world_size=2, timeout=120)
def test_a_manager_on_every_rank_counts_a_save_whose_writer_died_after_the_commit(
    tmp_path: Path,
) -> None:
    background.shutdown_writers()
    group = _short_group()
    retention = ckpt.RetentionPolicy(keep_last=1, keep_best=1, best_metric="eval_loss")
    manager = ckpt.CheckpointManager(tmp_path / "run", retention=retention, process_group=group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.save(1, _state(1), metrics={"loss": 0.5})
        with writers_killed_at("after-commit"):
            assert manager.save(2, _state(2), metrics={"loss": 0.4})
        killed = _writer()
        manager.wait()  # raises nothing on any rank: step 2 committed
    unranked = [str(w.message) for w in caught if "never ranked best" in str(w.message)]
    # Rank 0's metrics are recorded: it warns, once, naming the metric and the ones it got.
    assert len(unranked) == (1 if dist.get_rank() == 0 else 0), unranked
    assert all("'eval_loss'" in text and "'loss'" in text for text in unranked)
    assert manager.latest_step() == 2 and manager.steps() == [2]  # step 1 went
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert manager.save(3, _state(3))
    manager.close()
    assert _writer() is not killed
    assert ckpt.CheckpointManager(tmp_path / "run", process_group=group).steps() == [3]
    assert _loaded(tmp_path / "run" / "step-00000003", group)["step"] == 3
    background.shutdown_writers()
