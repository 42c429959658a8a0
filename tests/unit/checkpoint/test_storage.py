"""The storage layer on its own: batched positioned reads (local threads, fsspec
``cat_ranges`` in bounded batches), storage-library errors in words, the reader's kept verified
bytes, and writers that give a file up without leaving it behind."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import Any

import fsspec
import pytest
from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from shardwise.checkpoint import tuning as tuning_module
from shardwise.checkpoint.storage import (
    FsspecStorage,
    LocalStorage,
    RangeRequest,
    UnsafePathError,
    describe_storage_error,
    open_storage,
)
from shardwise.checkpoint.tuning import TUNING
from shardwise.errors import CheckpointError, CheckpointStorageError

DATA = bytes(range(256)) * 40000  # 10 MB


@pytest.fixture
def memory_url() -> Any:
    fs = fsspec.filesystem("memory")
    url = f"memory://shardwise-storage-{os.getpid()}"
    fs.mkdir(url.removeprefix("memory://"))
    yield url
    fs.rm(url.removeprefix("memory://"), recursive=True)


SPANS = [(0, 10), (5, 3 << 20), (len(DATA) - 100, 100), (1000, 0), (len(DATA) - 50, 500)]
COUNTS = [10, 3 << 20, 100, 0, 50]  # the last request runs past the end: a short count


def _check_reads(storage: Any, path: str) -> None:
    reader = storage.open_reader(path)
    # Into given buffers; ``then`` sees each request once, with its bytes.
    requests = [
        RangeRequest(reader, start, length, memoryview(bytearray(length)))
        for start, length in SPANS
    ]
    seen: dict[int, bytes] = {}
    counts = storage.read_ranges(requests, lambda number, data: seen.update({number: bytes(data)}))
    assert counts == COUNTS
    for number, (request, count) in enumerate(zip(requests, counts, strict=True)):
        expected = DATA[request.offset : request.offset + count]
        assert request.buffer is not None and bytes(request.buffer[:count]) == expected
        assert seen[number] == expected
    # Into new buffers, handed to ``then``.
    unbuffered = [RangeRequest(reader, start, length) for start, length in SPANS]
    seen.clear()
    counts = storage.read_ranges(
        unbuffered, lambda number, data: seen.update({number: bytes(data)})
    )
    assert counts == COUNTS
    assert seen == {n: DATA[start : start + COUNTS[n]] for n, (start, _) in enumerate(SPANS)}


def test_local_batched_reads(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(DATA)
    storage = LocalStorage(tmp_path)
    _check_reads(storage, storage.join("f"))


def test_a_failed_local_read_names_its_file(tmp_path: Path) -> None:
    class Broken:
        path = str(tmp_path / "broken")
        size = 100

        def read_into(self, offset: int, buffer: memoryview) -> int:
            raise OSError(errno.EIO, "Input/output error")

        def close(self) -> None:
            return None

    with pytest.raises(OSError) as caught:
        LocalStorage(tmp_path).read_ranges([RangeRequest(Broken(), 0, 4)])
    assert caught.value.filename == str(tmp_path / "broken")


def test_fsspec_batched_reads_are_pieces_in_bounded_batches(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = FsspecStorage(memory_url)
    path = storage.join("f")
    storage.replace_small(path, DATA)
    small = dataclasses.replace(TUNING, request_bytes=1 << 20, storage_batch_bytes=2 << 20)
    monkeypatch.setattr(tuning_module, "TUNING", small)
    batches: list[list[int]] = []
    cat_ranges = storage.fs.cat_ranges

    def spy(paths: list[str], starts: list[int], ends: list[int], **kwargs: Any) -> Any:
        batches.append([end - start for start, end in zip(starts, ends, strict=True)])
        return cat_ranges(paths, starts, ends, **kwargs)

    monkeypatch.setattr(storage.fs, "cat_ranges", spy)
    _check_reads(storage, path)
    # Every request is cut into pieces of at most 1 MiB, asked for at most 2 MiB at a time;
    # nothing is asked for past the end of the file, and nothing for an empty request.
    assert all(sum(batch) <= 2 << 20 and max(batch) <= 1 << 20 for batch in batches)
    assert sum(map(sum, batches)) == 2 * sum(COUNTS)


def test_fsspec_failures_name_the_url_and_the_cause(memory_url: str) -> None:
    storage = FsspecStorage(memory_url)
    path = storage.join("f")
    storage.replace_small(path, b"x" * 10)
    reader = storage.open_reader(path)

    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(errno.EACCES, "Access Denied")

    storage.fs.cat_ranges = denied
    storage.fs.cat_file = denied
    try:
        with pytest.raises(CheckpointStorageError) as caught:
            storage.read_ranges([RangeRequest(reader, 0, 4)])
        assert str(caught.value) == (
            f"cannot read {memory_url}/f: permission denied (PermissionError: [Errno 13] "
            "Access Denied)"
        )
        with pytest.raises(CheckpointStorageError, match=r"cannot read .*: permission denied"):
            storage.read_into(path, 0, memoryview(bytearray(4)))
    finally:
        del storage.fs.cat_ranges, storage.fs.cat_file
    # What callers act on stays as it is.
    with pytest.raises(FileNotFoundError):
        storage.open_reader(storage.join("missing"))
    assert storage.listdir(storage.join("missing")) == []
    storage.remove(storage.join("missing"))


def _client_error(code: str, message: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}}, "GetObject")


def _translated(error: ClientError, kind: type[OSError]) -> OSError:
    """As s3fs raises it: a Python error, the ClientError its cause."""
    translated = kind(error.response["Error"]["Message"])
    translated.__cause__ = error
    return translated


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (NoCredentialsError(), "no credentials found (NoCredentialsError: Unable to locate "),
        (EndpointConnectionError(endpoint_url="http://h:1/b"), "cannot reach the endpoint ("),
        (ConnectTimeoutError(endpoint_url="http://h:1/b"), "cannot reach the endpoint ("),
        (ConnectionRefusedError(111, "Connection refused"), "cannot reach the endpoint ("),
        (ReadTimeoutError(endpoint_url="http://h:1/b"), "the request timed out ("),
        (TimeoutError(), "the request timed out (TimeoutError)"),
        (_client_error("AccessDenied", "Access Denied"), "permission denied (ClientError: "),
        (
            _translated(_client_error("AccessDenied", "Access Denied"), PermissionError),
            "permission denied (PermissionError: Access Denied)",
        ),
        (
            _translated(_client_error("InvalidAccessKeyId", "No such key id"), PermissionError),
            "permission denied: the credentials were refused (PermissionError: No such key",
        ),
        (
            _translated(_client_error("NoSuchBucket", "The bucket is gone"), FileNotFoundError),
            "no such bucket (FileNotFoundError: The bucket is gone); create it first",
        ),
        (
            FileNotFoundError("The specified bucket does not exist"),
            "no such bucket (FileNotFoundError: The specified bucket does not exist)",
        ),
        (OSError(errno.EIO, "Internal Error"), "the storage failed (OSError: [Errno 5] Internal "),
    ],
)
def test_storage_errors_in_words(error: BaseException, expected: str) -> None:
    text = describe_storage_error(error)
    assert text.startswith(expected), text
    assert "\n" not in text


def test_a_storage_error_is_a_checkpoint_error_and_an_os_error(memory_url: str) -> None:
    storage = FsspecStorage(memory_url)
    error = storage.failure(NoCredentialsError(), "read", storage.join("x"))
    assert isinstance(error, CheckpointError) and isinstance(error, OSError)
    assert str(error).startswith(f"cannot read {memory_url}/x: no credentials found")


def test_long_messages_are_cut() -> None:
    text = describe_storage_error(OSError("x" * 1000))
    assert len(text) < 400 and text.endswith("...)")


def test_a_local_writer_gives_its_file_up(tmp_path: Path) -> None:
    storage = open_storage(tmp_path)
    writer = storage.open_write(storage.join("f.tmp"))
    writer.write(b"partial")
    writer.abort()
    assert os.listdir(tmp_path) == []


def test_an_fsspec_writer_gives_its_file_up(memory_url: str) -> None:
    storage = FsspecStorage(memory_url)
    writer = storage.open_write(storage.join("f"))
    writer.write(b"partial")
    writer.abort()
    assert storage.listdir(storage.root) == []


def test_object_stores_have_buckets_and_no_directories_to_make(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = FsspecStorage("s3://a-bucket/some/ckpt", {"anon": True})
    assert storage.bucket == "a-bucket" and storage.remote and not storage.atomic_rename
    assert storage.url(storage.join("x")) == "s3://a-bucket/some/ckpt/x"

    def no_calls(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a save never creates a bucket or a directory on an object store")

    monkeypatch.setattr(storage.fs, "makedirs", no_calls)
    storage.makedirs(storage.join("data"))
    memory = FsspecStorage("memory://x")
    assert memory.bucket is None and not memory.remote and memory.process_local


# Scatter reads: buffers of every size (empty ones too), more than one preadv takes at once.
_VECTOR_SIZES = [0, 1, 7, 4096, 0, 65536, 3, *([5] * 1500), 1 << 20]


def _check_vector(storage: Any, path: str) -> None:
    reader = storage.open_reader(path)
    try:
        buffers = [memoryview(bytearray(size)) for size in _VECTOR_SIZES]
        assert reader.read_vector(123, buffers) == sum(_VECTOR_SIZES)
        assert b"".join(bytes(b) for b in buffers) == DATA[123 : 123 + sum(_VECTOR_SIZES)]
        # At the end of the file: short, the buffers filled in turn up to it.
        tail = [memoryview(bytearray(60)), memoryview(bytearray(60)), memoryview(bytearray(9))]
        assert reader.read_vector(len(DATA) - 100, tail) == 100
        assert bytes(tail[0]) + bytes(tail[1][:40]) == DATA[-100:]
        assert bytes(tail[1][40:]) == bytes(20) and bytes(tail[2]) == bytes(9)
    finally:
        reader.close()


def test_local_scatter_reads(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(DATA)
    storage = LocalStorage(tmp_path)
    _check_vector(storage, storage.join("f"))


def _first_bytes(buffers: list[memoryview], call: int) -> list[memoryview]:
    """The leading part of ``buffers`` that the ``call``-th short I/O call takes: a few bytes
    to a few KiB, varying from call to call."""
    taken, left = [], 1 + (call * 7919) % 5000
    for buffer in buffers:
        if left <= 0:
            break
        taken.append(buffer[:left])
        left -= len(taken[-1])
    return taken


def test_local_scatter_reads_go_on_after_short_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preadv may return fewer bytes than asked for (a signal, a pipe-like file system):
    the read goes on from there, inside a buffer or at the next one."""
    (tmp_path / "f").write_bytes(DATA)
    real = os.preadv
    counts: list[int] = []

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        counts.append(real(fd, _first_bytes(buffers, len(counts)), offset))
        return counts[-1]

    monkeypatch.setattr(os, "preadv", short)
    storage = LocalStorage(tmp_path)
    reader = storage.open_reader(storage.join("f"))
    try:
        buffers = [memoryview(bytearray(size)) for size in (3, 10000, 0, 1, 20000, 6)]
        assert reader.read_vector(77, buffers) == 30010
        assert b"".join(bytes(b) for b in buffers) == DATA[77 : 77 + 30010]
    finally:
        reader.close()
    assert len(counts) > 5


def test_fsspec_scatter_reads_read_once_and_copy(memory_url: str) -> None:
    storage = FsspecStorage(memory_url)
    path = storage.join("f")
    storage.replace_small(path, DATA)
    _check_vector(storage, path)


def test_local_vector_writes_go_on_after_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writev may write fewer bytes than given (a signal, a full pipe) and takes at most
    IOV_MAX buffers: the write goes on from where it stopped, inside a buffer or at the next,
    and more buffers than IOV_MAX go out in several calls."""
    real = os.writev
    calls: list[int] = []

    def short(fd: int, buffers: list[memoryview]) -> int:
        assert len(buffers) <= 1024
        calls.append(real(fd, _first_bytes(buffers, len(calls))))
        return calls[-1]

    monkeypatch.setattr(os, "writev", short)
    storage = LocalStorage(tmp_path)
    writer = storage.open_write(storage.join("f"))
    parts = [DATA[i : i + n] for i, n in ((0, 3), (3, 0), (3, 10000), (10003, 1))]
    parts += [bytes([i % 251]) * (i % 7) for i in range(1500)]  # more than IOV_MAX
    writer.write_vector([memoryview(part) for part in parts])
    writer.close(sync=False)
    assert (tmp_path / "f").read_bytes() == b"".join(parts)
    assert len(calls) > 5


def test_fsspec_vector_writes(memory_url: str) -> None:
    storage = FsspecStorage(memory_url)
    writer = storage.open_write(storage.join("f"))
    writer.write_vector([b"ab", memoryview(b""), bytearray(b"cde")])
    writer.close(sync=False)
    assert storage.read_small(storage.join("f"), 100) == b"abcde"


def test_looking_at_a_file_follows_no_link_below_the_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"12345")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "data").symlink_to(outside)
    storage = open_storage(root)
    for look in (storage.exists, storage.size, storage.sync_dir):
        with pytest.raises(UnsafePathError):
            look(storage.join("data", "secret"))
