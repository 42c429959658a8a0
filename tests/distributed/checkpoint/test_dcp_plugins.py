"""The DCP storage plugins on real gloo groups: ``dcp.save``/``dcp.async_save`` with
``StorageWriter`` and ``dcp.load`` with ``StorageReader``, DCP's own default planners, FSDP2
and DTensor state on 1, 2 and 4 ranks, resharded both ways and read by ``shardwise`` itself.

* 4 ranks train an FSDP2 model a few steps and ``dcp.save`` ``get_state_dict(model, optim)``
  through ``StorageWriter``; the checkpoint is a shardwise one (``shardwise verify`` passes,
  ``load_tensor`` gives the full parameters), and 2 ranks with a fresh FSDP2 model (another
  seed) ``dcp.load`` it through ``StorageReader``: parameters and optimizer state equal the
  saving run's, and training goes on to the same losses.
* 2 ranks ``shardwise.checkpoint.save`` tensor-parallel DTensors; 4 ranks and one process
  ``dcp.load`` them through ``StorageReader`` (DCP's planner reshards).
* ``dcp.async_save`` through ``StorageWriter`` on 2 ranks.
* A data file corrupted after the save: ``dcp.load`` fails on every rank with DCP's
  ``CheckpointException`` holding the ``ChecksumError`` (DCP wraps each plugin error), and a
  hostile index is refused by ``StorageReader`` itself on every rank with ``load``'s error.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.dcp import StorageReader, StorageWriter
from shardwise.cli import main
from tests._hostile import read_document, write_resealed
from tests.distributed.checkpoint.test_training import (
    _adamw,
    _batches,
    _full_parameters,
    _mlp,
    _train,
)
from tests.harness import run_on_ranks

DIMS = (6, 10, 3)


def _fsdp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _mlp(DIMS, seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _adamw(model)


def _optimizer_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Every optimizer state tensor of ``optim``, keyed by parameter name, as full tensors."""
    _, state = get_state_dict(model, optim)
    return {
        f"{name}.{field}": (value.full_tensor() if isinstance(value, DTensor) else value).clone()
        for name, entry in state["state"].items()
        for field, value in entry.items()
    }


def _save_fsdp(path: str) -> dict[str, Any]:
    model, optim = _fsdp(seed=0)
    sched = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.9)
    _train(model, optim, sched, _batches(DIMS, 3), data_parallel=True)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": 3}, storage_writer=StorageWriter(path))
    then = _train(model, optim, sched, _batches(DIMS, 5)[3:], data_parallel=True)
    return {"params": _full_parameters(model), "optim": _optimizer_state(model, optim), **then}


def _load_fsdp(path: str) -> dict[str, Any]:
    model, optim = _fsdp(seed=1234)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "step": -1}
    dcp.load(state, storage_reader=StorageReader(path))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["step"] == 3
    loaded = _optimizer_state(model, optim)
    # The learning rate came back with the optimizer's param_groups: a new scheduler goes on
    # from it as the saving run's did.
    sched = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.9)
    then = _train(model, optim, sched, _batches(DIMS, 5)[3:], data_parallel=True)
    return {"params": _full_parameters(model), "loaded_optim": loaded, **then}


def test_fsdp2_saved_by_dcp_on_4_ranks_loads_through_dcp_on_2(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save_fsdp, 4, args=(path,))[0]
    assert main(["verify", path]) == 0  # a shardwise checkpoint, every block checked
    # shardwise reads it too: the optimizer's int-free keys, the parameters by name.
    metadata = ckpt.read_metadata(path)
    assert "model.0.weight" in metadata.state_dict_metadata
    assert ckpt.load_tensor(path, "model.0.weight").shape == (DIMS[1], DIMS[0])
    resumed = run_on_ranks(_load_fsdp, 2, args=(path,))[0]
    assert resumed["losses"] == pytest.approx(saved["losses"], rel=1e-5, abs=1e-6)
    for name, tensor in saved["params"].items():
        torch.testing.assert_close(resumed["params"][name], tensor, rtol=1e-5, atol=1e-6)


def _save_tensor_parallel(path: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(9 * 7, dtype=torch.float64).reshape(9, 7)
    state = {
        "rows": distribute_tensor(full, mesh, [Shard(0)]),
        "cols": distribute_tensor(full * 2, mesh, [Shard(1)]),
        "plain": torch.arange(5),
        "meta": {"epoch": 2, "name": "run"},
    }
    ckpt.save(state, path)


def _load_through_dcp(path: str) -> dict[str, Any]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    zeros = torch.zeros(9, 7, dtype=torch.float64)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        rows = distribute_tensor(zeros.clone(), mesh, [Shard(1)])  # another sharding
        cols = distribute_tensor(zeros.clone(), mesh, [Shard(0)])
    else:
        rows, cols = zeros.clone(), zeros.clone()
    state = {"rows": rows, "cols": cols, "plain": torch.zeros(5, dtype=torch.int64)}
    state["meta"] = {"epoch": 0, "name": ""}  # DCP loads the keys the state dict has
    with warnings.catch_warnings():  # DCP's note that one process loads alone
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=StorageReader(path), no_dist=world == 1)

    def full(value: torch.Tensor) -> torch.Tensor:
        return value.full_tensor() if isinstance(value, DTensor) else value

    return {
        "rows": full(state["rows"]),
        "cols": full(state["cols"]),
        "plain": state["plain"],
        "meta": state["meta"],
    }


def test_a_shardwise_checkpoint_loads_through_dcp_on_any_world_size(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save_tensor_parallel, 2, args=(path,))
    full = torch.arange(9 * 7, dtype=torch.float64).reshape(9, 7)
    for result in [*run_on_ranks(_load_through_dcp, 4, args=(path,)), _load_through_dcp(path)]:
        assert torch.equal(result["rows"], full) and torch.equal(result["cols"], full * 2)
        assert torch.equal(result["plain"], torch.arange(5))
        assert result["meta"] == {"epoch": 2, "name": "run"}


def _async_save(path: str) -> int:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)]), "n": 5}
    future = dcp.async_save(state, storage_writer=StorageWriter(path))
    future.result()
    return dist.get_rank()


def test_dcp_async_save_through_the_writer(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    assert run_on_ranks(_async_save, 2, args=(path,)) == [0, 1]
    state = {"w": torch.zeros(4, 3), "n": 0}
    ckpt.load(state, path)
    assert torch.equal(state["w"], torch.arange(12.0).reshape(4, 3)) and state["n"] == 5


def _load_failing(path: str) -> str:
    state = {"rows": torch.zeros(9, 7, dtype=torch.float64)}
    try:
        dcp.load(state, storage_reader=StorageReader(path), planner=None)
    except CheckpointException as err:
        causes = [cause for cause, _ in err.failures.values()]
        assert causes and all(isinstance(cause, ckpt.ChecksumError) for cause in causes), causes
        return type(causes[0]).__name__
    raise AssertionError("the corrupt checkpoint loaded")


def _open_hostile(path: str) -> str:
    try:
        StorageReader(path)
    except ckpt.CheckpointFormatError as err:
        return str(err)
    raise AssertionError("the hostile index was accepted")


def test_corruption_fails_every_rank_and_a_hostile_index_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt"
    ckpt.save({"rows": torch.arange(63, dtype=torch.float64).reshape(9, 7)}, path)
    (data,) = (path / "data").iterdir()
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert run_on_ranks(_load_failing, 2, args=(str(path),)) == ["ChecksumError"] * 2
    document = read_document(path)
    document["tensors"][0][2] = [9, 8]  # a size its chunks do not tile
    write_resealed(path, document)
    with pytest.raises(ckpt.CheckpointFormatError) as caught:
        ckpt.load({"rows": torch.zeros(9, 8, dtype=torch.float64)}, path)
    messages = run_on_ranks(_open_hostile, 2, args=(str(path),))
    assert messages == [messages[0]] * 2 and caught.value.bare_message in messages[0]
