"""``shardwise convert-dcp`` from a real torch DCP checkpoint, and the refusal of DCP metadata
that references anything but DCP's own classes."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.dcp_import import _unpickle
from tests.unit.cli._helpers import (
    _column_shards,
    _run,
)

# -- convert-dcp -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Custom:
    """A value DCP can only store by pickling it."""

    marker: str

    def __setstate__(self, state: dict[str, Any]) -> None:
        Path(state["marker"]).write_text("executed")  # proof that unpickling ran code


def _dcp_save(state_dict: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # DCP warns that it assumes a single process; that is the point here.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state_dict, checkpoint_id=str(path), no_dist=True)


def test_convert_dcp_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = torch.Generator().manual_seed(1)
    sharded = torch.randn(6, 4, generator=g)
    expected = {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.randn(5, generator=g).to(torch.bfloat16),
        "s": torch.tensor(3.5),
        "nested.x": torch.arange(4, dtype=torch.int64).reshape(2, 2),
        "lsw": sharded,
    }
    source = {
        "w": expected["w"].clone(),
        "b": expected["b"].clone(),
        "s": expected["s"].clone(),
        "nested": {"x": expected["nested.x"].clone()},
        "lsw": _column_shards(sharded),
        "blob": io.BytesIO(b"\x00blob"),
        "raw": b"raw bytes",
        "step": 7,
        "name": "run-1",
    }
    _dcp_save(source, tmp_path / "dcp")
    out_dir = tmp_path / "converted"
    code, out, err = _run(capsys, "convert-dcp", tmp_path / "dcp", out_dir)
    assert (code, err) == (0, "")
    assert out == f"converted 5 tensors and 4 objects from {tmp_path / 'dcp'} to {out_dir}\n"

    metadata = ckpt.read_metadata(out_dir)
    assert len(metadata.state_dict_metadata["lsw"].chunks) == 1  # assembled into one tensor
    target: dict[str, Any] = {
        "w": torch.zeros(4, 3),
        "b": torch.zeros(5, dtype=torch.bfloat16),
        "s": torch.zeros(()),
        "nested": {"x": torch.zeros(2, 2, dtype=torch.int64)},
        "lsw": torch.zeros(6, 4),
        "blob": io.BytesIO(),
        "raw": b"",
        "step": 0,
        "name": "",
    }
    ckpt.load(target, out_dir)
    for key in ("w", "b", "s", "lsw"):
        assert target[key].dtype == expected[key].dtype
        assert torch.equal(target[key], expected[key]), key
    assert torch.equal(target["nested"]["x"], expected["nested.x"])
    assert target["blob"].getvalue() == b"\x00blob"
    assert (target["raw"], target["step"], target["name"]) == (b"raw bytes", 7, "run-1")
    assert _run(capsys, "verify", out_dir)[0] == 0


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("exploit", f"it references {os.system.__module__}.system, which is not part of DCP's"),
        (b"cbuiltins\neval\n(S'1+1'\ntR.", "it references builtins.eval, which is not part"),
        (
            b"cbuiltins\ngetattr\n(ctorch\nSize\nS'__class__'\ntR.",
            "getattr is only allowed for DCP's memory-format enum members",
        ),
        (pickle.dumps({"state_dict_metadata": {}}), "does not hold DCP metadata (found dict)"),
        (b"not a pickle", "cannot read"),
    ],
)
def test_convert_dcp_refuses_metadata_outside_the_allow_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], payload: bytes | str, message: str
) -> None:
    marker = tmp_path / "executed"
    directory = tmp_path / "dcp"
    directory.mkdir()
    data = pickle.dumps(_Exploit(marker)) if payload == "exploit" else payload
    assert isinstance(data, bytes)
    (directory / ".metadata").write_bytes(data)
    code, out, err = _run(capsys, "convert-dcp", directory, tmp_path / "out")
    assert (code, out) == (3, "")
    assert err.startswith("shardwise convert-dcp: error: ")
    assert message in err
    assert "Traceback" not in err
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_dcp_metadata_cannot_alter_the_allowed_stand_ins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "dcp").mkdir()
    metadata = tmp_path / "dcp" / ".metadata"
    # BUILD with a slots state on an allowed class, then on an allowed function.
    metadata.write_bytes(
        b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\nN}S'FIELDS'\n(S'x'\nts\x86b."
    )
    code, _, err = _run(capsys, "convert-dcp", tmp_path / "dcp", tmp_path / "out")
    assert code == 3
    assert "__setstate__() missing 1 required positional argument" in err
    assert _unpickle.DCPIndex.FIELDS == ("fqn", "offset", "index")
    metadata.write_bytes(
        b"ctorch.serialization\n_get_layout\nN}S'__defaults__'\n(S'x'\nts\x86b"
        b"S'torch.strided'\n\x85R."
    )
    code, _, err = _run(capsys, "convert-dcp", tmp_path / "dcp", tmp_path / "out")
    assert code == 3
    assert err.endswith("TypeError: invalid partial state\n")  # a fresh partial refuses it
    assert _unpickle.layout.__defaults__ is None


def test_convert_dcp_refuses_pickled_objects_and_non_dcp_directories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "executed"
    _dcp_save({"w": torch.ones(2), "custom": _Custom(str(marker))}, tmp_path / "dcp")
    code, out, err = _run(capsys, "convert-dcp", tmp_path / "dcp", tmp_path / "out")
    assert (code, out) == (3, "")
    assert err.startswith(
        "shardwise convert-dcp: error: 'custom': its DCP payload cannot be read without running "
        "pickled code (Weights only load failed."
    )
    assert not marker.exists()
    assert not (tmp_path / "out").exists()

    code, _, err = _run(capsys, "convert-dcp", tmp_path, tmp_path / "out")
    assert code == 3
    assert err == (
        f"shardwise convert-dcp: error: {tmp_path} is not a torch.distributed.checkpoint "
        f"directory: {tmp_path / '.metadata'} is missing\n"
    )


def test_convert_dcp_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dcp_save({"w": torch.ones(2), "step": 3}, tmp_path / "dcp")
    code, out, err = _run(capsys, "convert-dcp", tmp_path / "dcp", tmp_path / "c", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == {
        "dcp_dir": str(tmp_path / "dcp"),
        "out": str(tmp_path / "c"),
        "num_tensors": 1,
        "num_objects": 1,
    }
