"""Incremental series on real ranks: 4 ranks save (through ``async_save``'s writer processes),
2 ranks continue the series, the 10th checkpoint loads on 3 ranks and in one process exactly
as a full checkpoint of the same state; hostile references are refused on every rank; and
``kill -9`` during a deletion and during a save of an incremental series
(``tests/_manager_worker.py --incremental``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise.checkpoint.index import decode_index, seal
from tests._manager_worker import full
from tests.distributed.checkpoint.test_manager_kill import _run, _tree
from tests.harness import run_on_ranks


def _frozen() -> torch.Tensor:
    return torch.arange(96 * 16, dtype=torch.float32).reshape(96, 16)


def _adapter(step: int) -> torch.Tensor:
    return torch.full((8, 16), float(step)) + torch.arange(16.0)


def _rows(world_size: int) -> sw.ChunkShardingSpec:
    return sw.ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(world_size)])


def _state(step: int) -> dict[str, Any]:
    spec = _rows(dist.get_world_size())
    return {
        "model": {
            "frozen": sw.shard_tensor(_frozen(), spec),
            "adapter": sw.shard_tensor(_adapter(step), spec),
            "norm": torch.ones(16),  # replicated, never changes
        },
        "optim": {"adapter_momentum": torch.full((8, 16), 0.5 * step)},
        "step": step,
    }


def _check(state: dict[str, Any], step: int) -> None:
    for key, whole in (("frozen", _frozen()), ("adapter", _adapter(step))):
        for shard in state["model"][key].local_shards():
            first, count = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
            assert torch.equal(shard.tensor, whole[first : first + count]), key
    assert torch.equal(state["model"]["norm"], torch.ones(16))
    assert torch.equal(state["optim"]["adapter_momentum"], torch.full((8, 16), 0.5 * step))
    assert state["step"] == step


def _blank() -> dict[str, Any]:
    state = _state(0)
    for key in ("frozen", "adapter"):
        for shard in state["model"][key].local_shards():
            shard.tensor.fill_(-1.0)
    state["model"]["norm"] = torch.zeros(16)
    state["optim"]["adapter_momentum"] = torch.zeros(8, 16)
    return state


def _save_steps(root: str, steps: list[int], async_save: bool) -> int | None:
    """Restore the series (checked), then save ``steps``; returns the step restored."""
    with ckpt.CheckpointManager(root, incremental=True, async_save=async_save) as manager:
        state = _blank()
        restored = manager.restore(state)
        if restored is not None:
            _check(state, restored)
        for step in steps:
            assert manager.save(step, _state(step))
    return restored


def _save_full(path: str, step: int) -> None:
    ckpt.save(_state(step), path)


def _load_resharded(path: str) -> None:
    state = _blank()
    ckpt.load(state, path)
    _check(state, 10)


def _refused_everywhere(path: str) -> str:
    try:
        ckpt.load(_blank(), path)
    except ckpt.CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    raise AssertionError("a hostile checkpoint loaded")


def _step(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _own_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in (path / "data").iterdir())


def test_a_series_resharded_from_4_to_2_ranks_loads_like_a_full_save(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert run_on_ranks(_save_steps, 4, args=(str(root), [1, 2, 3, 4, 5], True)) == [None] * 4
    index = decode_index((_step(root, 5) / "shardwise.json").read_bytes())
    assert {name.split("/")[1] for name in index.references} == {"step-00000001"}
    assert _own_bytes(_step(root, 5)) * 4 < _own_bytes(_step(root, 1))

    # 2 ranks continue: step 6's sharded boxes are new (written in full), 7 to 10 build on it;
    # the replicated norm keeps its box, and its bytes in step 1.
    assert run_on_ranks(_save_steps, 2, args=(str(root), [6, 7, 8, 9, 10], False)) == [5, 5]
    index = decode_index((_step(root, 10) / "shardwise.json").read_bytes())
    assert {name.split("/")[1] for name in index.references} == {"step-00000001", "step-00000006"}
    assert index.tensors["model.norm"].chunks[0].file.startswith("../step-00000001/")
    assert index.tensors["model.frozen"].chunks[0].file.startswith("../step-00000006/")
    assert _own_bytes(_step(root, 10)) * 4 < _own_bytes(_step(root, 6))

    # The 10th loads on 3 ranks exactly as its state, and in one process as a full save.
    run_on_ranks(_load_resharded, 3, args=(str(_step(root, 10)),))
    full_save = tmp_path / "full"
    run_on_ranks(_save_full, 2, args=(str(full_save), 10))
    keys = ["model.frozen", "model.adapter", "model.norm", "optim.adapter_momentum"]
    for key in keys:
        incremental = ckpt.load_tensor(_step(root, 10), key)
        assert torch.equal(incremental, ckpt.load_tensor(full_save, key)), key
    assert torch.equal(ckpt.load_tensor(_step(root, 10), "model.frozen"), _frozen())
    # Materialized (the incremental one, and the full one of grids), they load alike.
    for source in (_step(root, 10), full_save):
        copy = tmp_path / f"copy-of-{source.name}"
        assert ckpt.materialize(source, copy) == ckpt.read_metadata(copy)
        assert decode_index((copy / "shardwise.json").read_bytes()).format_version == 4
        for key in keys:
            assert torch.equal(ckpt.load_tensor(copy, key), ckpt.load_tensor(full_save, key))

    # Hostile references: a missing file, then a name outside the root, on every rank alike.
    document = json.loads((_step(root, 10) / "shardwise.json").read_bytes())
    referenced = document["files"][-1][0]
    moved = tmp_path / "moved"
    (root / referenced.removeprefix("../")).rename(moved)
    errors = run_on_ranks(_refused_everywhere, 2, args=(str(_step(root, 10)),))
    assert len(set(errors)) == 1 and errors[0].startswith("CheckpointDataError")
    assert "missing" in errors[0] and "materialize" in errors[0]
    moved.rename(root / referenced.removeprefix("../"))
    del document["index_checksum"]
    document["files"][-1][0] = "../" + referenced  # ../../step-00000006/data/...
    (_step(root, 10) / "shardwise.json").write_bytes(seal(document))
    errors = run_on_ranks(_refused_everywhere, 2, args=(str(_step(root, 10)),))
    assert len(set(errors)) == 1 and errors[0].startswith("CheckpointFormatError")


def test_killed_in_a_deletion_and_in_a_save_of_an_incremental_series(tmp_path: Path) -> None:
    root, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    # Killed while retention deletes step 1, whose file steps 2 and 3 read (index removed).
    lines = _run(root, 3, logs, "delete", "--incremental")
    assert lines == ["restored none", "saved 1", "saved 2"]
    assert "shardwise.json" not in _tree(root)["step-00000001"]
    assert ckpt.CheckpointManager(root).steps() == [2, 3]
    # Resumed from 3 (it reads step 1's frozen bytes); killed in the save of step 5.
    lines = _run(root, 6, logs, "save:5", "--incremental")
    assert lines == ["restored 3", "saved 4"]
    # Resumed from 4, to the end: step 1 stays retired, holding the frozen bytes only.
    lines = _run(root, 6, logs, None, "--incremental")
    assert lines == ["restored 4", "saved 5", "saved 6"]
    tree = _tree(root)
    assert sorted(tree) == ["step-00000001", "step-00000005", "step-00000006"]
    assert all(name.startswith("data/") for name in tree["step-00000001"])
    assert torch.equal(ckpt.load_tensor(root / "step-00000006", "weight"), full(6))
    assert torch.equal(ckpt.load_tensor(root / "step-00000006", "frozen"), -full(0))
