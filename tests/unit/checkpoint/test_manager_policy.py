"""The pure rules of ``CheckpointManager``: retention against a plain model of its rules
(hypothesis), the save policy, step directory names, and step records."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint.manager.policy import RetentionPolicy, SavePolicy, retained
from shardwise.checkpoint.manager.series import parse_step_name, step_name, step_record

# -- retention: a plain model ------------------------------------------------------------------


def _model_keeps(
    policy: RetentionPolicy, checkpoints: dict[int, dict[str, object]], protected: set[int]
) -> set[int]:
    """Each rule of the policy's docstring, checked for one checkpoint at a time."""
    steps = sorted(checkpoints)
    any_rule = (policy.keep_last, policy.keep_every, policy.keep_best) != (None, None, None)
    kept = set()
    for step in steps:
        if not any_rule or step == max(steps) or step in protected:
            kept.add(step)
            continue
        newer = sum(1 for other in steps if other > step)
        if policy.keep_last is not None and newer < policy.keep_last:
            kept.add(step)
        if policy.keep_every is not None and step % policy.keep_every == 0:
            kept.add(step)
        if policy.keep_best is not None:
            mine = checkpoints[step].get(policy.best_metric or "")
            if isinstance(mine, (int, float)) and math.isfinite(mine):
                sign = 1 if policy.best_mode == "min" else -1
                better = 0
                for other in steps:
                    theirs = checkpoints[other].get(policy.best_metric or "")
                    if other == step or not isinstance(theirs, (int, float)):
                        continue
                    if not math.isfinite(theirs):
                        continue
                    # Better, or as good and newer.
                    if sign * theirs < sign * mine or (theirs == mine and other > step):
                        better += 1
                if better < policy.keep_best:
                    kept.add(step)
    return kept


_counts = st.none() | st.integers(1, 5)
_metric = st.none() | st.integers(-3, 3) | st.sampled_from([0.5, math.nan, math.inf])


@st.composite
def _cases(draw: st.DrawFn) -> tuple[RetentionPolicy, dict[int, dict[str, object]], set[int]]:
    keep_best = draw(_counts)
    policy = RetentionPolicy(
        keep_last=draw(_counts),
        keep_every=draw(_counts),
        keep_best=keep_best,
        best_metric=None if keep_best is None else "loss",
        best_mode=draw(st.sampled_from(["min", "max"])),
    )
    steps = draw(st.sets(st.integers(0, 40), max_size=12))
    checkpoints: dict[int, dict[str, object]] = {}
    for step in steps:
        value = draw(_metric)
        checkpoints[step] = {} if value is None else {"loss": value}
    protected = draw(st.sets(st.integers(0, 40), max_size=2))
    return policy, checkpoints, protected


@settings(max_examples=400, deadline=None)
@given(_cases())
def test_retention_matches_the_model(
    case: tuple[RetentionPolicy, dict[int, dict[str, object]], set[int]],
) -> None:
    policy, checkpoints, protected = case
    kept = retained(policy, checkpoints, protected)
    assert kept == _model_keeps(policy, checkpoints, protected)
    # What no rule can break: nothing outside the series, the newest is never deleted.
    assert kept <= set(checkpoints)
    if checkpoints:
        assert max(checkpoints) in kept


def test_retention_examples() -> None:
    metrics: dict[int, dict[str, object]] = {
        s: {"loss": float(abs(s - 40))} for s in range(10, 101, 10)
    }
    assert retained(RetentionPolicy(keep_last=2), metrics) == {90, 100}
    assert retained(RetentionPolicy(keep_last=1, keep_every=50), metrics) == {50, 100}
    best = RetentionPolicy(keep_best=2, best_metric="loss")
    assert retained(best, metrics) == {40, 50, 100}  # 30 and 50 tie at 10: the newer wins
    most = RetentionPolicy(keep_best=1, best_metric="loss", best_mode="max")
    assert retained(most, metrics) == {100}
    assert retained(RetentionPolicy(keep_last=1), metrics, protected=[20]) == {20, 100}
    assert retained(RetentionPolicy(), metrics) == set(metrics)
    assert retained(RetentionPolicy(keep_last=3), {}) == set()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_last": 0}, "keep_last must be a positive int"),
        ({"keep_every": True}, "keep_every must be a positive int"),
        ({"keep_best": 2}, "keep_best and best_metric go together"),
        ({"best_metric": "loss"}, "keep_best and best_metric go together"),
        ({"keep_best": 1, "best_metric": "loss", "best_mode": "lowest"}, "'min' or 'max'"),
    ],
)
def test_retention_policy_refuses_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]


def test_retention_policy_json_round_trip() -> None:
    policy = RetentionPolicy(keep_last=3, keep_best=2, best_metric="acc", best_mode="max")
    assert RetentionPolicy.from_json(json.loads(json.dumps(policy.to_json()))) == policy
    with pytest.raises(ValueError, match="not a retention policy"):
        RetentionPolicy.from_json({"keep_last": 3})


# -- save policy -------------------------------------------------------------------------------


def test_save_policy_rules() -> None:
    assert SavePolicy().wants(7, seconds_since_save=0.0)  # no rule: every call
    every = SavePolicy(every_steps=100)
    assert [s for s in range(0, 301) if every.wants(s, seconds_since_save=0.0)] == [
        0,
        100,
        200,
        300,
    ]
    timed = SavePolicy(every_seconds=60)
    assert not timed.wants(1, seconds_since_save=59.9)
    assert timed.wants(1, seconds_since_save=60.0)
    last = SavePolicy(every_steps=100, last_step=250)
    assert last.wants(250, seconds_since_save=0.0)
    assert not last.wants(249, seconds_since_save=0.0)
    called = SavePolicy(every_steps=1000, should_save=lambda step: step == 7)
    assert called.wants(7, seconds_since_save=0.0)
    assert not called.wants(8, seconds_since_save=0.0)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"every_steps": 0}, ValueError),
        ({"every_steps": 1.5}, ValueError),
        ({"every_seconds": -1}, ValueError),
        ({"every_seconds": math.inf}, ValueError),
        ({"last_step": -1}, ValueError),
        ({"should_save": 3}, TypeError),
    ],
)
def test_save_policy_refuses_bad_values(kwargs: dict[str, object], error: type) -> None:
    with pytest.raises(error):
        SavePolicy(**kwargs)  # type: ignore[arg-type]


# -- names and records -------------------------------------------------------------------------


def test_step_names_round_trip_and_only_exact_names_parse() -> None:
    assert step_name(100) == "step-00000100"
    assert step_name(123_456_789_012) == "step-123456789012"
    for step in (0, 1, 100, 99_999_999, 100_000_000, 123_456_789_012):
        assert parse_step_name(step_name(step)) == step
    for name in (
        "step-100",
        "step-0000100",
        "step-000000100",  # 9 digits with a leading zero: not the name of 100
        "step-00000100.old",
        "step-00000100/",
        "Step-00000100",
        "step--0000100",
        "step-0000010a",
        "step-" + "\u0660" * 5 + "\u0661\u0660\u0660",  # Arabic-Indic digits: 100
        "checkpoint-00000100",
        "step-",
    ):
        assert parse_step_name(name) is None, name
    with pytest.raises(ValueError):
        step_name(-1)


def test_step_record_is_json_with_non_finite_metrics_as_null() -> None:
    policy = RetentionPolicy(keep_last=2)
    record = json.loads(step_record(5, {"loss": math.nan, "acc": 0.5, "n": 3}, policy))
    assert record["step"] == 5
    assert record["metrics"] == {"loss": None, "acc": 0.5, "n": 3}
    assert record["retention"]["keep_last"] == 2
    with pytest.raises(TypeError, match="metric 'loss'"):
        step_record(5, {"loss": "low"}, policy)
    with pytest.raises(TypeError, match="metric 'ok'"):
        step_record(5, {"ok": True}, policy)
    with pytest.raises(TypeError, match="metric names are str"):
        step_record(5, {1: 0.5}, policy)  # type: ignore[dict-item]
