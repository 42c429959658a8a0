"""A reference to a sibling checkpoint whose name breaks the rule of ``docs/format.md``
(*Incremental checkpoints*, *Names*) is refused on every rank alike: rank 0 reads the index and
broadcasts it, every rank decodes it and reaches the same verdict before any data is read."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardwise.checkpoint as ckpt
from tests.harness import run_on_ranks
from tests.unit.checkpoint.test_names import _blank, renamed_series


def _load(path: str) -> str:
    try:
        ckpt.load(_blank(), path)
    except ckpt.CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    return "loaded"


@pytest.mark.parametrize("character", ["\x7f", "\x85"])
def test_every_rank_refuses_a_sibling_named_outside_the_rule(
    tmp_path: Path, character: str
) -> None:
    path = renamed_series(tmp_path, f"a{character}1")
    errors = run_on_ranks(_load, 2, args=(str(path),))
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("CheckpointFormatError: ")
    assert repr(f"../a{character}1/data/rank-")[:-1] in errors[0]  # named, escaped
    control = renamed_series(tmp_path / "control", "a-1")  # within the rule: it loads
    assert run_on_ranks(_load, 2, args=(str(control),)) == ["loaded", "loaded"]
