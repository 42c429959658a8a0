"""The error tree is closed: every exception a user can catch lives in ``shardwise.errors``
and is exported; a format version this shardwise does not read is its own type
(``CheckpointVersionError``), not a message to match; another rank's error of an unknown
type is a ``RemoteError``."""

from __future__ import annotations

import inspect
import re
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


def test_every_error_and_warning_is_exported_at_the_top_and_defined_in_errors() -> None:
    import shardwise
    import shardwise.checkpoint.manager as manager

    assert set(errors.__all__) <= set(shardwise.__all__)
    for name in errors.__all__:
        assert getattr(shardwise, name) is getattr(errors, name)
    # The warning a restore gives lives in the tree too, and is the one the manager warns with.
    assert issubclass(errors.RestoreFallbackWarning, UserWarning)
    assert ckpt.RestoreFallbackWarning is manager.RestoreFallbackWarning
    assert ckpt.RestoreFallbackWarning is errors.RestoreFallbackWarning
    # No public name of either package is an exception defined elsewhere.
    for package in (shardwise, ckpt):
        for name in package.__all__:
            value = getattr(package, name)
            if inspect.isclass(value) and issubclass(value, BaseException):
                assert value.__module__ == errors.__name__, name


def test_no_exception_class_is_defined_outside_errors_but_internal_ones() -> None:
    # The exception classes elsewhere in the package never reach a caller: each is caught and
    # raised as one of the tree (an unsafe path as a CheckpointDataError, a forbidden global
    # as a DCPImportError, a refused JSON value as a ValueError) or is the CLI's own.
    root = Path(inspect.getfile(errors)).parent
    pattern = re.compile(r"^class (\w+)\((?:[\w.]*(?:Error|Exception|Warning))\)", re.MULTILINE)
    found = {
        (path.relative_to(root).as_posix(), name)
        for path in root.rglob("*.py")
        if path.name != "errors.py"
        for name in pattern.findall(path.read_text(encoding="utf-8"))
    }
    assert found == {
        ("_json.py", "_RefusedError"),
        ("checkpoint/dcp_import/_unpickle.py", "ForbiddenGlobalError"),
        ("checkpoint/storage/_protocol.py", "UnsafePathError"),
        ("cli/_common.py", "UsageError"),
    }
