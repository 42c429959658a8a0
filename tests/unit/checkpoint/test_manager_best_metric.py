"""``RetentionPolicy(keep_best=..., best_metric=NAME)`` whose NAME a save is not given: the
manager warns (a ``UserWarning`` at the caller of ``save``) once per manager, naming the metric
and the metrics it got; a save given the metric, or a policy without ``keep_best``, is quiet."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as ckpt

BEST = ckpt.RetentionPolicy(keep_last=1, keep_best=1, best_metric="eval_loss")


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((4,), float(step)), "step": step}


def _manager(root: Path, retention: ckpt.RetentionPolicy) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(root, retention=retention, async_save=False)


def test_a_metric_keep_best_never_gets_is_warned_of_once_naming_what_it_got(
    tmp_path: Path,
) -> None:
    with _manager(tmp_path, BEST) as manager:
        with pytest.warns(UserWarning, match="never ranked best") as caught:
            manager.save(1, _state(1), metrics={"loss": 0.5, "acc": 0.9})
        (warning,) = caught
        text = str(warning.message)
        assert "best_metric='eval_loss'" in text and "'acc', 'loss'" in text
        assert "save(step=1)" in text and str(tmp_path) in text
        assert warning.filename == __file__  # at the caller of save
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            manager.save(2, _state(2), metrics={"loss": 0.4})
            manager.save(3, _state(3))
    with (
        _manager(tmp_path, BEST) as manager,
        pytest.warns(UserWarning, match="got the metrics none"),
    ):
        manager.save(4, _state(4))  # once per manager: a new one warns again


def test_a_save_that_lacks_the_metric_after_ones_that_had_it_is_warned_of(tmp_path: Path) -> None:
    with _manager(tmp_path, BEST) as manager:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            manager.save(1, _state(1), metrics={"eval_loss": 0.5})
            manager.save(2, _state(2), metrics={"eval_loss": float("nan")})  # given: not ranked
        with pytest.warns(UserWarning, match=r"save\(step=3\) got the metrics 'eval_los'"):
            manager.save(3, _state(3), metrics={"eval_los": 0.3})


def test_no_warning_without_keep_best_or_when_the_save_is_not_due(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _manager(tmp_path / "a", ckpt.RetentionPolicy(keep_last=2)) as manager:
            manager.save(1, _state(1))
        policy = ckpt.SavePolicy(every_steps=10)
        with ckpt.CheckpointManager(
            tmp_path / "b", save_policy=policy, retention=BEST, async_save=False
        ) as manager:
            assert not manager.save(1, _state(1), metrics={"loss": 1.0})  # nothing recorded
    assert not (tmp_path / "b" / "step-00000001").exists()
