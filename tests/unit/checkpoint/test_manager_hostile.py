"""``CheckpointManager`` and ``shardwise ls`` against hostile input, in one process: metrics
that are not plain numbers, step and rejection records of any content, symbolic links and
files named like steps, an index that is not a regular file, and a bogus newer checkpoint.
What is checked: every failure is a ``CheckpointError`` (or the ``TypeError`` / ``ValueError``
of a bad argument), nothing outside the series root is read or deleted, and the retention
policy goes on working around what it cannot delete."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.manager import deletion, materialize
from shardwise.checkpoint.manager.policy import retained
from shardwise.checkpoint.manager.series import (
    REJECTED_NAME,
    STEP_RECORD_NAME,
    CheckpointInfo,
    list_series,
)
from shardwise.checkpoint.storage import LocalStorage
from shardwise.cli import main
from tests import _hostile as h


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((4,), float(value)), "step": int(value)}


def _dirs(root: Path) -> list[str]:
    return sorted(entry.name for entry in root.iterdir() if entry.name.startswith("step-"))


def _record(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}" / STEP_RECORD_NAME


def _rewrite_record(root: Path, step: int, text: str) -> None:
    _record(root, step).write_text(text)


# -- metrics -----------------------------------------------------------------------------------


def test_a_metric_beyond_a_float_is_recorded_as_null_and_never_breaks_retention(
    tmp_path: Path,
) -> None:
    retention = ckpt.RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss")
    with ckpt.CheckpointManager(tmp_path, retention=retention, async_save=False) as manager:
        manager.save(1, _state(1), metrics={"loss": 10**400})
        manager.save(2, _state(2), metrics={"loss": 3})
        manager.save(3, _state(3), metrics={"loss": 4})  # retention ran after each commit
        assert manager.steps() == [2, 3]
    assert json.loads(_record(tmp_path, 3).read_text())["metrics"] == {"loss": 4}


def test_metrics_from_disk_beyond_a_float_or_non_finite_rank_nowhere(tmp_path: Path) -> None:
    retention = ckpt.RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss")
    with ckpt.CheckpointManager(tmp_path, retention=retention, async_save=False) as manager:
        manager.save(1, _state(1), metrics={"loss": 1.0})
        manager.save(2, _state(2), metrics={"loss": 2.0})
        text = _record(tmp_path, 1).read_text()
        _rewrite_record(tmp_path, 1, text.replace('"loss": 1.0', '"loss": ' + "9" * 400))
        text = _record(tmp_path, 2).read_text()
        _rewrite_record(tmp_path, 2, text.replace('"loss": 2.0', '"loss": NaN'))
        listing = list_series(LocalStorage(str(tmp_path)))
        assert [info.metrics for info in listing] == [{"loss": None}, {"loss": None}]
        manager.save(3, _state(3), metrics={"loss": 5.0})
        assert manager.steps() == [3]  # neither 1 nor 2 ranks: only the newest stays
    policy = ckpt.RetentionPolicy(keep_best=1, best_metric="m")
    assert retained(policy, {1: {"m": 10**400}, 2: {"m": "0"}, 3: {"m": 7}}) == {3}


@pytest.mark.parametrize(
    "metric",
    [torch.tensor([1.0, 2.0]), torch.tensor(True), [0.5], "0.5", None, 1 + 2j],
    ids=["two-element tensor", "bool tensor", "list", "str", "None", "complex"],
)
def test_a_metric_that_is_not_one_number_is_a_type_error(tmp_path: Path, metric: object) -> None:
    with ckpt.CheckpointManager(tmp_path, async_save=False) as manager:
        with pytest.raises(TypeError, match="metric 'loss'"):
            manager.save(1, _state(1), metrics={"loss": metric})
        with pytest.raises(TypeError, match="metrics must be a mapping"):
            manager.save(1, _state(1), metrics=[("loss", 0.5)])  # type: ignore[arg-type]
        assert manager.save(1, _state(1), metrics={"loss": torch.tensor([0.25])})
        assert manager.steps() == [1]
    assert json.loads(_record(tmp_path, 1).read_text())["metrics"] == {"loss": 0.25}


# -- steps -------------------------------------------------------------------------------------


def test_a_step_is_an_integer_of_any_kind_and_nothing_else(tmp_path: Path) -> None:
    with ckpt.CheckpointManager(tmp_path, async_save=False) as manager:
        assert manager.save(np.int64(3), _state(3))  # type: ignore[arg-type]
        assert manager.save(torch.tensor(4), _state(4))  # type: ignore[arg-type]
        assert manager.steps() == [3, 4]
        assert manager.path(np.int32(3)) == str(tmp_path / "step-00000003")  # type: ignore[arg-type]
        top = 10**19 - 1  # the largest step a listing reads (19 digits)
        assert manager.save(top, _state(5)) and manager.steps() == [3, 4, top]
        shutil.rmtree(manager.path(top))
        bad_steps = (True, 3.0, -1, "3", None, torch.tensor(1.0), torch.tensor(True), top + 1)
        for bad in (*bad_steps, np.int64(-2)):
            with pytest.raises(ValueError, match="step must be an int >= 0"):
                manager.save(bad, _state(5))  # type: ignore[arg-type]
            if bad is not None:  # restore's default: the latest
                with pytest.raises(ValueError, match="step must be an int >= 0"):
                    manager.restore(_state(0), step=bad)  # type: ignore[arg-type]
        state = _state(0)
        assert manager.restore(state, step=np.uint8(3)) == 3 and state["step"] == 3  # type: ignore[arg-type]
        assert manager.steps() == [3, 4]
    assert json.loads(_record(tmp_path, 4).read_text())["step"] == 4


# -- links and files named like steps -----------------------------------------------------------


def test_restore_reads_no_checkpoint_through_a_link_named_like_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside"
    ckpt.save(_state(42), outside)
    before = sorted(path.name for path in outside.iterdir())
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        manager.save(1, _state(1))
    (root / "step-00000003").symlink_to(outside)
    (root / "step-00000004").write_text("a file named like a step")
    manager = ckpt.CheckpointManager(root, async_save=False)
    state = _state(0)
    for step in (3, 4):
        with pytest.raises(ckpt.CheckpointNotFoundError, match="not a real directory"):
            manager.restore(state, step=step)
        assert state["step"] == 0 and torch.equal(state["w"], torch.zeros(4))
    # A listing that saw a directory which is a link by the time it is loaded: skipped too.
    monkeypatch.setattr(manager, "_restorable", lambda: ([1, 3], 0))
    with pytest.warns(ckpt.RestoreFallbackWarning, match="step-00000003"):
        assert manager.restore(state) == 1
    assert state["step"] == 1
    manager.close()
    assert sorted(path.name for path in outside.iterdir()) == before  # no rejection record


def test_a_save_to_a_link_or_file_named_like_its_step_is_a_checkpoint_error(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "run"
    root.mkdir()
    (root / "step-00000003").symlink_to(outside)
    (root / "step-00000004").write_text("a file named like a step")
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        for step in (3, 4):
            with pytest.raises(ckpt.CheckpointStorageError, match="not a real directory"):
                manager.save(step, _state(step))
        assert manager.save(5, _state(5))
        assert manager.steps() == [5]
    assert list(outside.iterdir()) == []
    assert (root / "step-00000004").read_text() == "a file named like a step"


def test_a_series_root_that_is_a_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.write_text("not a directory")
    manager = ckpt.CheckpointManager(root, async_save=False)
    for call in (manager.steps, manager.latest_step, lambda: manager.restore(_state(0))):
        with pytest.raises(ckpt.CheckpointStorageError, match="cannot list the series"):
            call()
    with pytest.raises(ckpt.CheckpointStorageError):
        manager.save(1, _state(1))
    manager.close()
    assert root.read_text() == "not a directory"


# -- retention around what it cannot delete ------------------------------------------------------


def test_retention_goes_on_past_an_index_that_is_not_a_regular_file(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("not the series'")
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    # Step 1 is dropped, but its "index" is a directory: it cannot be deleted. Step 2 is kept,
    # and its "index" is a link out of the root: no reader follows it, so it protects nothing.
    (root / "step-00000001" / "shardwise.json").unlink()
    (root / "step-00000001" / "shardwise.json").mkdir()
    (root / "step-00000002" / "shardwise.json").unlink()
    (root / "step-00000002" / "shardwise.json").symlink_to(secret)
    retention = ckpt.RetentionPolicy(keep_last=1, keep_every=2)
    with ckpt.CheckpointManager(root, retention=retention, async_save=False) as manager:
        manager.save(4, _state(4))
        manager.save(5, _state(5))
    assert _dirs(root) == ["step-00000001", "step-00000002", "step-00000004", "step-00000005"]
    assert secret.read_text() == "not the series'"


def test_retention_goes_on_past_a_hostile_save_lock(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    # A directory where the save lock is: no deletion may take it over (it stays).
    (root / "step-00000001" / "shardwise.lock").mkdir()
    # A process id beyond the platform's, on this host: checking it raised OverflowError (and
    # stopped every deletion); no process holds such a lock, so it is stale.
    holder = {"save_id": "x", "host": socket.gethostname(), "pid": 2**40, "heartbeat": 1e18}
    (root / "step-00000002" / "shardwise.json").unlink()  # a deletion a kill interrupted
    (root / "step-00000002" / "shardwise.lock").write_text(json.dumps(holder))
    retention = ckpt.RetentionPolicy(keep_last=1)
    with ckpt.CheckpointManager(root, retention=retention, async_save=False) as manager:
        assert manager.save(4, _state(4))
        assert manager.save(5, _state(5))
        assert manager.steps() == [1, 5]
    assert "step-00000002" not in _dirs(root)
    assert "step-00000003" not in _dirs(root) and "step-00000004" not in _dirs(root)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_retention_never_deletes_the_last_save_for_a_bogus_newer_checkpoint(
    tmp_path: Path, async_save: bool
) -> None:
    root = tmp_path / "run"
    (root / "step-99999999").mkdir(parents=True)
    (root / "step-99999999" / "shardwise.json").write_text("junk that looks committed")
    retention = ckpt.RetentionPolicy(keep_last=1)
    with ckpt.CheckpointManager(root, retention=retention, async_save=async_save) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
        manager.wait()
        assert manager.steps() == [3, 99999999]
    state = _state(0)
    with pytest.warns(ckpt.RestoreFallbackWarning, match="step-99999999"):
        assert ckpt.CheckpointManager(root).restore(state) == 3
    assert state["step"] == 3


# -- shardwise ls --------------------------------------------------------------------------------


def _ls(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["ls", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_shows_a_series_whatever_its_records_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ckpt.CheckpointManager(tmp_path, async_save=False) as manager:
        for step in range(1, 6):
            manager.save(step, _state(step), metrics={"loss": 0.5})
    times = {1: "NaN", 2: "Infinity", 3: "1e300", 4: "-1e18"}
    for step, value in times.items():
        text = _record(tmp_path, step).read_text()
        text = re.sub(r'"time": [^,]+', f'"time": {value}', text)
        _rewrite_record(tmp_path, step, text.replace('"loss": 0.5', '"loss": NaN'))
    code, out, err = _ls(capsys, str(tmp_path), "--json")
    assert code == 0 and err == ""
    rows = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in --json"))
    by_step = {row["step"]: row for row in rows["checkpoints"]}
    assert [by_step[step]["time"] for step in (1, 2)] == [None, None]
    assert by_step[3]["metrics"] == {"loss": None} and by_step[5]["metrics"] == {"loss": 0.5}
    code, out, err = _ls(capsys, str(tmp_path))
    assert code == 0 and err == ""
    assert [line.split()[:2] for line in out.splitlines()[1:6]] == [
        [str(step), "committed"] for step in range(1, 6)
    ]


def test_ls_lists_a_step_whose_data_is_a_link_without_following_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside"
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "big.bin").write_bytes(b"x" * 100_000)
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    shutil.rmtree(root / "step-00000001" / "data")
    (root / "step-00000001" / "data").symlink_to(outside / "data")
    code, out, err = _ls(capsys, str(root), "--json")
    assert code == 0 and err == ""
    rows = json.loads(out)["checkpoints"]
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0]["bytes"] < 100_000  # the link counts, not what it points at


@pytest.mark.parametrize("junk_step", [0, 99_999_999], ids=["older", "newer"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_incremental_series_passes_over_a_base_whose_index_is_junk(
    tmp_path: Path, junk_step: int, async_save: bool
) -> None:
    junk = tmp_path / f"step-{junk_step:08d}"
    junk.mkdir()
    (junk / "shardwise.json").write_text("junk that looks committed")
    with ckpt.CheckpointManager(tmp_path, async_save=async_save, incremental=True) as manager:
        for step in (1, 2):  # the first builds on nothing, the second on the first
            assert manager.save(step, _state(step))
        manager.wait()
    state = _state(0)
    ckpt.load(state, tmp_path / "step-00000002")
    assert state["step"] == 2 and (junk / "shardwise.json").read_text().startswith("junk")


def test_a_deletion_touches_nothing_through_a_step_that_became_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    # What a save lock whose process is gone looks like: a deletion takes such a lock over.
    stale = {"save_id": "x", "host": "elsewhere", "pid": 1, "heartbeat": 0.0}
    (outside / "shardwise.lock").write_text(json.dumps(stale))
    (outside / "shardwise.json").write_text("{}")
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        manager.save(4, _state(4))
    (root / "step-00000003").symlink_to(outside)
    storage = LocalStorage(str(root))

    def open_step(step: int) -> LocalStorage:
        return LocalStorage(str(root / f"step-{step:08d}"))

    # A listing that saw step 3 as a directory (uncommitted, older than 4): a link by now.
    listing = [CheckpointInfo(3, str(root / "step-00000003"), False), *list_series(storage)]
    assert deletion.finish_deletions(storage, listing, open_step, writing=None) == []
    with pytest.raises(OSError, match="not a real directory"):
        deletion.delete_checkpoint(storage, 3, open_step)
    assert sorted(path.name for path in outside.iterdir()) == ["shardwise.json", "shardwise.lock"]
    assert json.loads((outside / "shardwise.lock").read_text()) == stale


# -- materialize -------------------------------------------------------------------------------


def test_materialize_into_a_place_it_cannot_write_is_a_checkpoint_error(tmp_path: Path) -> None:
    source = tmp_path / "source"
    ckpt.save(_state(1), source)
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "data").symlink_to(outside)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for out in (linked, a_file):
        with pytest.raises(ckpt.CheckpointStorageError, match="cannot write the copy"):
            materialize(source, out)
    assert list(outside.iterdir()) == [] and a_file.read_text() == "not a directory"


# -- restore ----------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", [errno.EACCES, errno.EMFILE, errno.EIO])
def test_a_storage_failure_while_restoring_rejects_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: int
) -> None:
    with ckpt.CheckpointManager(tmp_path, async_save=False) as manager:
        for step in (1, 2):
            manager.save(step, _state(step))
    opened = LocalStorage.open_reader

    def fails(self: LocalStorage, path: str) -> Any:
        if f"step-00000002{os.sep}data" in path:
            raise OSError(failure, os.strerror(failure), path)
        return opened(self, path)

    monkeypatch.setattr(LocalStorage, "open_reader", fails)
    manager = ckpt.CheckpointManager(tmp_path, async_save=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckpt.RestoreFallbackWarning)
        with pytest.raises(ckpt.CheckpointDataError, match=os.strerror(failure)):
            manager.restore(_state(0))
    monkeypatch.undo()
    # The checkpoint is not the cause: it is not marked rejected, and loads once storage works.
    assert not (tmp_path / "step-00000002" / REJECTED_NAME).exists()
    state = _state(0)
    assert manager.restore(state) == 2 and state["step"] == 2
    manager.close()


def test_retention_removes_links_in_a_checkpoint_and_nothing_they_point_at(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "precious.bin").write_bytes(b"not the series'")
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    shutil.rmtree(root / "step-00000001" / "data")
    (root / "step-00000001" / "data").symlink_to(outside / "data")  # data/ itself a link
    (root / "step-00000002" / "data" / "link.bin").symlink_to(outside / "data" / "precious.bin")
    (root / "step-00000002" / "notes").symlink_to(outside)
    retention = ckpt.RetentionPolicy(keep_last=1)
    with ckpt.CheckpointManager(root, retention=retention, async_save=False) as manager:
        manager.save(4, _state(4))
    assert _dirs(root) == ["step-00000004"]
    assert (outside / "data" / "precious.bin").read_bytes() == b"not the series'"
    assert sorted(path.name for path in (outside / "data").iterdir()) == ["precious.bin"]


def test_a_reference_declaring_a_size_of_thousands_of_digits_still_protects_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ckpt.CheckpointManager(tmp_path, async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    (data_file,) = (tmp_path / "step-00000001" / "data").iterdir()
    reference = f'"../step-00000001/data/{data_file.name}",'.encode()
    (tmp_path / "step-00000002" / "shardwise.json").write_bytes(reference + b"9" * 5000 + b",")
    code, out, err = _ls(capsys, str(tmp_path), "--json")
    assert code == 0 and err == ""
    assert [row["state"] for row in json.loads(out)["checkpoints"]] == ["committed"] * 3
    retention = ckpt.RetentionPolicy(keep_last=1, keep_every=2)  # keeps 2, which names the file
    with ckpt.CheckpointManager(tmp_path, retention=retention, async_save=False) as manager:
        manager.save(5, _state(5))
    assert _dirs(tmp_path) == ["step-00000001", "step-00000002", "step-00000005"]
    assert data_file.exists()  # step 1 is deleted (retired), but not what step 2 names
    assert not (tmp_path / "step-00000001" / "shardwise.json").exists()


_HEAD = b'{"format": "shardwise-step", "version": 1, "step": 2, '


@pytest.mark.parametrize(
    ("record", "time"),
    [
        (b"[" * 100_000, None),
        (b"\xff\xfe\x00 not UTF-8", None),
        (b" " * (2 << 20), None),  # larger than a record may be
        (_HEAD + b'"time": "now", "metrics": {}}', None),
        (_HEAD + b'"time": 1.0, "metrics": [1]}', None),
        (_HEAD + b'"time": 1.0, "metrics": {"loss": "0.1", "ok": true}, "retention": 7}', 1.0),
        ("fifo", None),
        ("directory", None),
    ],
    ids=["deep", "not-utf8", "huge", "time-str", "metrics-list", "wrong-types", "fifo", "dir"],
)
def test_a_hostile_step_record_makes_metrics_unknown_and_nothing_else(
    tmp_path: Path, record: bytes | str, time: float | None
) -> None:
    retention = ckpt.RetentionPolicy(keep_last=2, keep_best=1, best_metric="loss")
    with ckpt.CheckpointManager(tmp_path, retention=retention, async_save=False) as manager:
        manager.save(1, _state(1), metrics={"loss": 0.5})
        manager.save(2, _state(2), metrics={"loss": 0.1})  # the best, were its record readable
        path = _record(tmp_path, 2)
        path.unlink()
        if record == "fifo":
            os.mkfifo(path)
        elif record == "directory":
            path.mkdir()
        else:
            assert isinstance(record, bytes)
            path.write_bytes(record)
        (info,) = [info for info in list_series(LocalStorage(str(tmp_path))) if info.step == 2]
        assert info.good and info.metrics == {} and info.retention is None and info.time == time
        manager.save(3, _state(3), metrics={"loss": 0.9})
        assert manager.steps() == [1, 2, 3]  # 1 best by loss, 2 and 3 the newest
        manager.save(4, _state(4), metrics={"loss": 0.9})
        assert manager.steps() == [1, 3, 4]  # 2 was never ranked


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_retention_that_fails_is_retried_at_the_next_commit_not_at_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    calls = []

    def unreadable(*args: object) -> set[tuple[str, str]]:
        calls.append(args)
        raise PermissionError(errno.EACCES, "Permission denied", "an index")

    monkeypatch.setattr("shardwise.checkpoint.manager.deletion.protected_files", unreadable)
    policy = ckpt.SavePolicy(every_steps=10)
    retention = ckpt.RetentionPolicy(keep_last=1)
    with ckpt.CheckpointManager(
        tmp_path, save_policy=policy, retention=retention, async_save=async_save
    ) as manager:
        for step in range(1, 31):  # saves 10, 20, 30: each commit tries once
            if async_save and step in (15, 25):
                manager._in_flight.result()  # type: ignore[union-attr]  # committed by now
            manager.save(step, _state(step))
        manager.wait()
        assert manager.steps() == [10, 20, 30]  # nothing could be deleted
        assert len(calls) == 3


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_whose_lock_name_is_a_directory_fails_with_a_checkpoint_error(
    tmp_path: Path, async_save: bool
) -> None:
    (tmp_path / "step-00000005" / "shardwise.lock").mkdir(parents=True)
    with ckpt.CheckpointManager(tmp_path, async_save=async_save) as manager:
        with pytest.raises(ckpt.CheckpointStorageError, match="Is a directory") as caught:
            manager.save(5, _state(5))
            manager.wait()
        assert isinstance(caught.value.__cause__, IsADirectoryError)
        assert manager.save(6, _state(6))  # the next save goes on
        manager.wait()
        assert manager.steps() == [6]


def test_a_checkpoint_of_another_format_version_is_skipped_but_never_rejected(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        for step in (1, 2):
            manager.save(step, _state(step))
    document = h.read_document(root / "step-00000002")
    document["format_version"] = 6  # as a newer shardwise might write it
    h.write_resealed(root / "step-00000002", document)
    with ckpt.CheckpointManager(root, async_save=False) as manager:
        for _ in range(2):  # skipped each time, never marked: a newer shardwise reads it
            state = _state(0)
            with pytest.warns(ckpt.RestoreFallbackWarning, match="format version 6"):
                assert manager.restore(state) == 1
            assert state["step"] == 1
            assert not (root / "step-00000002" / REJECTED_NAME).exists()
        assert manager.steps() == [1, 2]
