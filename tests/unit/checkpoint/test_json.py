"""``checkpoint._json``: which values JSON gives back unchanged, and tagged JSON."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from shardwise.checkpoint.entries.pyjson import python_form, tagged, untag
from shardwise.checkpoint.metadata_json import check_json_value


@pytest.mark.parametrize(
    "value",
    [None, True, 3, 2.5, "s", [], {}, [1, [2, {"a": None}]], {"a": {"b": [1.0, "x"]}}],
)
def test_json_values_have_no_problem(value: object) -> None:
    check_json_value(value, "v")
    assert json.loads(json.dumps(value)) == value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((1, 2), "v: tuple is not JSON-able (use None, bool, int, float, str, list or dict"),
        ([1, {"a": [0, {2}]}], "v[1]['a'][1]: set is not JSON-able"),
        ({"a": {3: 1}}, "v['a']: JSON object keys must be strings, got 3"),
        ([0, math.nan], "v[1]: nan has no JSON form"),
        ({"x": -math.inf}, "v['x']: -inf has no JSON form"),
    ],
)
def test_a_problem_names_the_path_to_it(value: object, message: str) -> None:
    with pytest.raises(TypeError) as caught:
        check_json_value(value, "v")
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize(
    "value",
    [
        (1, (2, "a")),
        {1: "int key", "s": [(), {}]},
        {"__tuple__": [1]},  # a tag as a plain key survives
        [{(1, 2): {None: 3.5}}],
    ],
)
def test_tagged_json_round_trips(value: object) -> None:
    text = json.dumps(tagged(value))
    assert untag(json.loads(text)) == value
    assert type(untag(json.loads(text))) is type(value)


def test_tagging_refuses_other_types_and_untagging_malformed_tags() -> None:
    with pytest.raises(TypeError, match="set"):
        tagged([{1}])
    with pytest.raises(ValueError, match="malformed __dict__ pairs"):
        untag({"__dict__": [[1, 2, 3]]})
    with pytest.raises(ValueError, match="a dict key cannot be a list"):
        untag({"__dict__": [[[1], 2]]})


# -- strict decoding: every object holding a tag is exactly one well-formed tag -----------------

_BIG = 2**70
_DIMS65 = ",".join(["1"] * 65)

# (text, encodings that refuse it, what the message says). The tags of pyjson2 alone are plain
# keys in pyjson, so those texts are refused only as pyjson2.
MALFORMED = [
    # The examples: a wrong payload, two tags, a tag beside other keys, a huge size.
    ('{"__tuple__": 5}', "both", r"__tuple__ value: the payload must be a list, got an integer"),
    ('{"__dict__": "x"}', "both", r"__dict__ value: .*pairs, got a string"),
    ('{"__tuple__": [], "__dict__": []}', "both", r"only key .* also has \['__dict__'\]"),
    ('{"__tuple__": [1], "a": 2}', "both", r"__tuple__ value: a tag is the only key"),
    ('{"__dict__": [[1, 2]], "__tuple__": []}', "both", r"__tuple__ value: a tag is the only"),
    (
        f'{{"__size__": [{_BIG}]}}',
        "pyjson2",
        r"__size__ value: .*integers in \[-2\*\*63, 2\*\*63\)",
    ),
    ('{"__numpy__": ["int8", 1], "__size__": []}', "pyjson2", r"__numpy__ value: a tag is the"),
    ('{"a": [{"__size__": [1], "b": 1}]}', "pyjson2", r"malformed __size__"),  # nested
    # __tuple__
    ('{"__tuple__": {"a": 1}}', "both", r"must be a list, got an object"),
    ('{"__tuple__": null}', "both", r"must be a list, got null"),
    ('{"__tuple__": [{"__tuple__": "x"}]}', "both", r"__tuple__ value"),
    # __dict__: pairs, keys, and only what the writer writes as pairs
    ('{"__dict__": []}', "both", r"got \[\] \(an empty dict is written \{\}\)"),
    ('{"__dict__": [1]}', "both", r"malformed __dict__ pairs: each is a \[key, value\] list"),
    ('{"__dict__": [[1]]}', "both", r"malformed __dict__ pairs"),
    ('{"__dict__": [[1, 2, 3]]}', "both", r"malformed __dict__ pairs"),
    ('{"__dict__": {"1": 2}}', "both", r"got an object"),
    ('{"__dict__": [[[1], 2]]}', "both", r"a dict key cannot be a list"),
    ('{"__dict__": [[{"a": 1}, 2]]}', "both", r"a dict key cannot be a dict"),
    ('{"__dict__": [[{"__tuple__": [[1]]}, 2]]}', "both", r"cannot be a tuple that holds"),
    ('{"__dict__": [[1, "a"], [1, "b"]]}', "both", r"the key 1 appears twice"),
    ('{"__dict__": [[1, "a"], [true, "b"]]}', "both", r"the key True appears twice"),
    ('{"__dict__": [[1, "a"], [1.0, "b"]]}', "both", r"appears twice"),
    ('{"__dict__": [[NaN, "a"], [NaN, "b"]]}', "both", r"the key nan appears twice"),
    ('{"__dict__": [["a", 1]]}', "both", r"its keys are strings, none a tag"),
    ('{"__dict__": [["__numpy__", 1]]}', "pyjson", r"its keys are strings, none a tag"),
    # An array is not hashable (and in pyjson, an object is a dict).
    ('{"__dict__": [[{"__ndarray__": ["int8", [1], "AA=="]}, 1]]}', "both", r"cannot be a"),
    # __numpy__
    ('{"__numpy__": 3}', "pyjson2", r"__numpy__ value: the payload must be \[dtype, value\]"),
    ('{"__numpy__": ["int8"]}', "pyjson2", r"must be \[dtype, value\]"),
    ('{"__numpy__": [["int8"], 1]}', "pyjson2", r"must be \[dtype, value\]"),  # unhashable
    ('{"__numpy__": ["float128", 1.0]}', "pyjson2", r"must be \[dtype, value\]"),
    ('{"__numpy__": ["bool", 0]}', "pyjson2", r"a bool is true or false, not 0"),
    ('{"__numpy__": ["int8", true]}', "pyjson2", r"int8 is an integer in \[-128, 127\]"),
    ('{"__numpy__": ["int8", -129]}', "pyjson2", r"not -129"),
    ('{"__numpy__": ["uint64", 18446744073709551616]}', "pyjson2", r"uint64 is an integer"),
    ('{"__numpy__": ["int64", 1.0]}', "pyjson2", r"int64 is an integer"),
    ('{"__numpy__": ["float64", 1]}', "pyjson2", r"float64 is written as a number with a"),
    ('{"__numpy__": ["float32", true]}', "pyjson2", r"float32 is written as"),
    ('{"__numpy__": ["float32", 1e39]}', "pyjson2", r"1e\+39 is not a float32 value"),
    ('{"__numpy__": ["float16", 0.1]}', "pyjson2", r"0.1 is not a float16 value"),
    ('{"__numpy__": ["complex64", [1, 2]]}', "pyjson2", r"complex64 is written as \[real, imag\]"),
    ('{"__numpy__": ["complex64", [1.0]]}', "pyjson2", r"complex64 is written as"),
    ('{"__numpy__": ["complex128", 1.0]}', "pyjson2", r"complex128 is written as"),
    ('{"__numpy__": ["complex64", [0.1, 0.0]]}', "pyjson2", r"is not a complex64 value"),
    # __ndarray__
    ('{"__ndarray__": ["int8", [1]]}', "pyjson2", r"\[dtype, shape, base64 data\]"),
    ('{"__ndarray__": ["int8", [1], "AQ==", "<"]}', "pyjson2", r"\[dtype, shape, base64"),
    ('{"__ndarray__": ["int8", [1], "AQ==", ">"]}', "pyjson2", r"int8 has no byte order"),
    ('{"__ndarray__": ["object", [1], "AQ=="]}', "pyjson2", r"\[dtype, shape, base64"),
    ('{"__ndarray__": [["int8"], [1], "AQ=="]}', "pyjson2", r"\[dtype, shape, base64"),
    ('{"__ndarray__": ["int8", 1, "AQ=="]}', "pyjson2", r"\[dtype, shape, base64"),
    ('{"__ndarray__": ["int8", [true], "AQ=="]}', "pyjson2", r"\[dtype, shape, base64"),
    ('{"__ndarray__": ["int8", [-1], ""]}', "pyjson2", r"\[dtype, shape, base64"),
    ('{"__ndarray__": ["int8", [1.0], "AQ=="]}', "pyjson2", r"\[dtype, shape, base64"),
    (f'{{"__ndarray__": ["int8", [{_DIMS65}], "AQ=="]}}', "pyjson2", r"at most 64 integers"),
    ('{"__ndarray__": ["int8", [1], 1]}', "pyjson2", r"\[dtype, shape, base64"),
    ('{"__ndarray__": ["int16", [0, 4611686018427387904, 2], ""]}', "pyjson2", r"too large"),
    (f'{{"__ndarray__": ["int8", [0, {_BIG}], ""]}}', "pyjson2", r"too large for an array"),
    ('{"__ndarray__": ["int8", [2], "AQ=="]}', "pyjson2", r"does not hold 2 values of int8"),
    ('{"__ndarray__": ["int8", [1], "AQ"]}', "pyjson2", r"does not hold 1 values"),  # no pad
    ('{"__ndarray__": ["int8", [1], "A==="]}', "pyjson2", r"the data is not base64"),
    ('{"__ndarray__": ["int8", [1], "A!=="]}', "pyjson2", r"the data is not base64"),
    ('{"__ndarray__": ["int8", [1], "\\u00c4\\u00c4=="]}', "pyjson2", r"not base64.*ASCII"),
    ('{"__ndarray__": ["int8", [1], "AR=="]}', "pyjson2", r"not the standard base64"),
    ('{"__ndarray__": ["int16", [1], "AAB="]}', "pyjson2", r"not the standard base64"),
    ('{"__ndarray__": ["bool", [2], "AQI="]}', "pyjson2", r"bytes other than 0 and 1"),
    # __size__
    ('{"__size__": 2}', "pyjson2", r"__size__ value: the payload must be a list of integers"),
    ('{"__size__": [true]}', "pyjson2", r"__size__ value"),
    ('{"__size__": [1.0]}', "pyjson2", r"__size__ value"),
    ('{"__size__": [9223372036854775808]}', "pyjson2", r"__size__ value"),
    ('{"__size__": [-9223372036854775809]}', "pyjson2", r"__size__ value"),
    # __namedtuple__
    ('{"__namedtuple__": ["N", ["a"]]}', "pyjson2", r"\[type name, \[field names\], \[values"),
    ('{"__namedtuple__": ["N", ["a"], [1, 2]]}', "pyjson2", r"one value per field"),
    ('{"__namedtuple__": ["N", ["a", "b"], [1]]}', "pyjson2", r"one value per field"),
    ('{"__namedtuple__": [1, ["a"], [1]]}', "pyjson2", r"\[type name, \[field names\]"),
    ('{"__namedtuple__": ["N", "a", [1]]}', "pyjson2", r"\[type name, \[field names\]"),
    ('{"__namedtuple__": ["N", [1], [1]]}', "pyjson2", r"\[type name, \[field names\]"),
    ('{"__namedtuple__": ["N", ["a"], {"a": 1}]}', "pyjson2", r"\[type name, \[field names\]"),
    ('{"__namedtuple__": ["import os", ["a"], [1]]}', "pyjson2", r"'import os' is not a valid"),
    ('{"__namedtuple__": ["class", ["a"], [1]]}', "pyjson2", r"'class' is not a valid"),
    ('{"__namedtuple__": ["N", ["_a"], [1]]}', "pyjson2", r"field '_a' starts with an under"),
    ('{"__namedtuple__": ["N", ["a", "a"], [1, 2]]}', "pyjson2", r"a field is named twice"),
    # The "fi" ligature is "fi" to Python: collections.namedtuple would raise SyntaxError.
    ('{"__namedtuple__": ["N", ["\\ufb01", "fi"], [1, 2]]}', "pyjson2", r"named twice"),
    ('{"__namedtuple__": ["N", ["a"], [{"__numpy__": ["int8", 999]}]]}', "pyjson2", r"int8"),
]


@pytest.mark.parametrize(("text", "refused_by", "message"), MALFORMED)
def test_an_object_with_a_tag_is_exactly_one_well_formed_tag_or_refused(
    text: str, refused_by: str, message: str
) -> None:
    for extended in (False, True):
        tree = json.loads(text)
        if refused_by == "both" or extended == (refused_by == "pyjson2"):
            with pytest.raises(ValueError, match=message):
                untag(tree, extended)
        else:
            # Tags of the other encoding are plain keys here: what the writer writes as is.
            assert tagged(untag(tree, extended), extended) == json.loads(text)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"__size__": [9223372036854775807, -9223372036854775808, -1]}', None),
        ('{"__numpy__": ["uint64", 18446744073709551615]}', np.uint64(2**64 - 1)),
        ('{"__numpy__": ["int64", -9223372036854775808]}', np.int64(-(2**63))),
        ('{"__numpy__": ["float32", 3.4028234663852886e+38]}', np.finfo(np.float32).max),
        ('{"__numpy__": ["float16", -Infinity]}', np.float16("-inf")),
        ('{"__numpy__": ["complex64", [NaN, -0.0]]}', None),
        ('{"__ndarray__": ["int8", [0, 9223372036854775807], ""]}', np.zeros((0, 2**63 - 1), "i1")),
        (f'{{"__ndarray__": ["bool", [{",".join(["1"] * 64)}], "AQ=="]}}', np.ones((1,) * 64, "?")),
        ('{"__ndarray__": ["int16", [2], "AAF//w==", ">"]}', np.array([256, -129], ">i2")),
        ('{"__namedtuple__": ["Empty", [], []]}', None),
        ('{"__dict__": [["__tuple__", [1]], ["a", 2]]}', {"__tuple__": [1], "a": 2}),
        ('{"__dict__": [[NaN, 1], [1, 2]]}', None),
    ],
)
def test_the_edges_of_what_a_writer_writes_are_accepted(text: str, value: object) -> None:
    decoded = untag(json.loads(text), extended=True)
    if value is not None:
        assert type(decoded) is type(value)
        if isinstance(value, np.ndarray):
            assert value.dtype == decoded.dtype and value.shape == decoded.shape
            assert value.tobytes() == decoded.tobytes()
        else:
            assert decoded == value
    # What decodes is what the writer writes that way.
    assert json.dumps(tagged(decoded, extended=True)) == json.dumps(json.loads(text))


def test_a_numpy_float_scalar_keeps_its_exact_value() -> None:
    back = untag({"__numpy__": ["complex64", [math.nan, -0.0]]}, extended=True)
    assert type(back) is np.complex64 and math.isnan(back.real)
    assert math.copysign(1.0, back.imag) == -1.0


def test_a_dict_whose_keys_a_reader_gets_back_as_one_is_not_stored_as_json() -> None:
    # JSON gives every NaN back as one object, which Python matches by identity first: two
    # NaN keys (or tuples of them) would come back as one, so a reader refuses such pairs and
    # the writer does not store them that way.
    for value in ({math.nan: 1, float("nan"): 2}, {(math.nan, 1): 1, (float("nan"), 1): 2}):
        assert len(value) == 2 and python_form(value) is None
    assert python_form({math.nan: 1, 2: 3}) == 1
    assert python_form({np.float64("nan"): 1, np.float64("nan"): 2}) == 2  # new objects on load


def test_scalars_only_lists_and_objects_are_kept_as_decoded() -> None:
    # The fast path: nothing to rebuild, nothing copied.
    floats, plain = [0.5] * 1000, {"a": 1.0, "b": None}
    assert untag(floats, extended=True) is floats
    assert untag(plain, extended=True) is plain
    assert untag({"__tuple__": floats}) == tuple(floats)
