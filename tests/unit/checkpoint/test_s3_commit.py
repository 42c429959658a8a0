"""The commit on an object store, which has no rename (moto's S3 server, in the pytest process).

Data objects go under their final names (unique per save) and the index is written last, with
one PUT, once every data object exists: a reader never sees an index naming an object that is
not there. A save that fails or is killed before its commit leaves the previous checkpoint,
and the next save removes what it left. The save lock is created with a conditional PUT
(``If-None-Match: *``), so two saves that both find no lock cannot both take it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.saving.lock import LOCK_NAME
from shardwise.checkpoint.storage import FsspecStorage
from shardwise.checkpoint.storage import _fsspec as fsspec_module
from shardwise.errors import CheckpointStorageError
from tests._s3 import (  # noqa: F401 (fixtures)
    S3Bucket,
    expected_state,
    record_s3_calls,
    s3_bucket,
    s3_server,
)

INDEX = "shardwise.json"
REPOSITORY = Path(__file__).resolve().parents[3]


def _named_files(s3: S3Bucket, prefix: str) -> dict[str, int]:
    """The data objects the committed index at ``prefix`` names: key -> size."""
    index = json.loads(s3.filesystem().cat_file(f"{s3.name}/{prefix}/{INDEX}"))
    return {f"{prefix}/{row[0]}": row[1] for row in index["files"] if row is not None}


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(64, 1024), "blob": b"", "tag": -1}


def _load_tag(s3: S3Bucket, prefix: str) -> int:
    """The tag of the checkpoint at ``prefix``, after checking every value is that tag's."""
    state = _blank()
    ckpt.load(state, s3.url(prefix), storage_options=s3.options)
    tag = state["tag"]
    expected = expected_state(tag)
    assert torch.equal(state["w"], expected["w"]) and state["blob"] == expected["blob"]
    return int(tag)


def test_the_index_is_put_last_once_every_data_object_exists(s3: S3Bucket) -> None:
    # Parts of 5 MiB (the least S3 allows) make the 12 MiB data file a multipart upload: it
    # appears when the upload completes. A tensor of 3 MiB and a blob make the rest.
    options = {**s3.options, "default_block_size": 5 << 20}
    url = s3.url("ckpt")
    fs = fsspec.filesystem("s3", **options)
    big = torch.arange(3 << 20, dtype=torch.float32)
    for tag in (1, 2):
        state = {**expected_state(tag), "big": big + tag}
        with record_s3_calls(fs, watch=INDEX) as calls:
            ckpt.save(state, url, storage_options=options)
        named = _named_files(s3, "ckpt")
        assert len(named) == 1
        # Right before the index PUT, every object it names was there, complete.
        ((key, present),) = calls.listings
        assert key == f"ckpt/{INDEX}"
        assert {name: present.get(name) for name in named} == named
        writes = calls.completed("put_object", "complete_multipart_upload")
        assert writes.index(f"ckpt/{INDEX}") > max(writes.index(name) for name in named)
        assert "complete_multipart_upload" in {op for op, _, _ in calls.calls}
        # No rename (a copy, then a delete), no temporary object.
        assert not {op for op, _, _ in calls.calls} & {"copy_object", "upload_part_copy"}
        assert not [name for name in writes if name.endswith(".tmp")]
        # The previous save's data object is removed once the new index is in place.
        assert sorted(s3.keys("ckpt")) == sorted([f"ckpt/{INDEX}", *named])
    loaded = {**_blank(), "big": torch.zeros(3 << 20)}
    ckpt.load(loaded, url, storage_options=options)
    assert loaded["tag"] == 2 and torch.equal(loaded["big"], big + 2)


def test_a_save_failing_before_its_commit_leaves_the_previous_checkpoint(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3.url("ckpt")
    ckpt.save(expected_state(1), url, storage_options=s3.options)
    first = _named_files(s3, "ckpt")

    # The endpoint goes away when the index is sent: every data object is written, the
    # index is not.
    from botocore.exceptions import EndpointConnectionError

    fs = s3.filesystem()
    pipe_file = fs.pipe_file

    def failing(path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> Any:
        if path.endswith(INDEX):
            raise EndpointConnectionError(endpoint_url=f"{s3.endpoint}/{path}")
        return pipe_file(path, value, mode=mode, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(fs, "pipe_file", failing)
        with pytest.raises(CheckpointStorageError) as caught:
            ckpt.save(expected_state(2), url, storage_options=s3.options)
    message = str(caught.value)
    assert message.startswith(f"cannot write {url}/{INDEX}: cannot reach the endpoint")
    assert "\n" not in message
    assert _load_tag(s3, "ckpt") == 1
    stray = set(s3.keys("ckpt/data")) - set(first)
    assert len(stray) == 1  # the failed save's data object, under its final name
    assert f"ckpt/{LOCK_NAME}" not in s3.keys("ckpt")

    ckpt.save(expected_state(3), url, storage_options=s3.options)
    assert _load_tag(s3, "ckpt") == 3
    assert sorted(s3.keys("ckpt")) == sorted([f"ckpt/{INDEX}", *_named_files(s3, "ckpt")])


def test_a_save_killed_before_its_commit_leaves_the_previous_checkpoint(s3: S3Bucket) -> None:
    url = s3.url("ckpt")
    ckpt.save(expected_state(1), url, storage_options=s3.options)
    first = _named_files(s3, "ckpt")
    # A process saves tag 2 and is killed (SIGKILL) right before it would commit.
    done = subprocess.run(
        [sys.executable, "-m", "tests._s3", "die-before-commit", url, json.dumps(s3.options), "2"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == -9, done.stderr[-3000:]
    assert done.stdout.strip() == "committing"
    left = s3.keys("ckpt")
    assert f"ckpt/{LOCK_NAME}" in left  # its lock: a dead process's, taken over below
    stray = set(s3.keys("ckpt/data")) - set(first)
    assert len(stray) == 1
    assert _load_tag(s3, "ckpt") == 1

    ckpt.save(expected_state(3), url, storage_options=s3.options)
    assert _load_tag(s3, "ckpt") == 3
    assert sorted(s3.keys("ckpt")) == sorted([f"ckpt/{INDEX}", *_named_files(s3, "ckpt")])


def test_two_saves_that_both_find_no_lock_cannot_both_take_it(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both saves look for the lock before either creates it (a barrier holds the first two
    # lookups), then both create it: the store's conditional create lets one of them in.
    # (moto checks the condition and stores the object in two steps, so the test lets one
    # PUT through at a time, as S3 itself decides them.)
    url = s3.url("ckpt")
    fs = s3.filesystem()
    exists, pipe_file = fs.exists, fs.pipe_file
    barrier = threading.Barrier(2, timeout=30)
    one_put_at_a_time = threading.Lock()
    lookups = [0]

    def racing_exists(path: str, **kwargs: Any) -> bool:
        found = bool(exists(path, **kwargs))
        if path.endswith(LOCK_NAME):
            with one_put_at_a_time:
                lookups[0] += 1
                first_two = lookups[0] <= 2
            if first_two:
                barrier.wait()
        return found

    def serial_pipe_file(path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> Any:
        with one_put_at_a_time:
            return pipe_file(path, value, mode=mode, **kwargs)

    monkeypatch.setattr(fs, "pipe_file", serial_pipe_file)
    monkeypatch.setattr(fs, "exists", racing_exists)
    outcomes: dict[int, BaseException | None] = {}

    def save(tag: int) -> None:
        try:
            ckpt.save(expected_state(tag), url, storage_options=s3.options)
            outcomes[tag] = None
        except BaseException as err:
            outcomes[tag] = err

    threads = [threading.Thread(target=save, args=(tag,)) for tag in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(outcomes) == [1, 2]
    (winner,) = [tag for tag, error in outcomes.items() if error is None]
    (loser,) = [error for error in outcomes.values() if error is not None]
    assert isinstance(loser, ckpt.CheckpointLockedError), repr(loser)
    assert "another save to this path is running" in str(loser)
    assert _load_tag(s3, "ckpt") == winner
    assert f"ckpt/{LOCK_NAME}" not in s3.keys("ckpt")


def test_the_lock_is_created_with_a_conditional_put(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Even when the lookup misses a lock that exists (a race), the create is refused.
    storage = FsspecStorage(s3.url("ckpt"), s3.options)
    path = storage.join(LOCK_NAME)
    assert storage.create_exclusive(path, b"first")
    with monkeypatch.context() as patch:
        patch.setattr(storage.fs, "exists", lambda *args, **kwargs: False)
        assert not storage.create_exclusive(path, b"second")
    assert storage.read_small(path, 100) == b"first"


def test_without_a_conditional_create_the_lock_is_a_check_then_a_write(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fsspec_module, "_has_create_mode", lambda fs: False)
    storage = FsspecStorage(s3.url("ckpt"), s3.options)
    path = storage.join(LOCK_NAME)
    with record_s3_calls(storage.fs) as calls:
        assert storage.create_exclusive(path, b"first")
        assert not storage.create_exclusive(path, b"second")
    assert storage.read_small(path, 100) == b"first"
    assert calls.completed("put_object") == [f"ckpt/{LOCK_NAME}"]


def test_data_and_index_names_on_an_object_store(s3: S3Bucket) -> None:
    # Everything the save wrote is under its final name: the index and one data object.
    metadata = ckpt.save(expected_state(1), s3.url("ckpt"), storage_options=s3.options)
    save_id = metadata.storage_meta.save_id
    assert sorted(s3.keys("ckpt")) == [
        f"ckpt/data/rank-00000.{save_id}.safetensors",
        f"ckpt/{INDEX}",
    ]


def test_a_failed_write_leaves_no_object_and_no_upload(s3: S3Bucket) -> None:
    # 12 MiB written with 5 MiB blocks: a multipart upload has begun before the failure.
    # Giving the file up aborts it; nothing appears under the name.
    options = {**s3.options, "default_block_size": 5 << 20}
    storage = FsspecStorage(s3.url("ckpt"), options)
    path = storage.join("data", "rank-00000.0123456789abcdef.safetensors")
    writer = storage.open_write(path)
    with record_s3_calls(storage.fs) as calls:
        writer.write(b"x" * (12 << 20))
        writer.abort()
    assert "upload_part" in {op for op, _, _ in calls.calls}
    assert "abort_multipart_upload" in {op for op, _, _ in calls.calls}
    assert s3.keys("ckpt") == {}
    assert "Uploads" not in storage.fs.call_s3("list_multipart_uploads", Bucket=s3.name)
