"""The DCP storage plugins in one process: what ``dcp.save`` writes through ``StorageWriter``
is a shardwise checkpoint of every value kind (``load`` gives back the same nested state dict,
int keys and all); ``StorageReader`` refuses a hostile index with ``load``'s own error before
DCP runs, pickles only when asked, refuses another dtype unless asked, and both work on an
object store (the moto server)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.dcp import StorageReader, StorageWriter
from shardwise.checkpoint.index import decode_index
from shardwise.checkpoint.saving import save as _save
from shardwise.checkpoint.saving import writer as data_writer
from shardwise.checkpoint.saving.lock import wait_for_cleanup
from shardwise.checkpoint.storage import open_storage
from shardwise.cli import main
from tests._hostile import index_bytes, read_document, reseal_bytes, write_index, write_resealed
from tests._s3 import S3Bucket, s3_bucket, s3_server  # noqa: F401 (fixtures)


@pytest.fixture(autouse=True)
def _alone() -> Iterator[None]:
    """DCP warns that one process saves and loads alone: these tests mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp": torch.full((3, 4), 0.5)}}},
        "step": 7,
        "name": "run-1",
        "nested": {"lr": [0.1, 0.01], "flags": {"a": True, "b": None}},
        "blob": b"\x00raw bytes",
        "buffer": io.BytesIO(b"stream"),
    }


def _blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(0.0), "exp": torch.zeros(3, 4)}}},
        "step": 0,
        "name": "",
        "nested": {"lr": [0.0, 0.0], "flags": {"a": False, "b": 1}},
        "blob": b"",
        "buffer": io.BytesIO(),
    }


def _check(state: dict[str, Any]) -> None:
    expected = _state()
    assert torch.equal(state["model"]["w"], expected["model"]["w"])
    assert torch.equal(state["model"]["b"], expected["model"]["b"])
    assert state["model"]["b"].dtype == torch.bfloat16
    assert torch.equal(state["optim"]["state"][0]["exp"], expected["optim"]["state"][0]["exp"])
    assert state["optim"]["state"][0]["step"].item() == 3.0
    assert (state["step"], state["name"]) == (7, "run-1")
    assert state["nested"] == expected["nested"]
    assert state["blob"] == b"\x00raw bytes"
    assert state["buffer"].getvalue() == b"stream"


def test_dcp_save_writes_a_shardwise_checkpoint_and_dcp_load_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=StorageWriter(path))
    assert sorted(os.listdir(path)) == ["data", "shardwise.json"]  # no .metadata, no pickle
    assert main(["verify", str(path)]) == 0
    loaded = _blank()
    result = ckpt.load(loaded, path)  # the nested state dict, int keys of optimizers included
    assert not result.missing_keys and not result.unexpected_keys
    _check(loaded)
    through_dcp = _blank()
    dcp.load(through_dcp, storage_reader=StorageReader(path))
    _check(through_dcp)


def test_shardwise_save_loads_through_dcp_with_int_keys(tmp_path: Path) -> None:
    ckpt.save(_state(), tmp_path / "ckpt")
    state = _blank()
    dcp.load(state, storage_reader=StorageReader(tmp_path / "ckpt"))
    _check(state)


def _open_files_under(directory: Path) -> list[str]:
    """The files below ``directory`` this process holds open (Linux: /proc/self/fd)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # an fd closed while listing
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{directory}{os.sep}"):
                found.append(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")
def test_a_load_leaves_no_data_file_open(tmp_path: Path) -> None:
    # DCP has no close step and a reader may outlive the load (a reference cycle, a frozen
    # collector): its open data files would keep a later save's replaced files in memory.
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=StorageWriter(path))
    reader = StorageReader(path)
    state = _blank()
    dcp.load(state, storage_reader=reader)
    _check(state)
    assert _open_files_under(path) == []
    dcp.load(state, storage_reader=reader)  # the same reader loads again: files reopen
    _check(state)
    assert _open_files_under(path) == []


def _data_files(path: Path) -> list[str]:
    return sorted(os.listdir(path / "data"))


def _named_files(path: Path) -> list[str]:
    index = decode_index((path / "shardwise.json").read_bytes())
    return sorted(name.removeprefix("data/") for name in index.files)


def test_a_second_save_removes_the_firsts_files_after_dcp_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP's last exchange waits for finish: the earlier save's files go in a thread that
    # holds the lock, and the next save of this process to the path waits for it before
    # any rank writes (its cleanup removes temporary data files).
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=StorageWriter(path))
    first = _data_files(path)
    release = threading.Event()
    events: list[str] = []
    remove_files = _save.remove_files
    write_data_file = data_writer.write_data_file

    def slow_removal(storage: Any, paths: list[str]) -> None:
        events.append("cleanup starts")
        assert release.wait(10)
        remove_files(storage, paths)
        events.append("cleanup ends")

    def recorded_write(*args: Any, **kwargs: Any) -> Any:
        events.append("write")
        return write_data_file(*args, **kwargs)

    monkeypatch.setattr(_save, "remove_files", slow_removal)
    monkeypatch.setattr(data_writer, "write_data_file", recorded_write)
    dcp.save(_state(), storage_writer=StorageWriter(path))  # returns, the cleanup pending
    second = _named_files(path)
    assert events == ["write", "cleanup starts"]
    assert (path / "shardwise.lock").exists()  # held by the cleanup
    assert set(first) <= set(_data_files(path))
    third = threading.Thread(
        target=lambda: dcp.save(_state(), storage_writer=StorageWriter(path)), daemon=True
    )
    third.start()
    third.join(0.3)
    assert third.is_alive() and events == ["write", "cleanup starts"]  # waits, writes nothing
    release.set()
    third.join(30)
    assert not third.is_alive()
    assert events[:4] == ["write", "cleanup starts", "cleanup ends", "write"]
    wait_for_cleanup(open_storage(str(path)))
    assert not set(first) & set(_data_files(path)) and not set(second) & set(_data_files(path))
    assert _data_files(path) == _named_files(path)
    assert sorted(os.listdir(path)) == ["data", "shardwise.json"]  # the lock released
    _check(_loaded(path))


def _loaded(path: Path) -> dict[str, Any]:
    state = _blank()
    dcp.load(state, storage_reader=StorageReader(path))
    return state


def test_a_shardwise_save_waits_for_the_cleanup_of_a_dcp_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=StorageWriter(path))
    release = threading.Event()
    remove_files = _save.remove_files
    ended: list[float] = []

    def slow_removal(storage: Any, paths: list[str]) -> None:
        assert release.wait(10)
        remove_files(storage, paths)
        ended.append(time.monotonic())

    monkeypatch.setattr(_save, "remove_files", slow_removal)
    dcp.save(_state(), storage_writer=StorageWriter(path))
    threading.Timer(0.3, release.set).start()
    # The lock is this live process's: without the wait this would be CheckpointLockedError.
    ckpt.save(_state(), path)
    assert ended and ended[0] <= time.monotonic()
    assert _data_files(path) == _named_files(path)
    _check(_loaded(path))


def test_a_failed_cleanup_is_logged_and_releases_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=StorageWriter(path))

    def failing(storage: Any, paths: list[str]) -> None:
        raise RuntimeError("the mount went away")

    monkeypatch.setattr(_save, "remove_files", failing)
    with caplog.at_level(logging.WARNING, "shardwise.checkpoint.lock"):
        dcp.save(_state(), storage_writer=StorageWriter(path))
        wait_for_cleanup(open_storage(str(path)))
    assert "the mount went away" in caplog.text
    assert not (path / "shardwise.lock").exists()
    _check(_loaded(path))  # committed and complete: the stale files only cost space


def test_checkpoint_id_replaces_the_path(tmp_path: Path) -> None:
    writer = StorageWriter(tmp_path / "unused")
    dcp.save(_state(), checkpoint_id=tmp_path / "chosen", storage_writer=writer)
    assert not (tmp_path / "unused").exists() and (tmp_path / "chosen" / "shardwise.json").exists()
    reader = StorageReader(tmp_path / "chosen")
    ckpt.save({"model": {"w": torch.ones(3, 4)}}, tmp_path / "other")
    state = {"model": {"w": torch.zeros(3, 4)}}
    dcp.load(state, checkpoint_id=tmp_path / "other", storage_reader=reader)
    assert torch.equal(state["model"]["w"], torch.ones(3, 4))
    assert StorageReader.validate_checkpoint_id(tmp_path / "other")
    assert not StorageReader.validate_checkpoint_id(tmp_path / "nothing")
    assert StorageWriter.validate_checkpoint_id(tmp_path / "new")
    assert not StorageWriter.validate_checkpoint_id(3)  # type: ignore[arg-type]


def _causes(call: Callable[[], object]) -> list[BaseException]:
    with pytest.raises(CheckpointException) as caught:
        call()
    return [cause for cause, _ in caught.value.failures.values()]


def test_pickle_only_when_asked_on_both_sides(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "odd": {1, 2, 3}}  # a set has no form without pickle
    (cause,) = _causes(lambda: dcp.save(state, storage_writer=StorageWriter(tmp_path / "no")))
    assert isinstance(cause, TypeError) and "'odd'" in str(cause) and "without pickle" in str(cause)
    assert not (tmp_path / "no" / "shardwise.json").exists()
    path = tmp_path / "yes"
    dcp.save(state, storage_writer=StorageWriter(path, allow_pickle=True))
    with pytest.raises(ckpt.PickleNotAllowedError):
        ckpt.load({"w": torch.zeros(2), "odd": None}, path)
    target: dict[str, Any] = {"w": torch.zeros(2), "odd": None}
    (cause,) = _causes(lambda: dcp.load(target, storage_reader=StorageReader(path)))
    assert isinstance(cause, ckpt.PickleNotAllowedError) and target["odd"] is None
    dcp.load(target, storage_reader=StorageReader(path, allow_pickle=True))
    assert target["odd"] == {1, 2, 3}


def test_another_dtype_is_refused_unless_a_cast_is_asked_for(tmp_path: Path) -> None:
    ckpt.save({"w": torch.arange(4.0)}, tmp_path / "ckpt")
    target = {"w": torch.zeros(4, dtype=torch.float16)}
    (cause,) = _causes(lambda: dcp.load(target, storage_reader=StorageReader(tmp_path / "ckpt")))
    assert isinstance(cause, ckpt.CheckpointMismatchError) and "allow_dtype_cast" in str(cause)
    assert not target["w"].any()
    reader = StorageReader(tmp_path / "ckpt", allow_dtype_cast=True)
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["w"], torch.arange(4.0, dtype=torch.float16))


def _hostile(case: str, path: Path) -> None:
    """Make the checkpoint at ``path`` hostile in the way ``case`` names."""
    if case == "no index":
        (path / "shardwise.json").unlink()
    elif case == "broken seal":
        data = bytearray(index_bytes(path))
        data[20] ^= 1
        write_index(path, bytes(data))
    elif case == "unknown version":
        document = read_document(path)
        document["format_version"] = 99
        write_resealed(path, document)
    elif case == "file outside":
        document = read_document(path)
        document["files"][0][0] = "../../elsewhere/data/rank-00000.0123456789abcdef.safetensors"
        write_resealed(path, document)
    elif case == "chunks not tiling":
        document = read_document(path)
        document["tensors"][0][2] = [5, 4]
        write_resealed(path, document)
    elif case == "deep nesting":
        data = index_bytes(path)
        write_index(path, reseal_bytes(b"[" * 5000 + data[5000:]))
    elif case == "a link":
        outside = path.parent / "outside.json"
        outside.write_bytes(index_bytes(path))
        (path / "shardwise.json").unlink()
        (path / "shardwise.json").symlink_to(outside)


_CASES = [
    "no index",
    "broken seal",
    "unknown version",
    "file outside",
    "chunks not tiling",
    "deep nesting",
    "a link",
]


@pytest.mark.parametrize("case", _CASES)
def test_a_hostile_index_gives_the_same_error_through_the_reader_as_through_load(
    tmp_path: Path, case: str
) -> None:
    path = tmp_path / "ckpt"
    ckpt.save({"w": torch.arange(12.0).reshape(3, 4), "n": 1}, path)
    _hostile(case, path)
    with pytest.raises(ckpt.CheckpointError) as through_load:
        ckpt.load({"w": torch.zeros(3, 4), "n": 0}, path)
    with pytest.raises(ckpt.CheckpointError) as through_reader:
        StorageReader(path)
    assert type(through_reader.value) is type(through_load.value)
    assert str(through_reader.value) == str(through_load.value)


def test_the_plugins_on_an_object_store(s3: S3Bucket) -> None:
    url = s3.url("dcp-ckpt")
    dcp.save(_state(), storage_writer=StorageWriter(url, storage_options=s3.options))
    state = _blank()
    dcp.load(state, storage_reader=StorageReader(url, storage_options=s3.options))
    _check(state)
    again = _blank()
    ckpt.load(again, url, storage_options=s3.options)
    _check(again)
