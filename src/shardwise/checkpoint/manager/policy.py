"""When a series saves and which checkpoints it keeps: pure rules, no I/O, no collectives.

The manager asks :meth:`SavePolicy.wants` on the coordinating rank and :func:`retained` over a
listing of the series; both are plain functions of their arguments, so they are tested against
a model of the rules without processes (``tests/unit/checkpoint/test_manager_policy.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["RetentionPolicy", "SavePolicy", "retained"]


def _check_positive(name: str, value: float | None, kind: type = int) -> None:
    if value is None:
        return
    if kind is int and (type(value) is not int or value <= 0):
        raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    if kind is float and (
        type(value) not in (int, float) or not math.isfinite(value) or value <= 0
    ):
        raise ValueError(f"{name} must be a positive number of seconds or None, not {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SavePolicy:
    """When :meth:`CheckpointManager.save` saves; any rule that fires saves.

    With no rule at all, every call saves. ``save(..., force=True)`` and a preemption signal
    save regardless. Example: ``SavePolicy(every_steps=1000, every_seconds=1800)``.
    """

    every_steps: int | None = None
    """Save the steps that are multiples of this."""

    every_seconds: float | None = None
    """Save when this many seconds have passed since the last save (or since the manager was
    made); measured on the coordinating rank, whose verdict every rank follows."""

    last_step: int | None = None
    """Save this step (the end of training) whatever the other rules say."""

    should_save: Callable[[int], bool] | None = None
    """Called with the step on the coordinating rank: True saves."""

    def __post_init__(self) -> None:
        _check_positive("every_steps", self.every_steps)
        _check_positive("every_seconds", self.every_seconds, float)
        if self.last_step is not None and (type(self.last_step) is not int or self.last_step < 0):
            raise ValueError(f"last_step must be an int >= 0 or None, not {self.last_step!r}")
        if self.should_save is not None and not callable(self.should_save):
            raise TypeError(f"should_save must be callable, not {type(self.should_save).__name__}")

    def wants(self, step: int, *, seconds_since_save: float) -> bool:
        """Whether ``step`` is due, ``seconds_since_save`` after the last save."""
        rules = (self.every_steps, self.every_seconds, self.last_step, self.should_save)
        if all(rule is None for rule in rules):
            return True
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        if self.every_seconds is not None and seconds_since_save >= self.every_seconds:
            return True
        if self.last_step is not None and step == self.last_step:
            return True
        return self.should_save is not None and bool(self.should_save(step))


@dataclass(frozen=True, kw_only=True, slots=True)
class RetentionPolicy:
    """Which committed checkpoints of a series are kept; a checkpoint any rule keeps is kept.

    With no rule at all, every checkpoint is kept. Whatever the rules, the newest committed
    checkpoint is always kept, so a checkpoint is only ever deleted once a newer one has
    committed. Example: ``RetentionPolicy(keep_last=3, keep_every=10_000)``.
    """

    keep_last: int | None = None
    """Keep the newest this many."""

    keep_every: int | None = None
    """Keep for ever the steps that are multiples of this."""

    keep_best: int | None = None
    """Keep the best this many by ``best_metric`` (checkpoints without it are not ranked)."""

    best_metric: str | None = None
    """The metric (a key of ``save(..., metrics=...)``) that ``keep_best`` ranks by."""

    best_mode: Literal["min", "max"] = "min"
    """Whether lower (``"min"``, a loss) or higher (``"max"``, an accuracy) is better."""

    def __post_init__(self) -> None:
        _check_positive("keep_last", self.keep_last)
        _check_positive("keep_every", self.keep_every)
        _check_positive("keep_best", self.keep_best)
        if (self.keep_best is None) != (self.best_metric is None):
            raise ValueError("keep_best and best_metric go together: give both or neither")
        if self.best_metric is not None and not isinstance(self.best_metric, str):
            raise TypeError(f"best_metric must be a str, not {type(self.best_metric).__name__}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {self.best_mode!r}")

    @property
    def keeps_all(self) -> bool:
        """Whether no rule is set (nothing is ever deleted)."""
        return self.keep_last is None and self.keep_every is None and self.keep_best is None

    def to_json(self) -> dict[str, Any]:
        """The policy as JSON (recorded with each checkpoint for ``shardwise ls``)."""
        return {
            "keep_last": self.keep_last,
            "keep_every": self.keep_every,
            "keep_best": self.keep_best,
            "best_metric": self.best_metric,
            "best_mode": self.best_mode,
        }

    @classmethod
    def from_json(cls, value: object) -> RetentionPolicy:
        """The policy :meth:`to_json` wrote.

        Raises:
            ValueError: ``value`` is not such a policy (TypeError for a wrong value type).
        """
        if not isinstance(value, dict) or set(value) != set(cls().to_json()):
            raise ValueError(f"not a retention policy: {value!r}")
        return cls(**value)


def _rank_value(metric: object) -> float | None:
    """A metric as a number to rank by; None for a missing, non-numeric or non-finite one (an
    int beyond a float's range included: a step record read from disk may hold anything)."""
    if type(metric) not in (int, float):
        return None
    try:
        value = float(metric)  # type: ignore[arg-type]
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def retained(
    policy: RetentionPolicy,
    checkpoints: Mapping[int, Mapping[str, object]],
    protected: Iterable[int] = (),
) -> set[int]:
    """The steps of ``checkpoints`` (committed ones: step -> metrics) that ``policy`` keeps.

    The newest step and the ``protected`` ones (being written, being restored) are always
    kept. Among equal metrics the newer checkpoint ranks better.
    """
    steps = sorted(checkpoints)
    if policy.keeps_all:
        return set(steps)
    kept = set(protected).intersection(steps)
    if steps:
        kept.add(steps[-1])
    if policy.keep_last is not None:
        kept.update(steps[-policy.keep_last :])
    if policy.keep_every is not None:
        kept.update(step for step in steps if step % policy.keep_every == 0)
    if policy.keep_best is not None:
        ranked = []
        for step in steps:
            value = _rank_value(checkpoints[step].get(policy.best_metric or ""))
            if value is not None:
                ranked.append((value if policy.best_mode == "min" else -value, -step))
        kept.update(-negated for _, negated in sorted(ranked)[: policy.keep_best])
    return kept
