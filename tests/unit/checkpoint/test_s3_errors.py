"""Storage failures on an object store are one line naming the URL and the cause in words
(``CheckpointStorageError``), for save, load, ``load_tensor`` and ``read_metadata`` (moto's S3
server in the pytest process; the environment holds no AWS settings, see ``tests/_s3.py``)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.errors import CheckpointError, CheckpointStorageError
from tests._s3 import S3Bucket, expected_state, s3_bucket, s3_server  # noqa: F401 (fixtures)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _every_operation(url: str, options: dict[str, Any]) -> list[BaseException]:
    """The error of a save, a load, ``load_tensor`` and ``read_metadata`` of ``url``."""
    errors = []
    for operation in (
        lambda: ckpt.save(expected_state(1), url, storage_options=options),
        lambda: ckpt.load({"w": torch.zeros(64, 1024)}, url, storage_options=options),
        lambda: ckpt.load_tensor(url, "w", storage_options=options),
        lambda: ckpt.read_metadata(url, storage_options=options),
    ):
        with pytest.raises(CheckpointError) as caught:
            operation()
        errors.append(caught.value)
    return errors


def _one_line(error: BaseException, url: str, cause: str) -> None:
    assert isinstance(error, CheckpointStorageError) and isinstance(error, OSError)
    message = str(error)
    assert message.startswith("cannot ") and f" {url}/" in message, message
    assert f": {cause} (" in message, message
    assert "\n" not in message


@pytest.mark.usefixtures("s3_endpoint")  # the session's environment: no AWS settings at all
def test_no_credentials(s3: S3Bucket) -> None:
    options = {k: v for k, v in s3.options.items() if k not in ("key", "secret")}
    url = s3.url("ckpt")
    for error in _every_operation(url, options):
        _one_line(error, url, "no credentials found")
        assert "give them in storage_options" in str(error)


def test_an_unreachable_endpoint() -> None:
    # One attempt per request (botocore retries a refused connection for seconds otherwise).
    options = {
        "endpoint_url": f"http://127.0.0.1:{_closed_port()}",
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    url = "s3://shardwise-nowhere/ckpt"
    for error in _every_operation(url, options):
        _one_line(error, url, "cannot reach the endpoint")
        assert "endpoint_url" in str(error)


def test_no_such_bucket(s3: S3Bucket) -> None:
    url = f"s3://{s3.name}-missing/ckpt"
    with pytest.raises(CheckpointStorageError) as caught:
        ckpt.save(expected_state(1), url, storage_options=s3.options)
    _one_line(caught.value, url, "no such bucket")
    assert "a save never creates buckets" in str(caught.value)
    # Reading finds nothing there, and says why.
    with pytest.raises(
        ckpt.CheckpointNotFoundError, match=f"there is no bucket '{s3.name}-missing'"
    ):
        ckpt.read_metadata(url, storage_options=s3.options)


def test_errors_in_a_storage_library_keep_their_cause(s3: S3Bucket) -> None:
    options = {k: v for k, v in s3.options.items() if k not in ("key", "secret")}
    with pytest.raises(CheckpointStorageError) as caught:
        ckpt.read_metadata(s3.url("ckpt"), storage_options=options)
    assert type(caught.value.__cause__).__name__ == "NoCredentialsError"
