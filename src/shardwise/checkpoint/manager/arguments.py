"""The arguments of :class:`~shardwise.checkpoint.CheckpointManager` checked (a step, the
metrics of a save, whether they hold the one ``keep_best`` ranks by), and the failures of its
storage as the ``CheckpointError`` it raises."""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from shardwise._warnings import warn_at_caller
from shardwise.checkpoint.manager.policy import RetentionPolicy, SavePolicy
from shardwise.checkpoint.manager.series import MAX_STEP
from shardwise.errors import CheckpointError, CheckpointStorageError

__all__ = [
    "as_step",
    "check_policies",
    "plain_metrics",
    "save_failure",
    "storage_failure",
    "warn_if_unranked",
]


def as_step(step: object) -> int:
    """``step`` as an int: an int, a NumPy integer or an integer tensor of one element.

    Raises:
        ValueError: ``step`` is not such an integer from 0 to :data:`MAX_STEP` (a bool, a
            float: not a step; a larger one would be named so that no listing reads it).
    """
    if not isinstance(step, bool) and hasattr(type(step), "__index__"):
        dtype = getattr(step, "dtype", None)
        try:
            value = operator.index(step)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):
            value = -1  # not an integer after all: refused below
        if 0 <= value <= MAX_STEP and dtype is not torch.bool:
            return value
    raise ValueError(f"step must be an int >= 0 and <= {MAX_STEP}, not {step!r}")


def check_policies(save_policy: object, retention: object) -> None:
    """Raise ``TypeError`` unless the policies are a ``SavePolicy`` and a ``RetentionPolicy``
    (or None, the defaults)."""
    if save_policy is not None and not isinstance(save_policy, SavePolicy):
        raise TypeError(f"save_policy must be a SavePolicy, not {type(save_policy).__name__}")
    if retention is not None and not isinstance(retention, RetentionPolicy):
        raise TypeError(f"retention must be a RetentionPolicy, not {type(retention).__name__}")


def plain_metrics(metrics: Mapping[str, object] | None) -> dict[str, object]:
    """``metrics`` with one-number tensors and NumPy numbers as Python numbers
    (:func:`step_record` refuses what is not then an int or float).

    Raises:
        TypeError: ``metrics`` is not a mapping, or a value is a tensor or array of another
            size than one number.
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"metrics must be a mapping of names to numbers, not {type(metrics).__name__}"
        )
    plain: dict[str, object] = {}
    for name, value in metrics.items():
        item = getattr(value, "item", None)
        if callable(item) and not isinstance(value, (int, float)):
            try:
                value = item()
            except Exception as err:  # a tensor or array of several numbers, or none
                raise TypeError(
                    f"metric {name!r}: one number, not a {type(value).__name__} ({err})"
                ) from None
        plain[name] = value
    return plain


def warn_if_unranked(
    retention: RetentionPolicy, metrics: Mapping[str, object] | None, step: int, root: str
) -> bool:
    """Warn (a ``UserWarning``, at the caller of ``save``) when ``retention`` keeps the best
    by a metric that ``metrics``, recorded for ``step``, lack: a checkpoint without it is never
    ranked, so a misspelt or forgotten name makes ``keep_best`` keep nothing. Returns whether
    it warned (the manager warns once)."""
    name = retention.best_metric
    if retention.keep_best is None or name is None or (metrics is not None and name in metrics):
        return False
    given = ", ".join(repr(key) for key in sorted(map(str, metrics or {}))) or "none"
    warn_at_caller(
        f"RetentionPolicy(keep_best={retention.keep_best}, best_metric={name!r}) of the series "
        f"at {root} ranks checkpoints by {name!r}, but save(step={step}) got the metrics "
        f"{given}: a checkpoint saved without {name!r} is never ranked best (keep_last and "
        f"keep_every still keep it); pass metrics={{{name!r}: ...}} to save. Warned once "
        "per manager",
        UserWarning,
    )
    return True


def storage_failure(err: OSError, doing: str) -> CheckpointError:
    """``err`` of the storage as a ``CheckpointStorageError`` (unless it is a
    ``CheckpointError`` already, as the errors of an object store are)."""
    if isinstance(err, CheckpointError):
        return err
    filename = err.filename if isinstance(err.filename, str) else None
    return CheckpointStorageError(f"{doing}: {err}", file=filename)


def save_failure(err: BaseException, path: str) -> BaseException:
    """A save's failure as the manager raises it: a bare ``OSError`` that got through the save
    (a file of the save's own name that is a directory, ...) as a ``CheckpointStorageError``
    caused by it; anything else as it is."""
    if not isinstance(err, OSError) or isinstance(err, CheckpointError):
        return err
    filename = err.filename if isinstance(err.filename, str) else None
    wrapped = CheckpointStorageError(f"the save to {path} failed: {err}", file=filename)
    wrapped.__cause__ = err
    return wrapped
