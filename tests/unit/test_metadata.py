"""Tests for shard and tensor metadata: validation, equality, hashing, pickling and the JSON form.

Validation order, error types and texts follow the reference (§3, §4, error table rows 4-6, 70);
the versioned JSON form is shardwise's own and must round-trip exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import pickle
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardwise import (
    MetadataFormatError,
    RemoteDevice,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)
from shardwise.metadata import (
    JSON_VERSION,
    MEM_FORMAT_ENCODING,
    dtype_from_name,
    dtype_name,
    keeps_requires_grad,
)

PARSE_ERROR_TAIL = (
    ". The valid format is '<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
)

# Every dtype object torch exposes (aliases such as torch.float collapse onto one object).
ALL_DTYPES = sorted(
    {value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str
)
LAYOUTS = [torch.strided, torch.sparse_coo]
PICKLABLE_MEMORY_FORMATS = [torch.contiguous_format, torch.channels_last, torch.preserve_format]


def _name(value: object) -> str:
    return str(value).removeprefix("torch.")


def test_dtype_enumeration_covers_every_kind() -> None:
    # Guards the round-trip matrix below against silently shrinking.
    names = {_name(dtype) for dtype in ALL_DTYPES}
    expected = {
        "bool",
        "complex32",
        "complex64",
        "complex128",
        "bfloat16",
        "float16",
        "float8_e4m3fn",
        "float8_e5m2",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "qint8",
        "quint8",
        "qint32",
        "quint4x2",
        "bits8",
        "bits16",
    } | {f"int{n}" for n in range(1, 8)}
    assert expected <= names


# --------------------------------------------------------------------------------------------
# ShardMetadata
# --------------------------------------------------------------------------------------------


def test_shard_metadata_fields_and_defaults() -> None:
    assert [f.name for f in dataclasses.fields(ShardMetadata)] == [
        "shard_offsets",
        "shard_sizes",
        "placement",
    ]
    shard = ShardMetadata([0, 0], [2, 2])
    assert shard.placement is None
    keyword = ShardMetadata(shard_offsets=[1], shard_sizes=[3], placement="rank:0/cpu")
    assert (keyword.shard_offsets, keyword.shard_sizes) == ([1], [3])


def test_shard_metadata_converts_a_string_placement() -> None:
    shard = ShardMetadata([0, 0], [2, 2], "rank:1/cuda:1")
    assert isinstance(shard.placement, RemoteDevice)
    assert shard.placement == RemoteDevice("rank:1/cuda:1")


def test_shard_metadata_keeps_a_remote_device_placement() -> None:
    placement = RemoteDevice("worker0/cpu")
    assert ShardMetadata([0], [1], placement).placement is placement


@pytest.mark.parametrize(
    ("offsets", "sizes"),
    [
        pytest.param([0, 0], [2, 2], id="lists"),
        pytest.param((0, 4), (2, 2), id="tuples"),
        pytest.param(torch.Size([0, 4]), torch.Size([2, 2]), id="torch-size"),
        pytest.param([0, 0], torch.Size([2, 2]), id="mixed"),
    ],
)
def test_shard_metadata_stores_sequences_as_given(offsets: Any, sizes: Any) -> None:
    shard = ShardMetadata(offsets, sizes, "rank:0/cpu")
    assert shard.shard_offsets is offsets
    assert shard.shard_sizes is sizes


@pytest.mark.parametrize(
    ("offsets", "sizes"),
    [([0, 0], [0, 5]), ([3], [0]), ([0, 0, 0], [0, 0, 0]), ([], [])],
    ids=["zero-rows", "empty-1d", "all-zero", "zero-dim"],
)
def test_shard_metadata_zero_sizes_are_legal(offsets: list[int], sizes: list[int]) -> None:
    assert ShardMetadata(offsets, sizes, "rank:0/cpu").shard_sizes == sizes


@pytest.mark.parametrize(
    ("offsets", "sizes", "message"),
    [
        pytest.param(
            [0, 0],
            [1],
            "shard_offsets and shard_sizes should have the same number of elements, "
            "found 2 and [1] respectively",
            id="length-list",
        ),
        pytest.param(
            [0],
            (1, 2, 3),
            "shard_offsets and shard_sizes should have the same number of elements, "
            "found 1 and (1, 2, 3) respectively",
            id="length-tuple",
        ),
        pytest.param(
            [0, 0, 0],
            torch.Size([4]),
            "shard_offsets and shard_sizes should have the same number of elements, "
            "found 3 and torch.Size([4]) respectively",
            id="length-size",
        ),
        pytest.param([-1, 0], [1, 1], "shard_offsets should be >=0", id="negative-offset"),
        pytest.param([0, -5], [1, 1], "shard_offsets should be >=0", id="negative-last-offset"),
        pytest.param([0, 0], [-1, 1], "shard_sizes should be >= 0", id="negative-size"),
        pytest.param([0, 0], [1, -1], "shard_sizes should be >= 0", id="negative-last-size"),
        # Validation order: the lengths first, then offsets before sizes.
        pytest.param(
            [-1, 0],
            [-1],
            "shard_offsets and shard_sizes should have the same number of elements, "
            "found 2 and [-1] respectively",
            id="length-before-negatives",
        ),
        pytest.param([-1], [-1], "shard_offsets should be >=0", id="offset-before-size"),
    ],
)
def test_shard_metadata_validation(offsets: Any, sizes: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        ShardMetadata(offsets, sizes, "rank:0/cpu")
    assert type(info.value) is ValueError
    assert str(info.value) == message


def test_shard_metadata_parses_the_placement_before_validating() -> None:
    with pytest.raises(ValueError) as info:
        ShardMetadata([0], [1, 2], "a/b/c")
    assert str(info.value) == "Could not parse remote_device: a/b/c" + PARSE_ERROR_TAIL
    with pytest.raises(ValueError) as info:
        ShardMetadata([0], [1], placement="cuda:foo")
    assert str(info.value) == "Could not parse remote_device: cuda:foo" + PARSE_ERROR_TAIL
    with pytest.raises(RuntimeError, match=re.escape("Invalid device string: 'cpu2'")):
        ShardMetadata([-1], [1, 2], "rank:0/cpu2")


def test_shard_metadata_equality() -> None:
    shard = ShardMetadata([0, 0], [2, 2], "rank:0/cpu")
    assert shard == ShardMetadata([0, 0], [2, 2], RemoteDevice("rank:0/cpu"))
    assert shard != ShardMetadata([0, 2], [2, 2], "rank:0/cpu")
    assert shard != ShardMetadata([0, 0], [2, 1], "rank:0/cpu")
    assert shard != ShardMetadata([0, 0], [2, 2], "rank:1/cpu")
    assert shard != ShardMetadata([0, 0], [2, 2])
    # Dataclass equality compares the stored sequences: a tuple is not a list.
    assert shard != ShardMetadata((0, 0), (2, 2), "rank:0/cpu")
    assert shard != "ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 2], placement=rank:0/cpu)"


@pytest.mark.parametrize("placement", ["rank:0/cpu", "worker1/cuda:0", "cuda:1", None])
def test_shard_metadata_hash_is_consistent_with_equality(placement: str | None) -> None:
    a = ShardMetadata([0, 4], [4, 4], placement)
    b = ShardMetadata([0, 4], [4, 4], placement)
    assert a == b
    assert hash(a) == hash(b)
    by_shard = {a: "a"}
    assert by_shard[b] == "a"
    assert len({a, b, ShardMetadata([4, 4], [4, 4], placement)}) == 2


def test_shard_metadata_hash_accepts_tuples_and_sizes() -> None:
    assert hash(ShardMetadata((0, 1), torch.Size([2, 2]), "rank:0/cpu")) == hash(
        ShardMetadata((0, 1), torch.Size([2, 2]), "rank:0/cpu")
    )


def test_shard_metadata_repr() -> None:
    shard = ShardMetadata([0, 0], [2, 2], "rank:0/cpu")
    assert (
        repr(shard)
        == "ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 2], placement=rank:0/cpu)"
    )
    assert repr(ShardMetadata([1], [0])) == (
        "ShardMetadata(shard_offsets=[1], shard_sizes=[0], placement=None)"
    )


def test_shard_metadata_has_slots() -> None:
    assert set(ShardMetadata.__slots__) == {"shard_offsets", "shard_sizes", "placement"}
    shard = ShardMetadata([0], [1])
    assert not hasattr(shard, "__dict__")
    with pytest.raises(AttributeError):
        shard.unknown = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("placement", ["rank:3/cuda:3", "worker0/cpu", "meta", None])
def test_shard_metadata_pickle_round_trip(placement: str | None, protocol: int) -> None:
    shard = ShardMetadata([0, 2, 4], [1, 0, 3], placement)
    loaded = pickle.loads(pickle.dumps(shard, protocol=protocol))
    assert loaded == shard
    assert hash(loaded) == hash(shard)
    assert copy.deepcopy(shard) == shard


# --------------------------------------------------------------------------------------------
# TensorProperties
# --------------------------------------------------------------------------------------------


def test_tensor_properties_defaults() -> None:
    props = TensorProperties()
    assert props.dtype == torch.get_default_dtype()
    assert props.layout == torch.strided
    assert props.requires_grad is False
    assert props.memory_format == torch.contiguous_format
    assert props.pin_memory is False


def test_tensor_properties_positional_field_order() -> None:
    assert [f.name for f in dataclasses.fields(TensorProperties)] == [
        "dtype",
        "layout",
        "requires_grad",
        "memory_format",
        "pin_memory",
    ]
    props = TensorProperties(torch.int8, torch.sparse_coo, True, torch.channels_last, True)
    assert props == TensorProperties(
        dtype=torch.int8,
        layout=torch.sparse_coo,
        requires_grad=True,
        memory_format=torch.channels_last,
        pin_memory=True,
    )


def test_tensor_properties_dtype_default_is_taken_per_instance() -> None:
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert TensorProperties().dtype == torch.float64
        assert ShardedTensorMetadata().tensor_properties.dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert TensorProperties().dtype == previous


@pytest.mark.parametrize(
    ("make", "dtype", "layout", "requires_grad"),
    [
        pytest.param(lambda: torch.zeros(2, 3), torch.float32, torch.strided, False, id="float"),
        pytest.param(
            lambda: torch.zeros(2, dtype=torch.float16, requires_grad=True),
            torch.float16,
            torch.strided,
            True,
            id="requires-grad",
        ),
        pytest.param(
            lambda: torch.arange(6, dtype=torch.int64), torch.int64, torch.strided, False, id="int"
        ),
        pytest.param(
            lambda: torch.eye(3).to_sparse(), torch.float32, torch.sparse_coo, False, id="sparse"
        ),
        pytest.param(
            lambda: torch.zeros(4, 3).t(), torch.float32, torch.strided, False, id="transposed"
        ),
        pytest.param(
            lambda: torch.zeros(1, 3, 2, 2).to(memory_format=torch.channels_last),
            torch.float32,
            torch.strided,
            False,
            id="channels-last",
        ),
    ],
)
def test_create_from_tensor(
    make: Callable[[], torch.Tensor],
    dtype: torch.dtype,
    layout: torch.layout,
    requires_grad: bool,
) -> None:
    props = TensorProperties.create_from_tensor(make())
    # The memory format is always recorded as contiguous; a CPU tensor is never pinned here.
    assert props == TensorProperties(dtype, layout, requires_grad, torch.contiguous_format, False)


def test_mem_format_encoding_values() -> None:
    assert {member.name: member.value for member in MEM_FORMAT_ENCODING} == {
        "TORCH_CONTIGUOUS_FORMAT": 0,
        "TORCH_CHANNELS_LAST": 1,
        "TORCH_PRESERVE_FORMAT": 2,
    }


@pytest.mark.parametrize(
    ("memory_format", "encoding"),
    [
        (torch.contiguous_format, MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT),
        (torch.channels_last, MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST),
        (torch.preserve_format, MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT),
    ],
    ids=["contiguous", "channels-last", "preserve"],
)
def test_getstate_is_the_upstream_five_tuple(
    memory_format: torch.memory_format, encoding: MEM_FORMAT_ENCODING
) -> None:
    props = TensorProperties(torch.bfloat16, torch.strided, True, memory_format, False)
    state = props.__getstate__()
    assert state == (torch.bfloat16, torch.strided, True, encoding, False)
    assert type(state) is tuple
    assert state[3] is encoding


@pytest.mark.parametrize(
    "memory_format", [torch.channels_last_3d, None, []], ids=["channels-last-3d", "none", "list"]
)
def test_pickling_an_unencodable_memory_format_fails(memory_format: Any) -> None:
    props = TensorProperties(memory_format=memory_format)
    with pytest.raises(RuntimeError) as info:
        pickle.dumps(props)
    assert str(info.value) == f"Invalid torch.memory_format: {memory_format}"


def test_pickling_channels_last_3d_message() -> None:
    with pytest.raises(RuntimeError) as info:
        TensorProperties(memory_format=torch.channels_last_3d).__getstate__()
    assert str(info.value) == "Invalid torch.memory_format: torch.channels_last_3d"


@pytest.mark.parametrize(
    "encoding", [3, 0, None, "TORCH_CHANNELS_LAST", []], ids=["3", "raw-0", "none", "name", "list"]
)
def test_unpickling_an_unknown_encoding_fails(encoding: Any) -> None:
    props = TensorProperties.__new__(TensorProperties)
    with pytest.raises(RuntimeError) as info:
        props.__setstate__((torch.float32, torch.strided, False, encoding, False))
    assert str(info.value) == f"Invalid torch.memory_format encoding: {encoding}"


def test_setstate_restores_every_field() -> None:
    props = TensorProperties.__new__(TensorProperties)
    props.__setstate__(
        (torch.int16, torch.sparse_coo, True, MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT, True)
    )
    assert props == TensorProperties(
        torch.int16, torch.sparse_coo, True, torch.preserve_format, True
    )


def test_tensor_properties_to_json_refuses_what_it_cannot_read_back() -> None:
    with pytest.raises(RuntimeError, match=re.escape("Invalid torch.memory_format: None")):
        TensorProperties(memory_format=None).to_json()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("dtype must be a torch.dtype")):
        TensorProperties(dtype="float32").to_json()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("layout must be a torch.layout")):
        TensorProperties(layout=None).to_json()  # type: ignore[arg-type]


def test_truthy_flags_are_written_as_json_booleans() -> None:
    props = TensorProperties(requires_grad=1, pin_memory=0)  # type: ignore[arg-type]
    body = json.loads(props.to_json())["value"]
    assert body["requires_grad"] is True
    assert body["pin_memory"] is False
    assert TensorProperties.from_json(props.to_json()) == props


def test_channels_last_3d_round_trips_through_json() -> None:
    # Only pickling is limited to the three encodable formats; the JSON form names them all.
    props = TensorProperties(memory_format=torch.channels_last_3d)
    assert TensorProperties.from_json(props.to_json()) == props


def test_dtype_names() -> None:
    assert dtype_name(torch.float) == "float32"
    assert dtype_name(torch.long) == "int64"
    assert dtype_from_name("bfloat16") is torch.bfloat16
    with pytest.raises(MetadataFormatError, match="unknown dtype name 'float'"):
        dtype_from_name("float")


# --------------------------------------------------------------------------------------------
# ShardedTensorMetadata
# --------------------------------------------------------------------------------------------


def _two_shards() -> list[ShardMetadata]:
    return [
        ShardMetadata([0, 0], [2, 4], "rank:0/cpu"),
        ShardMetadata([2, 0], [2, 4], "rank:1/cpu"),
    ]


def test_sharded_tensor_metadata_defaults() -> None:
    meta = ShardedTensorMetadata()
    assert meta.shards_metadata == []
    assert meta.size == torch.Size([])
    assert isinstance(meta.size, torch.Size)
    assert meta.tensor_properties == TensorProperties()
    other = ShardedTensorMetadata()
    # Mutable defaults are per instance.
    assert other.shards_metadata is not meta.shards_metadata
    assert other.tensor_properties is not meta.tensor_properties


def test_sharded_tensor_metadata_equality() -> None:
    meta = ShardedTensorMetadata(_two_shards(), torch.Size([4, 4]), TensorProperties())
    assert meta == ShardedTensorMetadata(_two_shards(), torch.Size([4, 4]), TensorProperties())
    assert meta != ShardedTensorMetadata(
        list(reversed(_two_shards())), torch.Size([4, 4]), TensorProperties()
    )
    assert meta != ShardedTensorMetadata(_two_shards(), torch.Size([4, 5]), TensorProperties())
    assert meta != ShardedTensorMetadata(
        _two_shards(), torch.Size([4, 4]), TensorProperties(requires_grad=True)
    )
    assert meta != ShardedTensorMetadata(_two_shards()[:1], torch.Size([4, 4]))


def test_sharded_tensor_metadata_repr() -> None:
    meta = ShardedTensorMetadata(
        [ShardMetadata([0], [2], "rank:0/cpu")],
        torch.Size([2]),
        TensorProperties(torch.float32),
    )
    assert repr(meta) == (
        "ShardedTensorMetadata(shards_metadata=[ShardMetadata(shard_offsets=[0], "
        "shard_sizes=[2], placement=rank:0/cpu)], size=torch.Size([2]), "
        "tensor_properties=TensorProperties(dtype=torch.float32, layout=torch.strided, "
        "requires_grad=False, memory_format=torch.contiguous_format, pin_memory=False))"
    )


# --------------------------------------------------------------------------------------------
# Round trips over every dtype x layout x requires_grad x memory format x pin_memory
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("memory_format", PICKLABLE_MEMORY_FORMATS, ids=_name)
@pytest.mark.parametrize("layout", LAYOUTS, ids=_name)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_name)
def test_round_trips(
    dtype: torch.dtype, layout: torch.layout, memory_format: torch.memory_format
) -> None:
    # The two flags are looped rather than parametrized to keep the item count (and the run
    # time) down; every assertion message names the full combination through the repr.
    for requires_grad, pin_memory in itertools.product([False, True], repeat=2):
        props = TensorProperties(dtype, layout, requires_grad, memory_format, pin_memory)
        meta = ShardedTensorMetadata(
            [ShardMetadata([0, 0], [3, 4], "rank:0/cpu"), ShardMetadata([3, 0], [0, 4], "worker1")],
            torch.Size([3, 4]),
            props,
        )
        loaded_props = pickle.loads(pickle.dumps(props))
        assert loaded_props.__getstate__() == props.__getstate__(), props
        for value in (props, meta):
            assert pickle.loads(pickle.dumps(value)) == value, f"pickle: {props}"
            text = value.to_json()
            assert text == value.to_json(), f"unstable JSON: {props}"
            assert type(value).from_json(text) == value, f"JSON: {props}"
            assert type(value).from_json(text.encode()) == value, f"JSON bytes: {props}"
            plain = json.loads(json.dumps(value.to_dict()))
            assert type(value).from_dict(plain) == value, f"dict: {props}"


# --------------------------------------------------------------------------------------------
# The JSON form
# --------------------------------------------------------------------------------------------


def test_json_documents_are_pinned() -> None:
    assert JSON_VERSION == 1
    assert ShardMetadata([0, 2], [2, 2], "rank:1/cuda:1").to_json() == (
        '{"kind": "ShardMetadata", "value": {"offsets": [0, 2], "placement": "rank:1/cuda:1", '
        '"sizes": [2, 2]}, "version": 1}'
    )
    assert TensorProperties(torch.float32).to_json() == (
        '{"kind": "TensorProperties", "value": {"dtype": "float32", "layout": "strided", '
        '"memory_format": "contiguous_format", "pin_memory": false, "requires_grad": false}, '
        '"version": 1}'
    )
    meta = ShardedTensorMetadata(
        [ShardMetadata([0], [2])], torch.Size([2]), TensorProperties(torch.int8)
    )
    assert json.loads(meta.to_json()) == {
        "kind": "ShardedTensorMetadata",
        "version": 1,
        "value": {
            "shards": [{"offsets": [0], "sizes": [2], "placement": None}],
            "size": [2],
            "tensor_properties": {
                "dtype": "int8",
                "layout": "strided",
                "requires_grad": False,
                "memory_format": "contiguous_format",
                "pin_memory": False,
            },
        },
    }


@pytest.mark.parametrize(
    "shard",
    [
        ShardMetadata([0, 0], [2, 2], "rank:0/cpu"),
        ShardMetadata([5], [0], "rank:12/cuda:3"),
        ShardMetadata([0], [1], "worker0"),
        ShardMetadata([0], [1], "cpu2"),
        ShardMetadata([0, 1, 2], [3, 4, 5], "meta"),
        ShardMetadata([0], [1], RemoteDevice(torch.device("cuda", 1))),
        ShardMetadata([2**40], [2**33], None),
        ShardMetadata([], [], None),
    ],
    ids=repr,
)
def test_shard_metadata_json_round_trip(shard: ShardMetadata) -> None:
    text = shard.to_json()
    assert text == shard.to_json()
    loaded = ShardMetadata.from_json(text)
    assert loaded == shard
    assert hash(loaded) == hash(shard)
    assert ShardMetadata.from_dict(shard.to_dict()) == shard


def test_sharded_tensor_metadata_json_round_trip_with_empty_defaults() -> None:
    meta = ShardedTensorMetadata()
    assert ShardedTensorMetadata.from_json(meta.to_json()) == meta


def test_metadata_format_error_is_a_value_error() -> None:
    assert issubclass(MetadataFormatError, ValueError)


_DROP = object()


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """``base`` with ``changes`` applied; a change to ``_DROP`` removes the key."""
    merged = {**base, **changes}
    return {key: value for key, value in merged.items() if value is not _DROP}


def _document(kind: str, body: Any, /, **overrides: Any) -> str:
    """A JSON document of ``kind`` around ``body``, with envelope keys overridden or dropped."""
    return json.dumps(_with({"kind": kind, "version": 1, "value": body}, **overrides))


_SHARD = {"offsets": [0, 0], "sizes": [2, 2], "placement": "rank:0/cpu"}
_PROPS = {
    "dtype": "float32",
    "layout": "strided",
    "requires_grad": False,
    "memory_format": "contiguous_format",
    "pin_memory": False,
}
_META = {"shards": [_SHARD], "size": [2, 2], "tensor_properties": _PROPS}


_READERS: dict[str, Callable[[str | bytes], object]] = {
    "ShardMetadata": ShardMetadata.from_json,
    "TensorProperties": TensorProperties.from_json,
    "ShardedTensorMetadata": ShardedTensorMetadata.from_json,
}
_VALID_BODIES = {
    "ShardMetadata": _SHARD,
    "TensorProperties": _PROPS,
    "ShardedTensorMetadata": _META,
}


def _envelope_cases() -> list[Any]:
    """Malformed documents around a valid body, for each of the three kinds."""
    cases = []
    for kind, body in _VALID_BODIES.items():
        envelope = [
            ("not-json-empty", "", "is not valid JSON"),
            ("not-json-truncated", _document(kind, body)[:-1], "is not valid JSON"),
            ("not-json-text", "shard metadata", "is not valid JSON"),
            ("not-utf8", b"\xff\xfe\xfa", "is not valid JSON"),
            # Was: RecursionError, and a repeated key read as the parser chose.
            ("nested", "[" * 100_000 + "]" * 100_000, "is nested too deeply"),
            (
                "repeated-key",
                _document(kind, body).replace("{", '{"kind": 0, ', 1),
                "repeats the key 'kind'",
            ),
            ("document-list", "[]", "must be a JSON object, got list"),
            ("document-null", "null", "must be a JSON object, got NoneType"),
            ("document-number", "1", "must be a JSON object, got int"),
            ("unknown-key", _document(kind, body, extra=1), "unknown keys ['extra']"),
            ("missing-value", _document(kind, body, value=_DROP), "missing keys ['value']"),
            ("missing-kind", _document(kind, body, kind=_DROP), "missing keys ['kind']"),
            ("missing-version", _document(kind, body, version=_DROP), "missing keys ['version']"),
            ("wrong-kind", _document("Metadata", body), f"expected a {kind} JSON document"),
            ("kind-null", _document(kind, body, kind=None), f"expected a {kind} JSON document"),
            ("version-2", _document(kind, body, version=2), "JSON version 2"),
            ("version-0", _document(kind, body, version=0), "JSON version 0"),
            ("version-str", _document(kind, body, version="1"), "JSON version '1'"),
            ("version-true", _document(kind, body, version=True), "JSON version True"),
            ("version-float", _document(kind, body, version=1.0), "JSON version 1.0"),
            ("version-null", _document(kind, body, version=None), "JSON version None"),
            ("value-list", _document(kind, []), "must be a JSON object, got list"),
            ("value-null", _document(kind, None), "must be a JSON object, got NoneType"),
            ("body-unknown-key", _document(kind, _with(body, extra=0)), "unknown keys ['extra']"),
        ]
        first_key = next(iter(body))
        envelope.append(
            (
                "body-missing-key",
                _document(kind, _with(body, **{first_key: _DROP})),
                f"missing keys ['{first_key}']",
            )
        )
        cases += [
            pytest.param(kind, text, match, id=f"{kind}-{name}") for name, text, match in envelope
        ]
    return cases


def _field_cases() -> list[Any]:
    """Well-formed documents whose fields have wrong types or unknown values."""
    shard_cases = [
        ("offsets-bool", _with(_SHARD, offsets=[True, 0]), "offsets must be a list of integers"),
        ("offsets-float", _with(_SHARD, offsets=[0.0, 0]), "offsets must be a list of integers"),
        ("offsets-str", _with(_SHARD, offsets=["0", "0"]), "offsets must be a list of integers"),
        ("offsets-scalar", _with(_SHARD, offsets=0), "offsets must be a list of integers"),
        ("offsets-null", _with(_SHARD, offsets=None), "offsets must be a list of integers"),
        ("offsets-object", _with(_SHARD, offsets={"0": 0}), "offsets must be a list of integers"),
        ("sizes-bool", _with(_SHARD, sizes=[2, False]), "sizes must be a list of integers"),
        ("sizes-nested", _with(_SHARD, sizes=[[2], [2]]), "sizes must be a list of integers"),
        ("placement-int", _with(_SHARD, placement=0), "placement must be a string"),
        ("placement-bool", _with(_SHARD, placement=True), "placement must be a string"),
        ("placement-list", _with(_SHARD, placement=["cpu"]), "placement must be a string"),
        (
            "placement-unparsable",
            _with(_SHARD, placement="a/b/c"),
            "Could not parse remote_device: a/b/c",
        ),
        (
            "placement-bad-device",
            _with(_SHARD, placement="rank:0/cpu2"),
            "Invalid device string: 'cpu2'",
        ),
        ("negative-offset", _with(_SHARD, offsets=[-1, 0]), "shard_offsets should be >=0"),
        ("negative-size", _with(_SHARD, sizes=[2, -2]), "shard_sizes should be >= 0"),
        ("length-mismatch", _with(_SHARD, sizes=[2]), "should have the same number of elements"),
    ]
    props_cases = [
        ("dtype-alias", _with(_PROPS, dtype="float"), "unknown dtype name 'float'"),
        ("dtype-torch-prefix", _with(_PROPS, dtype="torch.float32"), "unknown dtype name"),
        ("dtype-case", _with(_PROPS, dtype="Float32"), "unknown dtype name 'Float32'"),
        ("dtype-int", _with(_PROPS, dtype=6), "unknown dtype name 6"),
        ("dtype-null", _with(_PROPS, dtype=None), "unknown dtype name None"),
        ("layout-unknown", _with(_PROPS, layout="dense"), "unknown layout 'dense'"),
        ("layout-prefix", _with(_PROPS, layout="torch.strided"), "unknown layout"),
        ("layout-int", _with(_PROPS, layout=0), "unknown layout 0"),
        (
            "memory-format-unknown",
            _with(_PROPS, memory_format="channels_first"),
            "unknown memory format 'channels_first'",
        ),
        (
            "memory-format-legacy-alias",
            _with(_PROPS, memory_format="legacy_contiguous_format"),
            "unknown memory format 'legacy_contiguous_format'",
        ),
        ("memory-format-int", _with(_PROPS, memory_format=1), "unknown memory format 1"),
        ("requires-grad-int", _with(_PROPS, requires_grad=1), "requires_grad must be true or"),
        ("requires-grad-str", _with(_PROPS, requires_grad="true"), "requires_grad must be true"),
        ("requires-grad-null", _with(_PROPS, requires_grad=None), "requires_grad must be true"),
        ("pin-memory-int", _with(_PROPS, pin_memory=0), "pin_memory must be true or false"),
        ("pin-memory-str", _with(_PROPS, pin_memory="false"), "pin_memory must be true or false"),
    ]
    meta_cases = [
        ("shards-object", _with(_META, shards={}), "shards must be a list"),
        ("shards-null", _with(_META, shards=None), "shards must be a list"),
        ("shards-str", _with(_META, shards="[]"), "shards must be a list"),
        ("shard-not-object", _with(_META, shards=[[0, 2]]), "ShardMetadata must be a JSON object"),
        (
            "shard-missing-key",
            _with(_META, shards=[_with(_SHARD, placement=_DROP)]),
            "missing keys ['placement'] in ShardMetadata",
        ),
        (
            "shard-bad-offsets",
            _with(_META, shards=[_SHARD, _with(_SHARD, offsets=[0, True])]),
            "offsets must be a list of integers",
        ),
        ("size-bool", _with(_META, size=[2, True]), "size must be a list of integers"),
        ("size-float", _with(_META, size=[2.0, 2]), "size must be a list of integers"),
        ("size-str", _with(_META, size="2,2"), "size must be a list of integers"),
        ("size-null", _with(_META, size=None), "size must be a list of integers"),
        (
            "properties-not-object",
            _with(_META, tensor_properties="float32"),
            "TensorProperties must be a JSON object, got str",
        ),
        (
            "properties-missing-key",
            _with(_META, tensor_properties=_with(_PROPS, pin_memory=_DROP)),
            "missing keys ['pin_memory'] in TensorProperties",
        ),
        (
            "properties-bad-dtype",
            _with(_META, tensor_properties=_with(_PROPS, dtype="float128")),
            "unknown dtype name 'float128'",
        ),
    ]
    cases = []
    for kind, kind_cases in [
        ("ShardMetadata", shard_cases),
        ("TensorProperties", props_cases),
        ("ShardedTensorMetadata", meta_cases),
    ]:
        cases += [
            pytest.param(kind, _document(kind, body), match, id=f"{kind}-{name}")
            for name, body, match in kind_cases
        ]
    return cases


@pytest.mark.parametrize(("kind", "text", "match"), _envelope_cases() + _field_cases())
def test_json_rejections(kind: str, text: str | bytes, match: str) -> None:
    with pytest.raises(MetadataFormatError, match=re.escape(match)):
        _READERS[kind](text)


@pytest.mark.parametrize(
    ("reader", "data"),
    [
        (ShardMetadata.from_dict, [0, 0]),
        (ShardMetadata.from_dict, _with(_SHARD, extra=None)),
        (TensorProperties.from_dict, _with(_PROPS, dtype="complex256")),
        (ShardedTensorMetadata.from_dict, None),
    ],
    ids=["shard-list", "shard-extra-key", "props-dtype", "meta-none"],
)
def test_from_dict_rejections(reader: Callable[[object], object], data: object) -> None:
    with pytest.raises(MetadataFormatError):
        reader(data)


def test_rejection_names_the_offending_document_kind() -> None:
    with pytest.raises(MetadataFormatError) as info:
        TensorProperties.from_json(_document("ShardMetadata", _SHARD))
    assert str(info.value) == (
        "expected a TensorProperties JSON document, got kind 'ShardMetadata'"
    )
    with pytest.raises(MetadataFormatError) as info:
        ShardMetadata.from_json(_document("ShardMetadata", _SHARD, version=2))
    assert str(info.value) == (
        "unsupported ShardMetadata JSON version 2; this shardwise reads version 1"
    )


def test_negative_values_are_reported_dim_by_dim():
    # The first dim with a negative offset or size decides, offset checked before size.
    with pytest.raises(ValueError, match=re.escape("shard_sizes should be >= 0")):
        ShardMetadata([0, -1], [-1, 0])
    with pytest.raises(ValueError, match=re.escape("shard_offsets should be >=0")):
        ShardMetadata([-1, 0], [0, -1])


# -- keeps_requires_grad: the one rule of "does a copy keep requires_grad" --------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
def test_a_differentiable_copy_keeps_requires_grad_in_grad_mode_only(dtype: torch.dtype) -> None:
    source = torch.zeros(2, dtype=dtype, requires_grad=True)
    assert keeps_requires_grad(True, dtype) is source.clone().requires_grad is True
    assert keeps_requires_grad(False, dtype) is False
    with torch.no_grad():
        assert keeps_requires_grad(True, dtype) is source.clone().requires_grad is False
        # A new leaf keeps the flag whatever the mode, as torch.zeros_like(..., requires_grad=)
        assert keeps_requires_grad(True, dtype, new_leaf=True) is True
        assert torch.zeros_like(source, requires_grad=True).requires_grad


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8])
def test_an_integer_copy_never_requires_grad(dtype: torch.dtype) -> None:
    source = torch.zeros(2, requires_grad=True)
    assert source.to(dtype).requires_grad is False
    assert keeps_requires_grad(True, dtype) is False
    assert keeps_requires_grad(True, dtype, new_leaf=True) is False
