"""``async_save`` in one process whose writer process is SIGKILLed at a point of the commit
(``tests/_commit_kill.py``): before the index is renamed into place the save did not commit and
the future fails saying so; after it (the index in place, or the leftovers removed too, but no
reply) the save is durable and the future succeeds with its Metadata. A CheckpointManager
counts such a save as committed, and the next save starts a new writer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.saving import background
from shardwise.errors import CheckpointError, CheckpointStorageError
from tests._commit_kill import COMMITTED, POINTS, writers_killed_at

NOT_COMMITTED = r"was not committed \(the previous checkpoint is intact\)"


@pytest.fixture(autouse=True)
def _fresh_writers() -> Iterator[None]:
    background.shutdown_writers()
    yield
    background.shutdown_writers()


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((3, 4), float(step)), "step": step}


def _loaded(path: Path | str) -> dict[str, Any]:
    target = {"w": torch.zeros(3, 4), "step": -1}
    ckpt.load(target, path)
    return target


def _writer() -> background.WriterProcess:
    (writer,) = background._writers.values()
    return writer


@pytest.mark.parametrize("point", POINTS)
def test_a_writer_killed_at_each_point_of_the_commit_reports_what_is_true(
    tmp_path: Path, point: str
) -> None:
    path = tmp_path / "c"
    ckpt.save(_state(1), path)  # the previous checkpoint at the path
    before = ckpt.read_metadata(path).storage_meta
    with writers_killed_at(point):
        future = ckpt.async_save(_state(2), path)
    killed = _writer()
    if COMMITTED[point]:
        metadata = future.result(timeout=60)
        on_disk = ckpt.read_metadata(path)
        assert metadata == on_disk and metadata.storage_meta is not None
        assert metadata.storage_meta.save_id != before.save_id  # type: ignore[union-attr]
        assert sorted(metadata.state_dict_metadata) == ["step", "w"]
        assert _loaded(path)["step"] == 2
    else:
        with pytest.raises(
            CheckpointError, match=rf"rank 0 was killed by SIGKILL.*{NOT_COMMITTED}"
        ):
            future.result(timeout=60)
        assert ckpt.read_metadata(path).storage_meta == before
        assert _loaded(path)["step"] == 1
    assert killed.process.poll() is not None and killed.dead
    # The next call starts a new writer, and raises nothing left from the killed one.
    assert ckpt.async_save(_state(3), path).result(timeout=60).planner_data["world_size"] == 1
    assert _writer() is not killed
    loaded = _loaded(path)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], _state(3)["w"])


def test_a_relative_path_is_read_where_the_save_was_submitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "here").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    with writers_killed_at("after-commit"):
        future = ckpt.async_save(_state(5), "c")
    monkeypatch.chdir(tmp_path / "elsewhere")  # the verdict must not look here
    metadata = future.result(timeout=60)
    assert metadata == ckpt.read_metadata(tmp_path / "here" / "c")
    assert not os.listdir(tmp_path / "elsewhere")


def test_an_outcome_that_cannot_be_read_is_reported_as_unknown_not_as_not_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable(*args: Any) -> None:
        raise CheckpointStorageError("the endpoint does not answer")

    monkeypatch.setattr(background, "committed_metadata", unreachable)
    path = tmp_path / "c"
    with writers_killed_at("after-commit"):
        future = ckpt.async_save(_state(2), path)
    with pytest.raises(CheckpointError, match="killed by SIGKILL") as caught:
        future.result(timeout=60)
    message = str(caught.value)
    assert "may have committed" in message and "the endpoint does not answer" in message
    assert "was not committed" not in message and "is intact" not in message
    save_id = ckpt.read_metadata(path).storage_meta.save_id  # type: ignore[union-attr]
    assert f"read_metadata({str(path)!r}).storage_meta.save_id is {save_id!r}" in message
    assert isinstance(caught.value.__cause__, CheckpointStorageError)


def test_a_manager_counts_a_save_whose_writer_died_after_the_commit(tmp_path: Path) -> None:
    retention = ckpt.RetentionPolicy(keep_last=1)
    with ckpt.CheckpointManager(tmp_path, retention=retention, incremental=True) as manager:
        for step in (1, 2):
            assert manager.save(step, _state(step))
        manager.wait()
        with writers_killed_at("after-commit"):
            assert manager.save(3, _state(3))
        killed = _writer()
        manager.wait()  # raises nothing: step 3 committed
        assert killed.dead
        assert manager.latest_step() == 3
        assert manager.steps() == [3]  # the retention ran after that commit, counting it
        # A newer checkpoint of another run: the base of step 4 is still this run's last.
        ckpt.save(_state(9), tmp_path / "step-00000009")
        assert manager.save(4, {**_state(3), "step": 4})  # w unchanged since step 3
        manager.wait()
        assert _writer() is not killed
        assert manager.steps() == [4, 9]
    index = (tmp_path / "step-00000004" / "shardwise.json").read_text()
    assert "step-00000003" in index and "step-00000009" not in index
    loaded = _loaded(tmp_path / "step-00000004")
    assert loaded["step"] == 4 and torch.equal(loaded["w"], _state(3)["w"])
