"""The error tree is closed: every exception a user can catch lives in ``shardwise.errors``
and is exported; a format version this shardwise does not read is its own type
(``CheckpointVersionError``), not a message to match; another rank's error of an unknown
type is a ``RemoteError``."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as ckpt
import shardwise.errors as errors
from shardwise.collectives.failures import describe_error, rebuild_error
from tests._hostile import read_document, write_resealed


def test_every_exception_of_the_tree_is_exported() -> None:
    defined = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
    }
    assert defined == set(errors.__all__)
    checkpoint_errors = {
        name for name in defined if issubclass(getattr(errors, name), ckpt.CheckpointError)
    }
    assert checkpoint_errors | {"RemoteError"} <= set(ckpt.__all__)
    assert set(errors.CHECKPOINT_ERRORS) == checkpoint_errors


def test_an_unknown_format_version_is_a_version_error_not_a_message(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ckpt.save({"w": torch.ones(2)}, path)
    document = read_document(path)
    document["format_version"] = 99
    write_resealed(path, document)
    with pytest.raises(ckpt.CheckpointVersionError) as caught:
        ckpt.read_metadata(path)
    assert isinstance(caught.value, ckpt.CheckpointFormatError) and isinstance(
        caught.value, ValueError
    )
    assert caught.value.file is not None and caught.value.file.endswith("shardwise.json")
    document["format_version"] = 4
    document["tensors"] = "not a list"
    write_resealed(path, document)
    with pytest.raises(ckpt.CheckpointFormatError) as corrupt:
        ckpt.read_metadata(path)
    assert not isinstance(corrupt.value, ckpt.CheckpointVersionError)


def test_errors_cross_ranks_with_their_type() -> None:
    version = ckpt.CheckpointVersionError("unsupported checkpoint format version 9", file="x")
    rebuilt = rebuild_error(describe_error(version), 1)
    assert type(rebuilt) is ckpt.CheckpointVersionError and rebuilt.file == "x"

    class OddError(Exception):
        pass

    remote = rebuild_error(describe_error(OddError("boom")), 3)
    assert type(remote) is errors.RemoteError and "rank 3" in str(remote) and "boom" in str(remote)
