"""Tests for the CheckpointError hierarchy (``shardwise.errors``): the built-in classes each
failure also is, and messages that name the key, file and rank."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from shardwise import errors
from shardwise.errors import (
    CheckpointDataError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CheckpointTimeoutError,
    ChecksumError,
    DCPImportError,
    MetadataFormatError,
    PickleNotAllowedError,
)

HIERARCHY = [
    (CheckpointFormatError, (CheckpointError, MetadataFormatError, ValueError)),
    (
        errors.CheckpointVersionError,
        (CheckpointFormatError, CheckpointError, MetadataFormatError, ValueError),
    ),
    (CheckpointNotFoundError, (CheckpointError, FileNotFoundError, OSError)),
    (CheckpointKeyError, (CheckpointError, KeyError)),
    (CheckpointMismatchError, (CheckpointError, ValueError)),
    (CheckpointDataError, (CheckpointError, OSError)),
    (ChecksumError, (CheckpointDataError, CheckpointError, OSError)),
    (PickleNotAllowedError, (CheckpointError, TypeError)),
    (DCPImportError, (CheckpointError,)),
    (CheckpointLockedError, (CheckpointError,)),
    (CheckpointTimeoutError, (CheckpointError, RuntimeError)),
    (CheckpointStorageError, (CheckpointError, OSError)),
]


@pytest.mark.parametrize(("cls", "bases"), HIERARCHY, ids=lambda v: getattr(v, "__name__", ""))
def test_hierarchy(cls: type[CheckpointError], bases: tuple[type, ...]) -> None:
    for base in bases:
        assert issubclass(cls, base)
    with pytest.raises(CheckpointError):
        raise cls("boom")


def test_every_checkpoint_error_is_exported() -> None:
    exported = {
        name
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), CheckpointError)
    }
    assert exported == {cls.__name__ for cls, _ in HIERARCHY} | {"CheckpointError"}
    assert errors.__all__ == sorted(errors.__all__)


def test_message_names_key_file_and_rank() -> None:
    err = ChecksumError(
        "checksum mismatch", key="layer.weight", file="data/rank-00001.safetensors", rank=1
    )
    assert str(err) == (
        "checksum mismatch (key 'layer.weight', file 'data/rank-00001.safetensors', rank 1)"
    )
    assert (err.key, err.file, err.rank) == ("layer.weight", "data/rank-00001.safetensors", 1)


def test_message_without_context_is_unchanged() -> None:
    err = CheckpointMismatchError("size mismatch")
    assert str(err) == "size mismatch"
    assert (err.key, err.file, err.rank) == (None, None, None)


def test_file_may_be_a_path() -> None:
    err = CheckpointNotFoundError("no index", file=Path("/ckpt/shardwise.json"))
    assert err.file == "/ckpt/shardwise.json"
    assert str(err) == "no index (file '/ckpt/shardwise.json')"


def test_key_error_message_is_not_quoted() -> None:
    err = CheckpointKeyError("missing key in checkpoint", key="opt.step")
    assert str(err) == "missing key in checkpoint (key 'opt.step')"


@pytest.mark.parametrize("cls", [cls for cls, _ in HIERARCHY] + [CheckpointError])
def test_errors_pickle_with_their_context(cls: type[CheckpointError]) -> None:
    # Errors travel between ranks: message and attributes must survive pickling.
    err = cls("bad", key="k", file="f", rank=3)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is cls
    assert str(copy) == str(err) == "bad (key 'k', file 'f', rank 3)"
    assert (copy.key, copy.file, copy.rank) == ("k", "f", 3)
