"""Tests for the checkpoint metadata classes (reference §21) and their JSON forms.

The classes mirror ``torch.distributed.checkpoint.metadata``: same fields, defaults, equality
(``MetadataIndex.index`` excluded), hashing and repr. The JSON forms (the checkpoint index
among them, ``docs/format.md``) are shardwise's own: exact round trips, and every malformed
document is refused with a ``CheckpointFormatError``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import metadata as dcp

import shardwise._codec
import shardwise.metadata
from shardwise.checkpoint import (
    BytesStorageMetadata,
    CheckpointError,
    CheckpointFormatError,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from shardwise.checkpoint.metadata import (
    INDEX_FORMAT,
    INDEX_VERSION,
    TensorProperties,
    properties_to_dcp,
)
from shardwise.errors import MetadataFormatError

CLASSES = [
    (ChunkStorageMetadata, dcp.ChunkStorageMetadata),
    (TensorStorageMetadata, dcp.TensorStorageMetadata),
    (BytesStorageMetadata, dcp.BytesStorageMetadata),
    (StorageMeta, dcp.StorageMeta),
    (Metadata, dcp.Metadata),
    (MetadataIndex, dcp.MetadataIndex),
    (TensorProperties, dcp.TensorProperties),
]


def _tensor_entry() -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.bfloat16),
        size=torch.Size([4, 3]),
        chunks=[
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
        ],
    )


def _metadata() -> Metadata:
    return Metadata(
        state_dict_metadata={"w": _tensor_entry(), "step": BytesStorageMetadata()},
        planner_data={"world_size": 2},
        storage_data={
            MetadataIndex("w", [2, 0]): {"file": "data/rank-00001.safetensors", "begin": 0},
            MetadataIndex("step"): {"file": "data/rank-00000.safetensors"},
        },
        storage_meta=StorageMeta(checkpoint_id="/ckpt", save_id="s1", modules=["model"]),
        version="1",
    )


# -- dataclass semantics -----------------------------------------------------------------------


@pytest.mark.parametrize(("ours", "theirs"), CLASSES, ids=lambda c: c.__name__)
def test_fields_and_defaults_mirror_dcp(ours: type, theirs: type) -> None:
    def shape(cls: type) -> list[tuple[str, object, bool, bool]]:
        return [
            (f.name, f.default, f.compare, f.hash is None or f.hash)
            for f in dataclasses.fields(cls)
        ]

    assert ours.__name__ == theirs.__name__
    assert shape(ours) == shape(theirs)


def test_tensor_properties_is_the_one_shared_class() -> None:
    assert TensorProperties is shardwise.metadata.TensorProperties
    assert type(TensorStorageMetadata(TensorProperties(), [1], []).properties) is TensorProperties


def test_reprs_match_dcp() -> None:
    chunk = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2]))
    assert repr(chunk) == repr(dcp.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])))
    assert (
        repr(chunk) == "ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 2]))"
    )
    theirs = dcp.TensorStorageMetadata(
        properties=properties_to_dcp(TensorProperties(dtype=torch.bfloat16)),
        size=torch.Size([4, 3]),
        chunks=[c.to_dcp() for c in _tensor_entry().chunks],
    )
    assert repr(_tensor_entry()) == repr(theirs)
    assert repr(BytesStorageMetadata()) == "BytesStorageMetadata()"
    assert repr(StorageMeta()) == repr(dcp.StorageMeta())
    assert repr(MetadataIndex("a", [1])) == repr(dcp.MetadataIndex("a", [1]))
    theirs_metadata = dcp.Metadata(
        state_dict_metadata={"w": theirs, "step": dcp.BytesStorageMetadata()},
        planner_data={"world_size": 2},
        storage_data={
            dcp.MetadataIndex("w", [2, 0]): {"file": "data/rank-00001.safetensors", "begin": 0},
            dcp.MetadataIndex("step"): {"file": "data/rank-00000.safetensors"},
        },
        storage_meta=dcp.StorageMeta(checkpoint_id="/ckpt", save_id="s1", modules=["model"]),
        version="1",
    )
    assert repr(_metadata()) == repr(theirs_metadata)


def test_chunk_converts_sequences_to_size() -> None:
    chunk = ChunkStorageMetadata(offsets=[0, 4], sizes=(2, 2))  # type: ignore[arg-type]
    assert type(chunk.offsets) is torch.Size
    assert type(chunk.sizes) is torch.Size
    assert chunk == ChunkStorageMetadata(torch.Size([0, 4]), torch.Size([2, 2]))
    assert chunk != ChunkStorageMetadata(torch.Size([0, 4]), torch.Size([2, 3]))


def test_chunk_allows_what_dcp_allows() -> None:
    # LocalShardsWrapper can produce offsets with more entries than sizes; the class keeps them.
    chunk = ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2]))
    assert chunk.offsets == torch.Size([2, 0])


def test_tensor_entry_equality_is_field_wise() -> None:
    assert _tensor_entry() == _tensor_entry()
    other = _tensor_entry()
    other.chunks.reverse()
    assert other != _tensor_entry()  # chunk order matters
    other = _tensor_entry()
    other.properties.requires_grad = True
    assert other != _tensor_entry()
    assert TensorStorageMetadata(TensorProperties(), [3], []).size == torch.Size([3])


def test_default_dtype_is_taken_per_instance() -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert TensorProperties().dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert TensorProperties().dtype == previous


def test_storage_meta_defaults() -> None:
    a, b = StorageMeta(), StorageMeta()
    assert (a.checkpoint_id, a.save_id, a.load_id, a.modules) == (None, None, None, [])
    a.modules.append("x")
    assert b.modules == []


def test_metadata_defaults() -> None:
    md = Metadata({})
    assert (md.planner_data, md.storage_data, md.storage_meta, md.version) == (
        None,
        None,
        None,
        None,
    )
    assert Metadata({"a": BytesStorageMetadata()}) == Metadata({"a": BytesStorageMetadata()})
    assert Metadata({"a": BytesStorageMetadata()}) != Metadata({})


def test_metadata_index_converts_the_offset() -> None:
    assert MetadataIndex("foo", [1, 2]) == MetadataIndex("foo", torch.Size([1, 2]))  # type: ignore[arg-type]
    assert type(MetadataIndex("foo", (1, 2)).offset) is torch.Size  # type: ignore[arg-type]
    assert MetadataIndex("foo").offset is None
    assert MetadataIndex("foo", torch.Size([])).offset == torch.Size([])


def test_metadata_index_hint_is_ignored_by_equality_and_hash() -> None:
    a = MetadataIndex("foo")
    b = MetadataIndex("foo", index=99)
    assert a == b
    assert hash(a) == hash(b)
    assert {MetadataIndex("w", [0], 0): 1}[MetadataIndex("w", [0], 5)] == 1  # type: ignore[arg-type]
    assert MetadataIndex("foo", [0]) != MetadataIndex("foo")  # type: ignore[arg-type]
    assert MetadataIndex("foo") != MetadataIndex("bar")


def test_metadata_index_positional_and_frozen() -> None:
    index = MetadataIndex("foo", [3], 1)  # type: ignore[arg-type]
    assert (index.fqn, index.offset, index.index) == ("foo", torch.Size([3]), 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        index.fqn = "bar"  # type: ignore[misc]


@pytest.mark.parametrize(
    "value",
    [
        ChunkStorageMetadata(torch.Size([1]), torch.Size([2])),
        _tensor_entry(),
        BytesStorageMetadata(),
        StorageMeta("id", "s", "l", ["m"]),
        MetadataIndex("x", torch.Size([1, 2]), 3),
        _metadata(),
    ],
    ids=type,
)
def test_pickle_and_copy(value: object) -> None:
    for copied in (pickle.loads(pickle.dumps(value)), copy.deepcopy(value)):
        assert copied == value
        assert repr(copied) == repr(value)


# -- conversion to and from DCP's classes ----------------------------------------------------


def test_chunks_convert_to_dcp() -> None:
    theirs = ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])).to_dcp()
    assert type(theirs) is dcp.ChunkStorageMetadata
    assert theirs == dcp.ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3]))


def test_properties_conversion() -> None:
    ours = TensorProperties(torch.int8, torch.sparse_coo, True, torch.channels_last, True)
    theirs = properties_to_dcp(ours)
    assert type(theirs) is dcp.TensorProperties
    assert dataclasses.astuple(theirs) == dataclasses.astuple(ours)


# -- JSON bodies of the single classes ------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([2, 5])),
        ChunkStorageMetadata(torch.Size([]), torch.Size([])),
        _tensor_entry(),
        TensorStorageMetadata(TensorProperties(), torch.Size([]), []),
        BytesStorageMetadata(),
        StorageMeta(),
        StorageMeta("ckpt", "save", "load", ["a", "b"]),
        MetadataIndex("x"),
        MetadataIndex("x.y", torch.Size([0, 3]), 2),
    ],
    ids=type,
)
def test_single_class_json_round_trip(value: Any) -> None:
    text = json.dumps(value.to_dict())
    back = type(value).from_dict(json.loads(text))
    assert back == value
    if isinstance(value, MetadataIndex):
        assert back.index == value.index


def test_json_bodies() -> None:
    assert ChunkStorageMetadata(torch.Size([1]), torch.Size([2])).to_dict() == {
        "offsets": [1],
        "sizes": [2],
    }
    assert MetadataIndex("a", torch.Size([1, 2])).to_dict() == {
        "fqn": "a",
        "offset": [1, 2],
        "index": None,
    }
    assert StorageMeta().to_dict() == {
        "checkpoint_id": None,
        "save_id": None,
        "load_id": None,
        "modules": [],
    }
    assert _tensor_entry().to_dict()["properties"] == TensorProperties(torch.bfloat16).to_dict()


def test_storage_meta_path_checkpoint_id_is_stored_as_a_string() -> None:
    meta = StorageMeta(checkpoint_id=Path("/a/b"))
    assert StorageMeta.from_dict(meta.to_dict()).checkpoint_id == "/a/b"


@pytest.mark.parametrize(
    ("cls", "value", "message"),
    [
        (ChunkStorageMetadata, {"offsets": [0], "sizes": [1], "x": 1}, "unknown keys ['x']"),
        (ChunkStorageMetadata, {"offsets": [0]}, "missing keys ['sizes']"),
        (ChunkStorageMetadata, {"offsets": [0, 0], "sizes": [1]}, "different lengths"),
        (ChunkStorageMetadata, {"offsets": [-1], "sizes": [1]}, "must not be negative"),
        (ChunkStorageMetadata, {"offsets": [0], "sizes": [1.5]}, "list of integers"),
        (ChunkStorageMetadata, {"offsets": [True], "sizes": [1]}, "list of integers"),
        (ChunkStorageMetadata, [0, 1], "must be a JSON object"),
        (
            TensorStorageMetadata,
            {
                "properties": {**TensorProperties().to_dict(), "dtype": "float128"},
                "size": [2],
                "chunks": [],
            },
            "unknown dtype name 'float128'",
        ),
        (
            TensorStorageMetadata,
            {
                "properties": {**TensorProperties().to_dict(), "layout": "tiled"},
                "size": [2],
                "chunks": [],
            },
            "unknown layout 'tiled'",
        ),
        (
            TensorStorageMetadata,
            {"properties": TensorProperties().to_dict(), "size": [2], "chunks": {}},
            "chunks must be a list",
        ),
        (
            TensorStorageMetadata,
            {
                "properties": TensorProperties().to_dict(),
                "size": [4],
                "chunks": [{"offsets": [3], "sizes": [2]}],
            },
            "exceeds dim 0 of a tensor of size [4]",
        ),
        (
            TensorStorageMetadata,
            {
                "properties": TensorProperties().to_dict(),
                "size": [4],
                "chunks": [{"offsets": [0, 0], "sizes": [1, 1]}],
            },
            "does not have the 1 dims",
        ),
        (BytesStorageMetadata, {"x": None}, "unknown keys ['x']"),
        (StorageMeta, {**StorageMeta().to_dict(), "modules": "m"}, "list of strings"),
        (StorageMeta, {**StorageMeta().to_dict(), "save_id": 3}, "string or null"),
        (MetadataIndex, {"fqn": 1, "offset": None, "index": None}, "fqn must be a string"),
        (MetadataIndex, {"fqn": "a", "offset": None, "index": -1}, "index must be"),
        (MetadataIndex, {"fqn": "a", "offset": None, "index": True}, "index must be"),
    ],
)
def test_single_class_json_rejections(cls: Any, value: object, message: str) -> None:
    with pytest.raises(CheckpointFormatError) as info:
        cls.from_dict(value)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, MetadataFormatError)


def test_zero_volume_chunks_are_exempt_from_bounds() -> None:
    # 5 rows over 4 chunks of 2: the last chunk starts past the end (SPEC deviation 1).
    entry = TensorStorageMetadata(
        TensorProperties(),
        torch.Size([5, 2]),
        [
            ChunkStorageMetadata(torch.Size([2 * i, 0]), torch.Size([max(0, min(2, 5 - 2 * i)), 2]))
            for i in range(4)
        ],
    )
    assert entry.chunks[3] == ChunkStorageMetadata(torch.Size([6, 0]), torch.Size([0, 2]))
    assert TensorStorageMetadata.from_dict(entry.to_dict()) == entry


def test_writers_refuse_what_readers_refuse() -> None:
    with pytest.raises(CheckpointFormatError, match="different lengths"):
        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2])).to_dict()
    with pytest.raises(CheckpointFormatError, match="exceeds dim 0"):
        TensorStorageMetadata(
            TensorProperties(),
            torch.Size([2]),
            [ChunkStorageMetadata(torch.Size([1]), torch.Size([2]))],
        ).to_dict()
    with pytest.raises(TypeError, match="shardwise TensorProperties"):
        TensorStorageMetadata(dcp.TensorProperties(), torch.Size([2]), []).to_dict()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="modules"):
        StorageMeta(modules=("a",)).to_dict()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="index"):
        MetadataIndex("a", None, -2).to_dict()


# -- the checkpoint index (Metadata) ----------------------------------------------------------


def test_index_document_is_pinned() -> None:
    # Byte-exact: the index format is a contract (docs/format.md).
    md = Metadata(
        {
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float16),
                torch.Size([4]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))],
            ),
            "b": BytesStorageMetadata(),
        },
        storage_data={MetadataIndex("w", [0]): {"file": "f"}},  # type: ignore[arg-type]
    )
    assert md.to_json() == (
        '{"format":"shardwise-checkpoint","format_version":1,"version":null,'
        '"storage_meta":null,"planner_data":null,"storage_data":[],'
        '"state_dict_metadata":{"w":{"type":"tensor","properties":{"dtype":"float16",'
        '"layout":"strided","requires_grad":false,"memory_format":"contiguous_format",'
        '"pin_memory":false},"size":[4],"chunks":[{"offsets":[0],"sizes":[4],'
        '"storage":{"file":"f"}}]},"b":{"type":"bytes"}}}'
    )
    assert json.loads(md.to_json(indent=2)) == json.loads(md.to_json())
    assert (INDEX_FORMAT, INDEX_VERSION) == ("shardwise-checkpoint", 1)


def test_index_round_trip() -> None:
    md = _metadata()
    back = Metadata.from_json(md.to_json())
    assert back == md
    assert Metadata.from_json(md.to_json().encode()) == md
    # Keys read back carry the chunk position as their hint.
    assert {key: key.index for key in back.storage_data} == {
        MetadataIndex("w", [2, 0]): 1,  # type: ignore[arg-type]
        MetadataIndex("step"): None,
    }


def test_index_storage_info_is_inlined_in_its_entry() -> None:
    body = _metadata().to_dict()
    assert body["storage_data"] == []
    chunks = body["state_dict_metadata"]["w"]["chunks"]
    assert "storage" not in chunks[0]
    assert chunks[1]["storage"] == {"file": "data/rank-00001.safetensors", "begin": 0}
    assert body["state_dict_metadata"]["step"] == {
        "type": "bytes",
        "storage": {"file": "data/rank-00000.safetensors"},
    }


def test_index_keeps_storage_info_of_unknown_keys_apart() -> None:
    md = Metadata({}, storage_data={MetadataIndex("gone", [1], 4): {"x": [1, 2]}})  # type: ignore[arg-type]
    body = md.to_dict()
    assert body["storage_data"] == [
        {"index": {"fqn": "gone", "offset": [1], "index": 4}, "info": {"x": [1, 2]}}
    ]
    assert Metadata.from_dict(body) == md


def test_index_none_and_empty_storage_data_differ() -> None:
    for storage_data in (None, {}):
        md = Metadata({"b": BytesStorageMetadata()}, storage_data=storage_data)
        assert Metadata.from_json(md.to_json()).storage_data == storage_data


def test_index_storage_info_objects_and_converter() -> None:
    @dataclasses.dataclass
    class Info:
        file: str

        def to_dict(self) -> dict[str, Any]:
            return {"file": self.file}

        @classmethod
        def from_dict(cls, data: dict[str, Any]) -> Info:
            return cls(**data)

    md = Metadata(
        {"w": _tensor_entry()},
        storage_data={MetadataIndex("w", [0, 0]): Info("a")},  # type: ignore[arg-type]
    )
    text = md.to_json()
    assert Metadata.from_json(text, storage_info=Info.from_dict) == md
    assert Metadata.from_json(text).storage_data == {MetadataIndex("w", [0, 0]): {"file": "a"}}  # type: ignore[arg-type]


def _index(**changes: Any) -> dict[str, Any]:
    body = _metadata().to_dict()
    body.update(changes)
    return body


def _with_entry(fqn: str, entry: object) -> dict[str, Any]:
    body = _metadata().to_dict()
    body["state_dict_metadata"][fqn] = entry
    return body


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "a checkpoint index must be a JSON object"),
        (_index(format="dcp"), "not a shardwise checkpoint index: format is 'dcp'"),
        ({"format_version": 1}, "not a shardwise checkpoint index: format is None"),
        (_index(format_version=2), "unsupported checkpoint format version 2"),
        (_index(format_version=1.0), "unsupported checkpoint format version 1.0"),
        (_index(format_version=True), "unsupported checkpoint format version True"),
        (_index(format_version=None), "unsupported checkpoint format version None"),
        (_index(extra=1), "unknown keys ['extra'] in checkpoint index"),
        (
            {k: v for k, v in _metadata().to_dict().items() if k != "planner_data"},
            "missing keys ['planner_data'] in checkpoint index",
        ),
        (_index(version=1), "checkpoint index version must be a string or null"),
        (_index(state_dict_metadata=[]), "state_dict_metadata must be a JSON object"),
        (_index(storage_data={}), "storage_data must be a list or null"),
        (_index(storage_meta={"checkpoint_id": None}), "missing keys"),
        (_with_entry("x", {"type": "blob"}), "has unknown type 'blob'"),
        (_with_entry("x", {"chunks": []}), "has unknown type None"),
        (_with_entry("x", "tensor"), "entry 'x' must be a JSON object"),
        (_with_entry("x", {"type": "bytes", "extra": 1}), "unknown keys ['extra']"),
        (
            _with_entry("x", {**_tensor_entry().to_dict(), "type": "tensor", "extra": 1}),
            "unknown keys ['extra']",
        ),
        (
            _with_entry(
                "x",
                {
                    "type": "tensor",
                    **_tensor_entry().to_dict(),
                    "properties": {**TensorProperties().to_dict(), "dtype": "float7"},
                },
            ),
            "unknown dtype name 'float7'",
        ),
        (
            _with_entry(
                "x",
                {
                    "type": "tensor",
                    **_tensor_entry().to_dict(),
                    "properties": {**TensorProperties().to_dict(), "memory_format": "tiled"},
                },
            ),
            "unknown memory format 'tiled'",
        ),
        (_with_entry("x", {"type": "bytes", "storage": [1]}), "storage info must be a JSON object"),
        (
            _with_entry(
                "x",
                {
                    "type": "tensor",
                    **_tensor_entry().to_dict(),
                    "chunks": [
                        {"offsets": [0, 0], "sizes": [2, 3], "storage": {}},
                        {"offsets": [0, 0], "sizes": [2, 3], "storage": {}},
                    ],
                },
            ),
            "two chunks carry storage info",
        ),
        (_index(storage_data=None), "carry storage info but storage_data is null"),
        (
            _index(
                storage_data=[{"index": {"fqn": "w", "offset": [2, 0], "index": None}, "info": {}}]
            ),
            "is given twice",
        ),
        (
            _index(storage_data=[{"index": {"fqn": "z", "offset": None, "index": None}}]),
            "missing keys",
        ),
        (
            _index(
                storage_data=[{"index": {"fqn": "z", "offset": None, "index": None}, "info": 3}]
            ),
            "must be a JSON object",
        ),
    ],
)
def test_index_rejections(body: object, message: str) -> None:
    with pytest.raises(CheckpointFormatError) as info:
        Metadata.from_json(json.dumps(body))
    assert message in str(info.value)
    assert isinstance(info.value, CheckpointError)
    assert isinstance(info.value, ValueError)


def test_index_errors_in_an_entry_name_the_key() -> None:
    body = _with_entry(
        "layer.weight",
        {"type": "tensor", **_tensor_entry().to_dict(), "size": [1, 3]},
    )
    with pytest.raises(CheckpointFormatError) as info:
        Metadata.from_dict(body)
    assert info.value.key == "layer.weight"
    assert str(info.value).endswith("(key 'layer.weight')")


@pytest.mark.parametrize("text", ["", "{", '{"format": NaN}', "[1, Infinity]", b"\xfe\xff"])
def test_index_that_is_not_json(text: str | bytes) -> None:
    with pytest.raises(CheckpointFormatError):
        Metadata.from_json(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # Was: RecursionError, and a repeated key read as the parser chose.
        ("[" * 100_000 + "]" * 100_000, "is nested too deeply"),
        ('{"format": "shardwise-checkpoint", "format": "x"}', "repeats the key 'format'"),
        ("9" * 5000, "is not valid JSON"),
    ],
)
def test_index_that_is_not_strict_json(text: str, message: str) -> None:
    with pytest.raises(CheckpointFormatError, match=message):
        Metadata.from_json(text)


@pytest.mark.parametrize(
    ("md", "message"),
    [
        (Metadata({}, planner_data=(1, 2)), "tuple is not JSON-able"),
        (Metadata({}, planner_data={"a": math.nan}), "has no JSON form"),
        (Metadata({}, planner_data={1: "a"}), "keys must be strings"),
        (Metadata({}, planner_data=[torch.zeros(1)]), "Tensor is not JSON-able"),
        (Metadata({}, storage_data=[1]), "must be None or a mapping"),
        (Metadata({}, storage_data={"w": {}}), "keys must be MetadataIndex"),
        (Metadata({}, storage_data={MetadataIndex("w"): 3}), "storage info must be a dict"),
        (Metadata({}, storage_data={MetadataIndex("w"): {"a": (1,)}}), "not JSON-able"),
        (Metadata({"w": dcp.BytesStorageMetadata()}), "must be a TensorStorageMetadata"),  # type: ignore[dict-item]
        (Metadata({}, version=2), "version must be a string"),  # type: ignore[arg-type]
        (Metadata({}, storage_meta=dcp.StorageMeta()), "must be a StorageMeta"),  # type: ignore[arg-type]
        (Metadata({3: BytesStorageMetadata()}), "keys must be strings"),  # type: ignore[dict-item]
    ],
)
def test_index_writer_refuses_values_without_an_exact_json_form(md: Metadata, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        md.to_json()


def test_index_writer_names_the_key_of_an_inconsistent_entry() -> None:
    entry = _tensor_entry()
    entry.size = torch.Size([1, 3])
    with pytest.raises(CheckpointFormatError) as info:
        Metadata({"bad": entry}).to_json()
    assert info.value.key == "bad"


# -- property: any metadata survives the JSON round trip -------------------------------------

_DTYPES = sorted(shardwise._codec.DTYPES.values(), key=str)
_JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
_JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=5,
)


@st.composite
def _properties(draw: st.DrawFn) -> TensorProperties:
    return TensorProperties(
        dtype=draw(st.sampled_from(_DTYPES)),
        layout=draw(st.sampled_from([torch.strided, torch.sparse_coo, torch.sparse_csr])),
        requires_grad=draw(st.booleans()),
        memory_format=draw(
            st.sampled_from(
                [
                    torch.contiguous_format,
                    torch.channels_last,
                    torch.preserve_format,
                    torch.channels_last_3d,
                ]
            )
        ),
        pin_memory=draw(st.booleans()),
    )


@st.composite
def _tensor_entries(draw: st.DrawFn) -> TensorStorageMetadata:
    size = draw(st.lists(st.integers(0, 9), max_size=3))
    chunks = []
    for _ in range(draw(st.integers(0, 4))):
        offsets = [draw(st.integers(0, extent)) for extent in size]
        sizes = [
            draw(st.integers(0, extent - offset))
            for offset, extent in zip(offsets, size, strict=True)
        ]
        chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    return TensorStorageMetadata(draw(_properties()), torch.Size(size), chunks)


@st.composite
def _metadata_values(draw: st.DrawFn) -> Metadata:
    entries = draw(
        st.dictionaries(
            st.text(max_size=8),
            _tensor_entries() | st.just(BytesStorageMetadata()),
            max_size=4,
        )
    )
    storage_data: dict[MetadataIndex, Any] | None = None
    if draw(st.booleans()):
        keys = [MetadataIndex("not-an-entry", torch.Size([draw(st.integers(0, 3))]))]
        for fqn, entry in entries.items():
            if isinstance(entry, TensorStorageMetadata):
                keys += [MetadataIndex(fqn, chunk.offsets) for chunk in entry.chunks]
            else:
                keys.append(MetadataIndex(fqn))
        chosen = draw(st.lists(st.sampled_from(keys), max_size=6))
        infos = st.dictionaries(st.text(max_size=4), _JSON_VALUES, max_size=3)
        storage_data = {key: draw(infos) for key in chosen}
    storage_meta = draw(
        st.none()
        | st.builds(
            StorageMeta,
            checkpoint_id=st.none() | st.text(max_size=5),
            save_id=st.none() | st.text(max_size=5),
            load_id=st.none() | st.text(max_size=5),
            modules=st.lists(st.text(max_size=4), max_size=3),
        )
    )
    return Metadata(
        state_dict_metadata=entries,
        planner_data=draw(_JSON_VALUES),
        storage_data=storage_data,
        storage_meta=storage_meta,
        version=draw(st.none() | st.text(max_size=5)),
    )


@settings(max_examples=50, deadline=None)
@given(md=_metadata_values())
def test_any_metadata_round_trips_through_the_index(md: Metadata) -> None:
    text = md.to_json()
    assert Metadata.from_json(text) == md
    assert Metadata.from_dict(json.loads(text)) == md


@settings(max_examples=50, deadline=None)
@given(entry=_tensor_entries())
def test_any_tensor_entry_round_trips(entry: TensorStorageMetadata) -> None:
    assert TensorStorageMetadata.from_dict(json.loads(json.dumps(entry.to_dict()))) == entry
