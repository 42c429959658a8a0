"""Hostile safetensors headers, fuzzed (issue 27): a weight file written by the safetensors
library is damaged — header fields replaced by hostile values, removed, added; entries added;
the length prefix set to anything; header bytes flipped; the file cut or extended — and loaded
with ``load_safetensors``.

Each case asserts the contract of ``docs/huggingface.md``: only a ``CheckpointError`` escapes,
and then the target is unchanged; nothing outside the directory is opened; a load that
succeeds reads what ``safetensors.torch.load_file`` (the reference) reads from the same file.
"""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise.checkpoint as ckpt
from tests import _hostile as h

TENSORS = {
    "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.arange(5, dtype=torch.bfloat16),
    "c": torch.arange(4, dtype=torch.int64).reshape(2, 2),
    "d": torch.arange(7, dtype=torch.uint8),
}
FIELDS = ("dtype", "shape", "data_offsets")
#: Edits of the header as JSON: hostile ones, and ones a valid file may have (a renamed
#: tensor, metadata, another dtype of the same size: read, or refused as a mismatch).
KINDS = ["replace", "shape", "offsets", "remove", "add", "entry", "meta", "rename", "dtype"]
_SAME_SIZE = {
    "F32": ["I32", "U32"],
    "BF16": ["F16", "I16"],
    "I64": ["F64", "U64"],
    "U8": ["I8", "BOOL"],
}

_ints = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([-(2**63), 2**31, 2**53 + 1, 2**63 - 1, 2**64, 10**30]),
)
_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        _ints,
        st.floats(allow_nan=False),
        st.sampled_from(["F32", "BF16", "I64", "U8", "F64", "BOOL", "F8_E4M3", "X9", "", "f32"]),
        st.text(max_size=5),
    ),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
_shapes = st.lists(_ints, max_size=4)
_offsets = st.lists(_ints, min_size=2, max_size=2)


def _original() -> bytes:
    return safetensors.torch.save(TENSORS, metadata={"format": "pt"})


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _joined(header: dict[str, Any], body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


@st.composite
def _edited(draw: st.DrawFn) -> bytes:
    """The file with its header edited as JSON (then written with a correct length)."""
    header, body = _split(_original())
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(KINDS))
        name = draw(st.sampled_from(sorted(TENSORS)))
        entry = header.get(name)
        if not isinstance(entry, dict):
            continue
        if kind == "replace":
            entry[draw(st.sampled_from(FIELDS))] = draw(_values)
        elif kind == "shape":
            entry["shape"] = draw(_shapes)
        elif kind == "offsets":
            entry["data_offsets"] = draw(_offsets)
        elif kind == "remove":
            entry.pop(draw(st.sampled_from(FIELDS)), None)
        elif kind == "add":
            entry[draw(st.text(max_size=4))] = draw(_values)
        elif kind == "entry":
            header[draw(st.text(max_size=4))] = {
                "dtype": draw(st.sampled_from(["F32", "U8", "I64"])),
                "shape": draw(_shapes),
                "data_offsets": draw(_offsets),
            }
        elif kind == "rename":
            header[draw(st.text(max_size=4))] = header.pop(name)
        elif kind == "dtype" and str(entry.get("dtype")) in _SAME_SIZE:
            entry["dtype"] = draw(st.sampled_from(_SAME_SIZE[entry["dtype"]]))
        else:
            header["__metadata__"] = draw(
                _values | st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)
            )
    if draw(st.integers(0, 3)) == 0:
        body = body[: draw(st.integers(0, len(body)))] + draw(st.binary(max_size=16))
    return _joined(header, body)


@st.composite
def _damaged(draw: st.DrawFn) -> bytes:
    """The file with raw bytes damaged: its length prefix, header bytes, or its length."""
    data = bytearray(_original())
    (length,) = struct.unpack("<Q", data[:8])
    kind = draw(st.sampled_from(["prefix", "flip", "cut"]))
    if kind == "prefix":
        data[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1) | st.integers(0, len(data))))
    elif kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, 7 + length))
            data[at] = draw(st.integers(0, 255))
    else:
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


def _target() -> dict[str, Any]:
    return {"w": {k: torch.zeros_like(v) for k, v in TENSORS.items()}}


def _reference(path: Path) -> dict[str, torch.Tensor] | None:
    """What the safetensors library reads from ``path`` (``None``: it refuses the file)."""
    try:
        return safetensors.torch.load_file(str(path))
    except Exception:  # any refusal of the library counts as one
        return None


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.one_of(_edited(), _damaged()))
def test_a_hostile_header_is_refused_or_read_as_the_reference_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes
) -> None:
    path = tmp_path / "hf"
    path.mkdir(exist_ok=True)
    file = path / "model.safetensors"
    file.write_bytes(data)
    monkeypatch.chdir(path)  # weight files are opened by name inside the directory (openat)
    state = _target()
    before = h.snapshot(state)
    with h.confined_opens(path), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # keys the edits renamed: not loaded, said in a warning
        try:
            result = ckpt.load_safetensors(
                state, path, prefix="w", strict=False, allow_dtype_cast=True
            )
        except ckpt.CheckpointError:
            h.assert_unchanged(state, before)
            return
    reference = _reference(file)
    assert reference is not None, "loaded a file that the safetensors library refuses"
    missing = {key.removeprefix("w.") for key in result.missing_keys}
    for key in TENSORS:
        if key in missing:
            assert not state["w"][key].any(), key
        else:
            assert torch.equal(state["w"][key], reference[key].to(TENSORS[key].dtype)), key


def test_both_outcomes_of_the_property_are_reached(tmp_path: Path) -> None:
    # The undamaged file loads exactly; a length prefix past the end is refused, naming it.
    (tmp_path / "model.safetensors").write_bytes(_original())
    state = _target()
    assert ckpt.load_safetensors(state, tmp_path, prefix="w") == ([], [])
    h.assert_same_values(state["w"], TENSORS)
    data = bytearray(_original())
    data[:8] = struct.pack("<Q", len(data))
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointFormatError, match="runs past the end") as caught:
        ckpt.load_safetensors(_target(), tmp_path, prefix="w")
    assert caught.value.file == str(tmp_path / "model.safetensors")
