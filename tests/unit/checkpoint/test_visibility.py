"""A save whose data files the coordinator cannot see (a path local to each node) fails on
every rank before the commit, instead of committing an index that names missing files."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import shardwise.checkpoint as ckpt

# The module that writes a rank's data file.
data_writer = importlib.import_module("shardwise.checkpoint.saving.writer")


def test_a_data_file_the_coordinator_cannot_see_is_not_committed(tmp_path, monkeypatch):
    path = tmp_path / "c"
    ckpt.save({"w": torch.ones(4)}, path)  # the previous checkpoint
    written = data_writer.write_data_file

    def on_another_node(storage, rank, *args, **kwargs):
        result = written(storage, rank, *args, **kwargs)
        # The file landed on "another node's" disk: this one does not see it.
        os.remove(os.path.join(path, *result["file"][0].split("/")))
        return result

    monkeypatch.setattr(data_writer, "write_data_file", on_another_node)
    with pytest.raises(ckpt.CheckpointDataError, match=r"ranks \[0\].*every node mounts"):
        ckpt.save({"w": torch.full((4,), 2.0)}, path)
    monkeypatch.undo()
    state = {"w": torch.zeros(4)}
    ckpt.load(state, path)
    assert torch.equal(state["w"], torch.ones(4))
