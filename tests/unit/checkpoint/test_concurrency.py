"""Saves to one path run one at a time (the save lock), and the next save removes what killed
saves left behind, never a running save's files."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint import tuning as tuning_module
from shardwise.checkpoint.saving.lock import LOCK_NAME
from shardwise.checkpoint.storage import LocalStorage


def _lock(path: Path, pid: int, host: str | None = None, age: float = 0.0) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / LOCK_NAME).write_text(
        json.dumps(
            {
                "save_id": "0123456789abcdef",
                "host": host or socket.gethostname(),
                "pid": pid,
                "heartbeat": time.time() - age,
            }
        )
    )


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_running_save_keeps_a_second_one_out(tmp_path: Path) -> None:
    path = tmp_path / "c"
    ckpt.save({"w": torch.ones(3)}, path)
    _lock(path, os.getpid())  # a live process on this host, heartbeat fresh
    with pytest.raises(ckpt.CheckpointLockedError, match="another save to this path is running"):
        ckpt.save({"w": torch.zeros(3)}, path)
    target = {"w": torch.empty(3)}
    ckpt.load(target, path)  # the committed checkpoint is untouched
    assert torch.equal(target["w"], torch.ones(3))
    assert (path / LOCK_NAME).exists()  # the other save's lock is not ours to remove


@pytest.mark.parametrize(
    "kind",
    [
        "dead-process",
        "no-heartbeat",
        "garbage",
        "future-heartbeat",
        "bad-pid",
        "deep",
        "nan-heartbeat",  # was: never stale, so the path could never be saved again
        "huge-pid",  # was: OverflowError from os.kill
    ],
)
def test_the_lock_of_a_dead_save_is_taken_over(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "c"
    if kind == "dead-process":
        _lock(path, _dead_pid())
    elif kind == "nan-heartbeat":
        _lock(path, os.getpid(), age=math.nan)
    elif kind == "huge-pid":
        _lock(path, 2**40)
    elif kind == "no-heartbeat":
        _lock(path, 1, host="another-host", age=3600)
    elif kind == "future-heartbeat":
        _lock(path, 1, host="another-host", age=-(10**9))
    elif kind == "bad-pid":
        _lock(path, -1)
    elif kind == "deep":  # nested past the JSON parser's recursion limit
        path.mkdir()
        (path / LOCK_NAME).write_bytes(b"[" * 4000)
    else:
        path.mkdir()
        (path / LOCK_NAME).write_bytes(b"\x00 not json")
    ckpt.save({"w": torch.ones(3)}, path)
    assert not (path / LOCK_NAME).exists()
    target = {"w": torch.empty(3)}
    ckpt.load(target, path)
    assert torch.equal(target["w"], torch.ones(3))


def test_a_directory_in_place_of_the_lock_is_a_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "c"
    ckpt.save({"w": torch.ones(3)}, path)
    (path / LOCK_NAME).mkdir()
    (path / LOCK_NAME / "keep").write_text("x")
    with pytest.raises(ckpt.CheckpointStorageError, match="the save lock cannot be taken over"):
        ckpt.save({"w": torch.zeros(3)}, path)  # was: a bare IsADirectoryError
    assert (path / LOCK_NAME / "keep").read_text() == "x"
    target = {"w": torch.empty(3)}
    ckpt.load(target, path)
    assert torch.equal(target["w"], torch.ones(3))


def test_the_stale_limit_is_a_tunable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c"
    _lock(path, 1, host="another-host", age=60)  # a minute without a heartbeat
    tuning = tuning_module.TUNING
    monkeypatch.setattr(
        tuning_module, "TUNING", dataclasses.replace(tuning, lock_stale_seconds=120)
    )
    with pytest.raises(ckpt.CheckpointLockedError, match="taken over after 120 s"):
        ckpt.save({"w": torch.ones(3)}, path)
    monkeypatch.setattr(tuning_module, "TUNING", dataclasses.replace(tuning, lock_stale_seconds=30))
    ckpt.save({"w": torch.ones(3)}, path)
    assert not (path / LOCK_NAME).exists()


def test_leftovers_of_killed_saves_are_removed_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "c"
    ckpt.save({"w": torch.ones(3)}, path)
    data = path / "data"
    leftovers = [
        data / "rank-00000.aaaaaaaaaaaaaaaa.safetensors.tmp",  # a data file being written
        data / "rank-00001.bbbbbbbbbbbbbbbb.safetensors",  # written, never committed
        path / "shardwise.json.cccccccccccccccc.tmp",  # an index being written
        path / f"{LOCK_NAME}.{_dead_pid()}.140000000000000.tmp",  # a lock being written
    ]
    kept = [data / "notes.txt", data / "rank-00000.safetensors.bak", path / "README"]
    for file in leftovers + kept:
        file.write_bytes(b"x")
    ckpt.save({"w": torch.full((3,), 2.0)}, path)
    assert not any(file.exists() for file in leftovers)
    assert all(file.exists() for file in kept)
    assert not (path / LOCK_NAME).exists()


def _save_many(path: str, value: float, trials: int, results: multiprocessing.Queue) -> None:
    outcomes = []
    state = {"w": torch.full((256, 1024), value), "tag": value}
    for _ in range(trials):
        try:
            ckpt.save(state, path, sync_files=False)
            outcomes.append("saved")
        except ckpt.CheckpointLockedError:
            outcomes.append("locked")
    results.put(outcomes)


@pytest.mark.timeout(120)
def test_racing_saves_never_lose_the_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    trials = 15
    workers = [
        context.Process(target=_save_many, args=(path, value, trials, results))
        for value in (1.0, 2.0)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=100) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    flat = [outcome for worker_outcomes in outcomes for outcome in worker_outcomes]
    assert flat.count("saved") >= 1 and set(flat) <= {"saved", "locked"}
    # Whatever won last, the path holds one complete checkpoint, all of one save.
    target = {"w": torch.empty(256, 1024), "tag": None}
    ckpt.load(target, path)
    assert target["tag"] in (1.0, 2.0)
    assert torch.equal(target["w"], torch.full((256, 1024), target["tag"]))
    assert not Path(path, LOCK_NAME).exists()
    # Only the committed save's data files are left.
    named = set(ckpt.read_metadata(path).storage_meta.save_id or "")
    assert named
    left = os.listdir(Path(path, "data"))
    save_id = ckpt.read_metadata(path).storage_meta.save_id
    assert left and all(f".{save_id}." in name for name in left), left


def test_a_directory_sync_that_fails_after_the_commit_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync_dir = LocalStorage.sync_dir

    def failing(self: LocalStorage, path: str) -> None:
        if path == self.root:  # the index's directory, once the index is renamed into place
            raise OSError(5, "Input/output error")
        sync_dir(self, path)

    monkeypatch.setattr(LocalStorage, "sync_dir", failing)
    path = tmp_path / "c"
    with pytest.raises(ckpt.CheckpointDataError, match="the save committed but may not survive"):
        ckpt.save({"w": torch.ones(3)}, path)
    target = {"w": torch.empty(3)}
    ckpt.load(target, path)  # the index is in place: what was saved loads
    assert torch.equal(target["w"], torch.ones(3))
