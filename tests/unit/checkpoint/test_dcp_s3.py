"""``DCPReader`` and ``shardwise convert-dcp`` on a DCP checkpoint in an object store (the moto
S3 server of ``tests/_s3.py``): the reading goes through the storage layer, so a DCP checkpoint
uploaded to ``s3://`` converts as it does from a local directory, and is held to the same
checks."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.dcp_import import DCPImportError, DCPReader
from shardwise.cli import main
from tests._s3 import S3Bucket, s3_bucket, s3_server  # noqa: F401 (fixtures)


def _state() -> dict[str, Any]:
    return {"w": torch.arange(12.0).reshape(4, 3), "step": 7, "blob": b"raw bytes"}


def _upload_dcp(s3: S3Bucket, tmp_path: Path, prefix: str) -> str:
    """A DCP checkpoint of :func:`_state`, saved locally and copied to ``s3://.../prefix``."""
    local = tmp_path / "dcp"
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process; that is the point here.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_state(), checkpoint_id=str(local), no_dist=True)
    fs = s3.filesystem()
    for path in local.iterdir():
        fs.pipe_file(f"{s3.name}/{prefix}/{path.name}", path.read_bytes())
    fs.invalidate_cache()
    return s3.url(prefix)


def _assert_state(values: dict[str, Any]) -> None:
    expected = _state()
    assert set(values) == set(expected)
    assert torch.equal(values["w"], expected["w"])
    assert (values["step"], values["blob"]) == (expected["step"], expected["blob"])


def test_a_dcp_checkpoint_on_s3_reads_back(s3: S3Bucket, tmp_path: Path) -> None:
    url = _upload_dcp(s3, tmp_path, "dcp")
    reader = DCPReader(url, storage_options=s3.options)
    assert reader.is_tensor("w") and not reader.is_tensor("step")
    _assert_state({key: reader.read(key) for key in reader.keys})


def test_convert_dcp_from_s3_to_local_and_to_s3(
    s3: S3Bucket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _upload_dcp(s3, tmp_path, "dcp")
    options = ["--storage-options", json.dumps(s3.options)]
    for out in (str(tmp_path / "converted"), s3.url("converted")):
        assert main(["convert-dcp", url, out, *options]) == 0
        captured = capsys.readouterr()
        assert captured.err == ""
        assert captured.out == f"converted 1 tensor and 2 objects from {url} to {out}\n"
        target = {"w": torch.zeros(4, 3), "step": 0, "blob": b""}
        ckpt.load(target, out, storage_options=s3.options)
        _assert_state(target)


def test_a_missing_or_truncated_dcp_checkpoint_on_s3_is_refused(
    s3: S3Bucket, tmp_path: Path
) -> None:
    with pytest.raises(DCPImportError) as caught:
        DCPReader(s3.url("nothing"), storage_options=s3.options)
    assert str(caught.value) == (
        f"{s3.url('nothing')} is not a torch.distributed.checkpoint directory: "
        f"{s3.url('nothing', '.metadata')} is missing"
    )
    url = _upload_dcp(s3, tmp_path, "dcp")
    fs = s3.filesystem()
    data = f"{s3.name}/dcp/__0_0.distcp"
    fs.pipe_file(data, fs.cat_file(data)[:-100])
    fs.invalidate_cache()
    with pytest.raises(DCPImportError) as caught:
        DCPReader(url, storage_options=s3.options)
    assert "reaches past the end of its data file" in str(caught.value)
    assert caught.value.file == s3.url("dcp", "__0_0.distcp")
