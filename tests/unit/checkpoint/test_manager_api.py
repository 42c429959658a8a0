"""The manager package's call forms: ``restore(step, state_dict)`` (step first, as ``save``),
the form before 1.0 (``restore(state_dict, step)``) accepted unchanged, ``load``'s keywords
typed (a misspelt one is a ``TypeError``), the record the ranks agree on at ``save``, and
``materialize`` returning the copy's public ``Metadata``."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.loading.load import load
from shardwise.checkpoint.manager.manager import _Agreement


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((4,), float(value)), "step": int(value)}


@pytest.fixture
def manager(tmp_path: Path) -> Any:
    with ckpt.CheckpointManager(tmp_path, async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
        yield manager


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda m, s: m.restore(None, s), 3),
        (lambda m, s: m.restore(2, s), 2),
        (lambda m, s: m.restore(2, state_dict=s), 2),
        (lambda m, s: m.restore(step=1, state_dict=s), 1),
        (lambda m, s: m.restore(state_dict=s), 3),
        # The form before 1.0: a mapping first.
        (lambda m, s: m.restore(s), 3),
        (lambda m, s: m.restore(s, 2), 2),
        (lambda m, s: m.restore(s, step=1), 1),
        (lambda m, s: m.restore(s, None), 3),
    ],
    ids=[
        "(None, s)",
        "(2, s)",
        "(2, state_dict=s)",
        "(step=1, state_dict=s)",
        "(state_dict=s)",
        "(s)",
        "(s, 2)",
        "(s, step=1)",
        "(s, None)",
    ],
)
def test_restore_takes_the_step_first_and_the_old_form_too(
    manager: ckpt.CheckpointManager, call: Any, expected: int
) -> None:
    state = _state(0)
    assert call(manager, state) == expected
    assert state["step"] == expected and torch.equal(state["w"], torch.full((4,), float(expected)))


def test_restore_passes_loads_keywords_and_refuses_others(manager: ckpt.CheckpointManager) -> None:
    state = {"w": torch.zeros(4, dtype=torch.float64), "step": 0}
    with pytest.raises(ckpt.CheckpointMismatchError):
        manager.restore(3, state)
    assert manager.restore(3, state, allow_dtype_cast=True, verify=False, progress=False) == 3
    assert state["w"].dtype == torch.float64 and state["w"][0] == 3.0
    partial = {"w": torch.zeros(4), "extra": torch.zeros(1)}
    with pytest.raises(ckpt.CheckpointKeyError):
        manager.restore(None, partial)
    with pytest.warns(UserWarning):
        assert manager.restore(None, partial, strict=False) == 3
    with pytest.raises(TypeError, match="allow_dtype_casts"):
        manager.restore(3, _state(0), allow_dtype_casts=True)  # type: ignore[call-overload]


def test_restore_keywords_are_loads_own(manager: ckpt.CheckpointManager) -> None:
    # The manager brings its process group and storage options; every other keyword of load
    # is one of restore, with load's default.
    mine = inspect.signature(manager.restore).parameters
    theirs = inspect.signature(load).parameters
    shared = {name for name, p in theirs.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    shared -= {"process_group", "storage_options"}
    assert shared <= set(mine)
    for name in shared:
        assert mine[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert mine[name].default == theirs[name].default


def test_restore_refuses_a_missing_or_doubled_argument(manager: ckpt.CheckpointManager) -> None:
    with pytest.raises(TypeError, match="missing the state dict"):
        manager.restore(3)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="missing the state dict"):
        manager.restore()
    with pytest.raises(TypeError, match="multiple values for argument 'step'"):
        manager.restore(3, _state(0), step=2)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="multiple values for argument 'step'"):
        manager.restore(_state(0), 3, step=2)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="multiple values for argument 'state_dict'"):
        manager.restore(3, _state(0), state_dict=_state(0))  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="at most 2 positional"):
        manager.restore(3, _state(0), True)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        manager.restore("3", _state(0))  # type: ignore[call-overload]


def test_the_agreement_crosses_as_eight_integers_by_name() -> None:
    record = _Agreement(notice=True, policy_failed=True, step=7, negated_step=-7)
    ints = record.to_ints()
    assert ints == [1, 0, 0, 0, 1, 0, 7, -7]
    assert _Agreement.from_ints(ints) == record
    assert record.one_step and record.saves
    assert not _Agreement(step=9, negated_step=-7).one_step  # ranks called with 7 and 9
    assert not _Agreement().saves
    assert _Agreement(force=True).saves and _Agreement(due=True).saves


def test_materialize_returns_the_public_metadata_of_the_copy(tmp_path: Path) -> None:
    source, out = tmp_path / "source", tmp_path / "copy"
    ckpt.save({"w": torch.arange(6.0), "step": 3, "blob": b"abc"}, source)
    metadata = ckpt.materialize(source, out)
    assert isinstance(metadata, ckpt.Metadata)
    assert metadata == ckpt.read_metadata(out)
    # The same entries as the source; their bytes in the copy's own files.
    source_metadata = ckpt.read_metadata(source)
    assert metadata.state_dict_metadata == source_metadata.state_dict_metadata
    assert metadata.storage_data != source_metadata.storage_data
    assert set(metadata.state_dict_metadata) == {"w", "step", "blob"}
