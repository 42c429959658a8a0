"""``checkpoint._json``: which values JSON gives back unchanged, and tagged JSON."""

from __future__ import annotations

import json
import math

import pytest

from shardwise.checkpoint._json import TAGS, json_problem, tagged, untag
from shardwise.checkpoint.metadata_json import check_json_value


@pytest.mark.parametrize(
    "value",
    [None, True, 3, 2.5, "s", [], {}, [1, [2, {"a": None}]], {"a": {"b": [1.0, "x"]}}],
)
def test_json_values_have_no_problem(value: object) -> None:
    assert json_problem(value, "v", finite=True) is None
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
    problem = json_problem(value, "v", finite=True)
    assert problem is not None and problem.startswith(message)


def test_non_finite_floats_and_reserved_keys_are_options() -> None:
    assert json_problem([math.nan, math.inf], "v", finite=False) is None
    assert json_problem({"__tuple__": [1]}, "v", finite=False) is None
    problem = json_problem({"a": {"__dict__": []}}, "v", finite=False, reserved=TAGS)
    assert problem == "v['a']: '__dict__' is a reserved key"


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


@pytest.mark.parametrize(
    "value",
    [
        {"a": [1, 2.5, None, "s", {"b": True}]},
        (1, 2),
        [1, {"a": [0, {2}]}],
        {"a": {3: 1}},
        [0, math.nan],
        {"x": -math.inf},
    ],
)
def test_the_metadata_check_gives_the_same_verdict_and_message(value: object) -> None:
    # The DCP metadata classes refuse what json_problem(finite=True) finds, in its words.
    problem = json_problem(value, "storage_data", finite=True)
    if problem is None:
        check_json_value(value, "storage_data")
    else:
        with pytest.raises(TypeError) as caught:
            check_json_value(value, "storage_data")
        assert str(caught.value) == problem
