"""Python values a training loop keeps in its state dict come back exactly, types included
(NumPy numbers and arrays, ``torch.Size``, named tuples: ``pyjson2``), or are refused at save
with a hint, never silently changed; what a save writes, a load accepts; a hostile tagged value
is a ``CheckpointFormatError``."""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import math
import random
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.entries.items import describe_object
from shardwise.checkpoint.entries.pyjson import (
    MAX_DEPTH,
    MAX_FIELDS,
    TAGS2,
    json_depth,
    python_form,
    tagged,
    untag,
)
from shardwise.checkpoint.index import ObjectRecord, decode_text
from tests import _hostile as h

Point = collections.namedtuple("Point", "x y")
# rename=True turns the keyword field into "_1", which collections.namedtuple refuses.
Renamed = collections.namedtuple("Renamed", ["a", "def"], rename=True)  # type: ignore[misc]


class Pair(typing.NamedTuple):
    first: Any
    second: Any


class Color(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    LOW = 1


class Name(str):
    pass


class Count(int):
    pass


class Items(list):  # type: ignore[type-arg]
    pass


def same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are equal and of the same types all the way down (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return (
            list(a) == list(b)
            and all(same(key, other) for key, other in zip(a, b, strict=True))
            and all(same(a[key], b[key]) for key in a)
        )
    return bool(a == b)


def stored(value: Any, like: Any = None) -> Any:
    """``value`` as a save stores it and a load decodes it (through the index's own checks)."""
    item = describe_object("v", value, allow_pickle=False)
    return decode_text(ObjectRecord("v", item.encoding, text=item.payload.decode()), like)


def round_trip(tmp_path: Path, state: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    ckpt.save(state, tmp_path / "c")
    ckpt.load(target, tmp_path / "c")
    return target


NUMPY_SCALARS = [
    np.bool_(True),
    np.int8(-128),
    np.int16(300),
    np.int32(-(2**31)),
    np.int64(2**63 - 1),
    np.uint8(255),
    np.uint16(65535),
    np.uint32(2**32 - 1),
    np.uint64(2**64 - 1),
    np.float16(0.1),
    np.float32(0.1),
    np.float64(math.pi),
    np.float32("nan"),
    np.float64("-inf"),
    np.float16(-0.0),
    np.complex64(1.5 - 2j),
    np.complex128(complex(math.e, -math.inf)),
]


@pytest.mark.parametrize("value", NUMPY_SCALARS, ids=lambda v: f"{type(v).__name__}")
def test_numpy_numbers_come_back_with_their_dtype(value: Any) -> None:
    assert same(stored(value), value)


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12, dtype=np.int16).reshape(3, 4),
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        np.arange(10.0)[::3],  # strided
        np.array(5.5),  # 0-d
        np.zeros((0, 3), np.float32),
        np.arange(3, dtype=">i4"),  # big-endian stays big-endian
        np.array([True, False]),
        np.array([1 + 2j], np.complex64),
        np.random.default_rng(0).random((4, 5)).astype(np.float16),
    ],
    ids=["int16", "fortran", "strided", "0d", "empty", "big-endian", "bool", "complex", "f16"],
)
def test_numpy_arrays_come_back_equal_writable_and_of_their_dtype(value: np.ndarray) -> None:
    back = stored(value)
    assert same(back, value)
    assert back.dtype == value.dtype and back.flags.writeable


def test_sizes_and_named_tuples_come_back_as_themselves() -> None:
    assert same(stored(torch.Size([2, 3])), torch.Size([2, 3]))
    # The class of the value it replaces, when name and fields agree...
    back = stored((Point(1, 2), [Pair(np.int8(3), (4,))]), like=(Point(0, 0), [Pair(0, 0)]))
    assert same(back, (Point(1, 2), [Pair(np.int8(3), (4,))]))
    # ... else a class of the same name and fields: equal, and fields by name.
    made = stored(Point(1.5, "a"))
    assert type(made) is not Point and type(made).__name__ == "Point"
    assert made == (1.5, "a") and made.x == 1.5 and made.y == "a" and made._fields == ("x", "y")
    other = stored(Point(1, 2), like=Pair(0, 0))  # another class: not taken
    assert type(other).__name__ == "Point" and type(other) is not Pair


def test_numpy_rng_state_resumes_the_same_stream(tmp_path: Path) -> None:
    np.random.seed(1234)
    random.seed(99)
    state = {"numpy": np.random.get_state(), "python": random.getstate(), "step": np.int64(7)}
    expected = np.random.random(5), random.random()
    np.random.seed(0)
    random.seed(0)
    target = round_trip(tmp_path, state, {"numpy": None, "python": None, "step": None})
    np.random.set_state(target["numpy"])
    random.setstate(target["python"])
    assert np.array_equal(np.random.random(5), expected[0]) and random.random() == expected[1]
    assert same(target["step"], np.int64(7)) and same(target["numpy"], state["numpy"])


def test_a_named_tuple_leaf_keeps_the_class_of_the_state_dict(tmp_path: Path) -> None:
    state = {"cfg": Point(np.float32(0.5), (1, 2)), "shape": torch.Size([3, 4])}
    target = round_trip(tmp_path, state, {"cfg": Point(0, 0), "shape": None})
    assert type(target["cfg"]) is Point and same(target["cfg"], state["cfg"])
    assert same(target["shape"], torch.Size([3, 4]))


# -- refused, with a hint, instead of changed ---------------------------------------------------


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        (Level.LOW, r"store its value \(value\.value\)"),
        (Color.RED, r"store its value \(value\.value\)"),
        (Name("a"), r"Name is a subclass of str, which would come back as a plain str"),
        (Count(3), r"Count is a subclass of int"),
        (Items([1]), r"Items is a subclass of list"),
        (bytearray(b"ab"), r"store bytes\(value\)"),
        (memoryview(b"ab"), r"store bytes\(value\) \(it comes back as bytes\)$"),
        (np.array(["x"]), r"dtype <U1 have no exact JSON form.*torch\.from_numpy"),
        (np.longdouble(1), r"dtype float128 have no exact JSON form"),
        ((1, [Color.RED]), r"\[1\]\[0\] is a Color: store its value"),
        ({"a"}, "store it as a sorted list"),
    ],
)
def test_values_that_would_change_are_refused_with_a_hint(
    tmp_path: Path, value: Any, hint: str
) -> None:
    assert python_form(value) is None
    with pytest.raises(TypeError, match=hint):
        ckpt.save({"v": value}, tmp_path / "c")
    assert not (tmp_path / "c" / "shardwise.json").exists()


def test_refused_values_round_trip_exactly_with_pickle(tmp_path: Path) -> None:
    state = {"level": Level.LOW, "name": Name("a"), "data": bytearray(b"ab")}
    ckpt.save(state, tmp_path / "c", allow_pickle=True)
    target: dict[str, Any] = dict.fromkeys(state)
    ckpt.load(target, tmp_path / "c", allow_pickle=True)
    assert all(same(target[key], state[key]) for key in state)


def test_a_value_pickle_cannot_take_is_named_when_pickle_is_allowed(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"cannot save state_dict\['v'\] .* pickling it failed"):
        ckpt.save({"v": memoryview(b"ab")}, tmp_path / "c", allow_pickle=True)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"cannot save it: (AttributeError|PicklingError): Can't pickle.*key 'v'",
    ):
        ckpt.save({"v": lambda: 1}, tmp_path / "c", allow_pickle=True)
    assert not (tmp_path / "c" / "shardwise.json").exists()


def _nested(depth: int, kind: type) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = kind([value])
    return value


@pytest.mark.parametrize(
    ("value", "saved"),
    [
        (_nested(MAX_DEPTH, list), True),
        (_nested(MAX_DEPTH + 1, list), False),
        (_nested(MAX_DEPTH // 2, tuple), True),  # a tagged tuple is two levels of JSON
        (_nested(MAX_DEPTH // 2 + 1, tuple), False),
        (_nested(5000, list), False),  # beyond the interpreter's recursion limit
    ],
    ids=["list-64", "list-65", "tuple-32", "tuple-33", "list-5000"],
)
def test_a_save_refuses_the_nesting_a_load_refuses(tmp_path: Path, value: Any, saved: bool) -> None:
    if not saved:
        with pytest.raises(TypeError, match=f"deeper than {MAX_DEPTH} levels"):
            ckpt.save({"v": value}, tmp_path / "c")
        return
    target = round_trip(tmp_path, {"v": value}, {"v": None})
    assert same(target["v"], value)


def test_named_tuples_of_too_many_fields_are_not_stored_as_such() -> None:
    wide = collections.namedtuple("Wide", [f"f{i}" for i in range(MAX_FIELDS + 1)])  # type: ignore[misc]
    assert python_form(wide(*range(MAX_FIELDS + 1))) is None


# -- property: what is stored comes back exactly, and is accepted by the reader -----------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(NUMPY_SCALARS),
    st.builds(
        lambda values, dtype: np.array(values).astype(dtype),
        st.lists(st.integers(-100, 100), max_size=6),
        st.sampled_from(["int8", "uint16", "float32", "float64", "bool", "complex64"]),
    ),
    st.lists(st.integers(0, 9), max_size=4).map(torch.Size),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.one_of(
        st.text(max_size=4),
        st.integers(-5, 5),
        st.sampled_from(["__tuple__", "__numpy__", "__dict__"]),
    )
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.tuples(children, children).map(lambda pair: Point(*pair)),
    )


_values = st.recursive(_scalars, _containers, max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values)
def test_every_stored_value_comes_back_exactly_and_passes_the_reader(value: Any) -> None:
    assert python_form(value) is not None
    assert same(_unnamed(stored(value)), _unnamed(value))


def _unnamed(value: Any) -> Any:
    """``value`` with every named tuple as a plain tuple of its type's name (made classes are
    equal in name and fields, not identical)."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return (
            "namedtuple",
            type(value).__name__,
            value._fields,
            tuple(_unnamed(v) for v in value),
        )
    if type(value) in (list, tuple):
        return type(value)(_unnamed(v) for v in value)
    if type(value) is dict:
        return {k: _unnamed(v) for k, v in value.items()}
    return value


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 90), st.lists(st.sampled_from([list, tuple, Point]), min_size=1, max_size=3))
def test_a_value_is_stored_only_if_the_reader_accepts_its_depth(
    depth: int, kinds: list[Any]
) -> None:
    value: Any = np.int8(1)
    for level in range(depth):
        kind = kinds[level % len(kinds)]
        value = Point(value, 0) if kind is Point else kind([value])
    try:
        item = describe_object("v", value, allow_pickle=False)
    except TypeError as err:
        assert "deeper than" in str(err)
        return
    assert json_depth(json.loads(item.payload)) <= MAX_DEPTH
    decode_text(ObjectRecord("v", item.encoding, text=item.payload.decode()))


# -- hostile tagged values -------------------------------------------------------------------

HOSTILE = [
    '{"__numpy__": ["int8", 300]}',
    '{"__numpy__": ["int8", 1.5]}',
    '{"__numpy__": ["object", 1]}',
    '{"__numpy__": ["bool", 1]}',
    '{"__numpy__": ["float32", "x"]}',
    '{"__numpy__": ["float16", 1e300]}',
    '{"__numpy__": ["float32", 0.1]}',  # not a float32 value
    '{"__numpy__": ["complex64", [1]]}',
    '{"__numpy__": ["uint64", -1]}',
    '{"__numpy__": 3}',
    '{"__ndarray__": ["int8", [3], "AAA"]}',
    '{"__ndarray__": ["int8", [4611686018427387904, 4611686018427387904], "AAAA"]}',
    '{"__ndarray__": ["int8", [-1], ""]}',
    '{"__ndarray__": ["int8", [3], "!!!!"]}',
    '{"__ndarray__": ["int8", [3], "AAAA", "<"]}',
    '{"__ndarray__": ["V8", [1], "AAAAAAAAAAA="]}',
    '{"__ndarray__": ["int8", [true], "AAAA"]}',
    '{"__ndarray__": ["int8", [' + ",".join(["1"] * 65) + '], "AA=="]}',  # 65 dims
    '{"__size__": [1, "a"]}',
    '{"__size__": [true]}',
    '{"__namedtuple__": ["import os", ["a"], [1]]}',
    '{"__namedtuple__": ["N", ["_a"], [1]]}',
    '{"__namedtuple__": ["N", ["a", "a"], [1, 2]]}',
    '{"__namedtuple__": ["N", ["class"], [1]]}',
    '{"__namedtuple__": ["N", ["a"], [1, 2]]}',
    '{"__namedtuple__": ["N", ["a"]]}',
    '{"__namedtuple__": ["N", ["a"], [{"__numpy__": ["int8", 999]}]]}',
    '{"__dict__": [[{"__ndarray__": ["int8", [1], "AA=="]}, 1]]}',
]


@pytest.mark.parametrize("text", HOSTILE)
def test_a_malformed_tagged_value_is_a_format_error(text: str) -> None:
    with pytest.raises(ckpt.CheckpointFormatError, match=r"malformed|nested|does not hold"):
        decode_text(ObjectRecord("k", "pyjson2", text=text))
    if not text.startswith('{"__dict__"'):
        # The older tagged JSON has none of these tags: the same text is a plain dict there.
        assert type(decode_text(ObjectRecord("k", "pyjson", text=text))) is dict


def test_a_sealed_index_with_a_malformed_value_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c"
    ckpt.save({"w": torch.ones(3), "rng": np.random.get_state()}, path)
    document = h.read_document(path)
    row = next(row for row in document["objects"] if row[0] == "rng")
    assert row[1] == "pyjson2"
    row[2] = row[2].replace('"uint32", [624]', '"uint32", [625]')
    h.write_resealed(path, document)
    target: dict[str, Any] = {"w": torch.zeros(3), "rng": "before"}
    with pytest.raises(ckpt.CheckpointFormatError, match="does not hold 625 values"):
        ckpt.load(target, path)
    assert torch.equal(target["w"], torch.zeros(3)) and target["rng"] == "before"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_tagged_values_decode_or_are_format_errors(data: st.DataObject) -> None:
    value = (np.random.get_state(), Point(np.float32(1), torch.Size([2])), {1: np.int8(3)})
    text = describe_object("v", value, allow_pickle=False).payload.decode()
    position = data.draw(st.integers(0, len(text) - 1))
    replacement = data.draw(st.sampled_from(list('0123456789"[]{},:-.aeEfnrtu_ xAZ=+/')))
    mutated = text[:position] + replacement + text[position + 1 :]
    # It decodes, or it is refused as a format error: nothing else escapes.
    with contextlib.suppress(ckpt.CheckpointFormatError):
        decode_text(ObjectRecord("v", "pyjson2", text=mutated))


def test_untag_takes_the_like_class_only_where_it_stands() -> None:
    tree = json.loads(
        json.dumps({"__tuple__": [{"__namedtuple__": ["Point", ["x", "y"], [1, 2]]}]})
    )
    assert type(untag(tree, extended=True, like=(Point(0, 0),))[0]) is Point
    assert type(untag(tree, extended=True, like=[])[0]) is not Point
    assert type(untag(tree, extended=True, like="not a tuple")[0]) is not Point


def test_a_named_tuple_no_reader_could_make_is_refused_at_save(tmp_path: Path) -> None:
    # A reader without the class at hand could not rebuild it: it is not stored as such.
    value = Renamed(1, 2)
    assert Renamed._fields == ("a", "_1")
    assert python_form(value) is None
    with pytest.raises(TypeError, match="Renamed is a subclass of tuple"):
        ckpt.save({"v": value}, tmp_path / "c")
    ckpt.save({"v": value}, tmp_path / "c", allow_pickle=True)
    target: dict[str, Any] = {"v": None}
    ckpt.load(target, tmp_path / "c", allow_pickle=True)
    assert type(target["v"]) is Renamed and target["v"] == value


# -- strict decoding: an object holding a tag is one well-formed tag, through load too --------

# A tampered value per tag (and per way an object can hold a tag wrongly): each is refused.
TAMPERED = [
    ("json", '{"__tuple__": 5}'),  # a json value holds no tags: such a dict is pyjson
    ("json", '[1, {"a": {"__dict__": []}}]'),
    ("pyjson", '{"__tuple__": 5}'),
    ("pyjson", '{"__dict__": "x"}'),
    ("pyjson", '{"__tuple__": [1], "__dict__": [[1, 2]]}'),
    ("pyjson", '{"__tuple__": [1], "extra": 2}'),
    ("pyjson", '[{"__dict__": [["a", 1]]}]'),  # string keys only: a writer writes an object
    ("pyjson", '{"__dict__": [[1, 2], [1, 3]]}'),
    ("pyjson2", f'{{"__size__": [{2**70}]}}'),
    ("pyjson2", '{"__size__": [true]}'),
    ("pyjson2", '{"__numpy__": ["float32", 1]}'),
    ("pyjson2", '{"__numpy__": ["int8", 1], "__ndarray__": []}'),
    ("pyjson2", '{"__ndarray__": ["uint8", [1], "AQ==", ">"]}'),
    ("pyjson2", '{"__ndarray__": ["int8", [0, 4611686018427387904, 4], ""]}'),
    ("pyjson2", '{"__namedtuple__": ["P", ["\\ufb01", "fi"], [1, 2]]}'),
    ("pyjson2", '{"a": {"__namedtuple__": ["P", ["x"], [1, 2]]}}'),
]


@pytest.mark.parametrize(("encoding", "text"), TAMPERED)
def test_a_load_refuses_a_malformed_tag_naming_the_key(
    tmp_path: Path, encoding: str, text: str
) -> None:
    path = tmp_path / "c"
    ckpt.save({"w": torch.ones(2), "v": (1, 2)}, path)
    document = h.read_document(path)
    row = next(row for row in document["objects"] if row[0] == "v")
    row[1], row[2] = encoding, text
    h.write_resealed(path, document)
    target: dict[str, Any] = {"w": torch.zeros(2), "v": "before"}
    with pytest.raises(ckpt.CheckpointFormatError, match=r"malformed .*key 'v'") as caught:
        ckpt.load(target, path)
    assert caught.value.key == "v"
    assert torch.equal(target["w"], torch.zeros(2)) and target["v"] == "before"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values)
def test_the_json_of_every_stored_value_decodes_to_what_writes_it_again(value: Any) -> None:
    item = describe_object("v", value, allow_pickle=False)
    if item.encoding == "json":
        return
    tree = json.loads(item.payload)
    extended = item.encoding == "pyjson2"
    assert json.dumps(tagged(untag(tree, extended), extended)) == item.payload.decode()


# Hostile JSON: objects keyed by tags, with payloads of the right and wrong shapes and types
# and of the edge values of each rule.
_EDGE_INTS = [0, 1, -1, 2, 127, 128, -129, 255, 256, 2**31, 2**63 - 1, 2**63, -(2**63)]
_EDGE_INTS += [-(2**63) - 1, 2**64 - 1, 2**64, 2**70, 4611686018427387904]
_EDGE_TEXT = ["int8", "uint64", "float16", "float32", "complex64", "bool", "object", "V8"]
_EDGE_TEXT += ["", "AA==", "AQ==", "AR==", "AQI=", "AAAA", "A===", "!!!!", ">", "<"]
_EDGE_TEXT += ["N", "a", "b", "_a", "class", "import os", "\ufb01", "fi", "__tuple__"]
_json_atoms = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(_EDGE_INTS),
    st.integers(-3, 3),
    st.sampled_from([0.0, -0.0, 0.5, 0.1, 1.0, 1e39, 1e300, math.inf, -math.inf, math.nan]),
    st.sampled_from(_EDGE_TEXT),
    st.text(max_size=3),
)
_TAG_KEYS = sorted(TAGS2)


def _hostile_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.sampled_from([*_TAG_KEYS, "a", "x"]), children, max_size=3),
        st.builds(lambda tag, payload: {tag: payload}, st.sampled_from(_TAG_KEYS), children),
        st.builds(
            lambda tag, payload: {tag: payload},
            st.sampled_from(_TAG_KEYS),
            st.lists(children, min_size=1, max_size=4),
        ),
    )


_hostile_json = st.recursive(_json_atoms, _hostile_containers, max_leaves=12)


def _check_decodes_as_written_or_is_refused(tree: Any) -> None:
    """``tree`` decodes to a value the writer stores in that encoding, as exactly that JSON, or
    it is refused with a ``ValueError`` (and nothing else escapes)."""
    text = json.dumps(tree)
    for extended in (False, True):
        try:
            value = untag(json.loads(text), extended)
        except ValueError:
            continue
        form = python_form(value)
        assert form is not None and (extended or form <= 1), (text, extended)
        assert json.dumps(tagged(value, extended)) == text, (text, extended)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_hostile_json)
def test_hostile_json_decodes_to_what_writes_it_or_is_refused(tree: Any) -> None:
    _check_decodes_as_written_or_is_refused(tree)


def _nodes(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The paths to every list and object of ``tree`` and to everything in them."""
    found = [path]
    if type(tree) is list:
        for i, item in enumerate(tree):
            found += _nodes(item, (*path, i))
    elif type(tree) is dict:
        for key, item in tree.items():
            found += _nodes(item, (*path, key))
    return found


def _replaced(tree: Any, path: tuple[Any, ...], make: Any) -> Any:
    """A copy of ``tree`` with the node at ``path`` replaced by ``make(node)``."""
    if not path:
        return make(tree)
    copy = list(tree) if type(tree) is list else dict(tree)
    copy[path[0]] = _replaced(tree[path[0]], path[1:], make)
    return copy


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values, st.data())
def test_mutated_tagged_trees_decode_to_what_writes_them_or_are_refused(
    value: Any, data: st.DataObject
) -> None:
    tree = json.loads(json.dumps(tagged(value, extended=True)))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_nodes(tree)))
        other = data.draw(_hostile_json)
        tag = data.draw(st.sampled_from([*_TAG_KEYS, "x"]))
        mutations = {
            "replace": lambda node, other=other: other,
            "wrap": lambda node, tag=tag: {tag: node},
            "add a key": lambda node, tag=tag, other=other: (
                {**node, tag: other} if type(node) is dict else [node, other]
            ),
            "drop an item": lambda node: (
                node[:-1]
                if type(node) is list
                else dict(list(node.items())[1:])
                if type(node) is dict
                else node
            ),
            "append an item": lambda node, other=other: (
                [*node, other] if type(node) is list else node
            ),
        }
        tree = _replaced(tree, path, mutations[data.draw(st.sampled_from(sorted(mutations)))])
    _check_decodes_as_written_or_is_refused(tree)
