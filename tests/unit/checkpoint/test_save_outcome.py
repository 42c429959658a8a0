"""What the ranks of a save return (``_save_outcome``): the coordinator's outcome read on the
other ranks (the 4-rank protocol is in ``tests/distributed/checkpoint/test_scale_protocol.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint import _save_outcome
from shardwise.errors import CheckpointError


def test_an_outcome_without_the_metadata_facts_is_read_from_its_index(tmp_path: Path) -> None:
    # A coordinator of an earlier shardwise sent the index alone: the other ranks' return
    # value is decoded from it; an outcome with neither is a CheckpointError that says the
    # checkpoint was committed.
    metadata = ckpt.save({"w": torch.arange(6.0), "step": 3}, tmp_path / "c")
    text = (tmp_path / "c" / "shardwise.json").read_text()
    returned = _save_outcome.returned_metadata({"index": text}, str(tmp_path / "c"), None, "x")
    assert dict(returned.state_dict_metadata) == dict(metadata.state_dict_metadata)
    assert returned.planner_data == metadata.planner_data
    with pytest.raises(CheckpointError, match="was committed, but its coordinator sent"):
        _save_outcome.returned_metadata({"version": "4"}, str(tmp_path / "c"), None, "x")
