"""An S3-compatible server for the tests, and tools to watch what shardwise asks of it.

moto's server mode (``moto.server.ThreadedMotoServer``, as s3fs's own tests use it) runs on
127.0.0.1, on a free port, in a thread of the pytest process, once per test session. Each test
gets a bucket of its own. Use it from a test module by importing the fixtures (a
``pytest_plugins`` entry would come after the module imported the helpers, too late for
pytest's assertion rewriting)::

    from tests._s3 import S3Bucket, s3_bucket, s3_server  # noqa: F401 (fixtures)

    def test_x(s3: S3Bucket) -> None:
        ckpt.save(state, s3.url("ckpt"), storage_options=s3.options)

Credentials and the endpoint travel in ``storage_options`` only (:attr:`S3Bucket.options`), so
worker processes of the distributed pool get them as arguments; nothing depends on the
environment's AWS settings: the session removes every ``AWS_*`` variable of the pytest process
and points botocore's configuration files at ``/dev/null``.

Run as ``python -m tests._s3 die-before-commit URL OPTIONS_JSON TAG`` (from the repository
root), this module is a save that is killed (SIGKILL, by itself) right before its commit: see
``tests/unit/checkpoint/test_s3_commit.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["S3Bucket", "S3Calls", "expected_state", "record_s3_calls", "s3_bucket", "s3_server"]

_KEY = _SECRET = "testing"
_REGION = "us-east-1"
_buckets = itertools.count()


@dataclass(frozen=True)
class S3Bucket:
    """A bucket of the test server (picklable: it goes to worker processes as it is)."""

    endpoint: str
    name: str

    @property
    def options(self) -> dict[str, Any]:
        """fsspec ``storage_options`` that reach the test server."""
        return {
            "endpoint_url": self.endpoint,
            "key": _KEY,
            "secret": _SECRET,
            "client_kwargs": {"region_name": _REGION},
        }

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts joined by />``."""
        return "/".join([f"s3://{self.name}", *parts])

    def filesystem(self) -> Any:
        """The s3fs file system that shardwise uses for :attr:`options` (fsspec caches
        instances: the same object)."""
        import fsspec

        return fsspec.filesystem("s3", **self.options)

    def keys(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` of the bucket (a fresh listing): key -> size."""
        fs = self.filesystem()
        fs.invalidate_cache()
        found = fs.find(f"{self.name}/{prefix}", detail=True)
        fs.invalidate_cache()
        return {
            path.removeprefix(f"{self.name}/"): int(info["size"]) for path, info in found.items()
        }


@pytest.fixture(scope="session", name="s3_endpoint")
def s3_server() -> Iterator[str]:
    """Fixture ``s3_endpoint``: the URL of the session's S3 server."""
    from moto.server import ThreadedMotoServer

    # The server logs every request through werkzeug: only errors are of interest.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as patch:
        for name in [name for name in os.environ if name.startswith("AWS_")]:
            patch.delenv(name)
        patch.setenv("AWS_CONFIG_FILE", os.devnull)
        patch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        patch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture(name="s3")
def s3_bucket(s3_endpoint: str) -> Iterator[S3Bucket]:
    """Fixture ``s3``: a new, empty bucket on the session's server; emptied and removed after
    the test."""
    bucket = S3Bucket(s3_endpoint, f"shardwise-test-{os.getpid()}-{next(_buckets)}")
    fs = bucket.filesystem()
    # Created with a plain call: s3fs's mkdir would name the region as a location
    # constraint, which us-east-1 does not accept.
    fs.call_s3("create_bucket", Bucket=bucket.name)
    fs.invalidate_cache()
    yield bucket
    fs.invalidate_cache()
    keys = fs.find(bucket.name)
    if keys:
        fs.rm(keys)
    fs.call_s3("delete_bucket", Bucket=bucket.name)
    fs.invalidate_cache()


@dataclass
class S3Calls:
    """The S3 calls one s3fs file system made while recorded, in the order they completed.

    Attributes:
        calls: ``(operation, key, bytes)``: bytes of the body a ``get_object`` returned (the
            requested range), or ``0``.
        listings: For every ``put_object`` of a key ending in ``watch`` (the index), the keys
            and sizes of the objects under ``<its directory>/data/`` right before it was sent.
        most_reads_in_flight: The most ``get_object`` calls that were under way at once.
        ranges: ``(key, first byte, last byte)`` of every ranged ``get_object``.
    """

    watch: str | None = None
    calls: list[tuple[str, str, int]] = field(default_factory=list)
    listings: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    most_reads_in_flight: int = 0
    reads_in_flight: int = 0
    ranges: list[tuple[str, int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bytes_read(self) -> int:
        """Bytes of every ``get_object`` body."""
        return sum(size for operation, _, size in self.calls if operation == "get_object")

    def requested_twice(self) -> int:
        """Bytes that more than one ``get_object`` asked for (by their ``Range`` headers)."""
        ranges: dict[str, list[tuple[int, int]]] = {}
        for key, first, last in self.ranges:
            ranges.setdefault(key, []).append((first, last + 1))
        twice = 0
        for spans in ranges.values():
            spans.sort()
            reached = 0
            for begin, end in spans:
                twice += max(0, min(end, reached) - begin)
                reached = max(reached, end)
        return twice

    def completed(self, *operations: str) -> list[str]:
        """The keys of the calls of ``operations``, in completion order."""
        return [key for operation, key, _ in self.calls if operation in operations]


@contextlib.contextmanager
def record_s3_calls(
    fs: Any, watch: str | None = None, forbid_buffered_reads: bool = True
) -> Iterator[S3Calls]:
    """Record the S3 calls of the s3fs file system ``fs`` (see :class:`S3Calls`).

    With ``forbid_buffered_reads``, opening a file for reading through fsspec (its buffered
    files read ahead whole blocks) raises AssertionError.
    """
    import fsspec.asyn

    record = S3Calls(watch)
    original: Callable[..., Awaitable[Any]] = fs._call_s3
    original_open = fs._open

    async def call(method: str, *args: Any, **kwargs: Any) -> Any:
        key = str(kwargs.get("Key", ""))
        if method == "put_object" and watch is not None and key.endswith(watch):
            prefix = key.rsplit("/", 1)[0] + "/data/"
            listed = await original("list_objects_v2", Bucket=kwargs["Bucket"], Prefix=prefix)
            present = {item["Key"]: int(item["Size"]) for item in listed.get("Contents", [])}
            with record.lock:
                record.listings.append((key, present))
        reading = method == "get_object"
        if reading:
            with record.lock:
                if "Range" in kwargs:  # "bytes=<first>-<last>"
                    first, last = str(kwargs["Range"]).removeprefix("bytes=").split("-")
                    record.ranges.append((key, int(first), int(last)))
                record.reads_in_flight += 1
                record.most_reads_in_flight = max(
                    record.most_reads_in_flight, record.reads_in_flight
                )
        try:
            result = await original(method, *args, **kwargs)
        finally:
            if reading:
                with record.lock:
                    record.reads_in_flight -= 1
        size = int(result.get("ContentLength", 0)) if reading else 0
        with record.lock:
            record.calls.append((method, key, size))
        return result

    def guarded_open(path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode:
            raise AssertionError(f"a buffered read of {path} through fsspec")
        return original_open(path, mode, *args, **kwargs)

    # s3fs calls the coroutine ``_call_s3`` itself, and its files call the synchronous
    # ``call_s3`` (bound to the original coroutine when the file system was made): both spied.
    sync_call = fs.call_s3
    fs._call_s3 = call
    fs.call_s3 = lambda *args, **kwargs: fsspec.asyn.sync(fs.loop, call, *args, **kwargs)
    if forbid_buffered_reads:
        fs._open = guarded_open
    try:
        yield record
    finally:
        del fs._call_s3
        fs.call_s3 = sync_call
        if forbid_buffered_reads:
            del fs._open


def expected_state(tag: int) -> dict[str, Any]:
    """A small state dict whose every value depends on ``tag``."""
    import torch

    return {
        "w": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024) + tag,
        "blob": bytes([tag % 256]) * 1000,
        "tag": tag,
    }


def _die_before_commit(url: str, options: dict[str, Any], tag: int) -> None:
    """Save ``expected_state(tag)`` and kill this process when the save is about to commit:
    every data object is written, the index is not."""
    import shardwise.checkpoint as ckpt

    # The package's ``save`` attribute is the function: the module is taken by its name.
    save_module = importlib.import_module("shardwise.checkpoint.saving.save")

    def die(*args: Any, **kwargs: Any) -> None:
        print("committing", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    save_module.commit_index = die  # type: ignore[assignment]
    ckpt.save(expected_state(tag), url, storage_options=options)
    raise AssertionError("the save returned: it should have been killed")


if __name__ == "__main__":
    command, url, options, tag = sys.argv[1:]
    assert command == "die-before-commit", command
    _die_before_commit(url, json.loads(options), int(tag))
