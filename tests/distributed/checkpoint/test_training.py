"""State dicts as training loops write them: save mid-training, resume elsewhere, and the run
goes on as if it had never stopped.

* FSDP2 (``fully_shard``): 4 ranks train, save ``get_state_dict(model, optim)`` as it comes
  (optimizer state keyed by parameter name, ``param_groups`` a list of dicts with tuple
  ``betas``) with the LR scheduler as a Stateful object; 4 ranks, 2 ranks and one plain
  process resume and their losses, learning rates and final parameters match the
  uninterrupted run.
* Tensor parallel (``parallelize_module``, Colwise/Rowwise): 4 ranks save, 2 ranks and one
  plain process resume (the scheduler saved as its ``state_dict()``).
* One process, no process group: the classic ``model.state_dict()`` / ``optimizer.state_dict()``
  (integer keys), a Stateful scheduler, torch's and Python's RNG states; everything comes back
  equal and with its type, and training continues bit for bit.

Losses are compared with float32 tolerances where the reduction order changes with the world
size (gradient reduce-scatter, row-wise all-reduce), exactly where it does not.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import shardwise.checkpoint as ckpt
from tests.harness import run_on_ranks

WORLD = 4
#: Rows of the global batch: every resuming world size (4, 2, 1) divides it, so every world
#: computes the gradient of the same mean loss.
BATCH = 8
#: Steps before the save, then steps after it (the resumed run).
SAVED_STEPS = 4
RESUMED_STEPS = 3
#: Seeds of the saving model and of the fresh models that load the checkpoint: different, so
#: a resumed run that matches the reference proves the load.
SAVE_SEED = 0
FRESH_SEED = 1234
#: Reduction order changes with the world size: float32 noise, nothing more.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


# -- a tiny training setup shared by every test ------------------------------------------------


def _batches(dims: tuple[int, ...], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed synthetic data: one (input, target) global batch per step."""
    gen = torch.Generator().manual_seed(42)
    return [
        (torch.randn(BATCH, dims[0], generator=gen), torch.randn(BATCH, dims[-1], generator=gen))
        for _ in range(steps)
    ]


def _mlp(dims: tuple[int, ...], seed: int, dropout: float = 0.0) -> nn.Sequential:
    """Linear layers of ``dims`` with ReLU (and dropout) between them: children "0", "2", ...
    are the Linears when ``dropout`` is 0."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
        if i:
            layers.append(nn.ReLU())
            if dropout:
                layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(d_in, d_out))
    return nn.Sequential(*layers)


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=2e-2, betas=(0.8, 0.95), weight_decay=0.1)


def _world() -> tuple[int, int]:
    """(rank, world size); (0, 1) in a plain process."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)  # gloo has no AVG
        total /= dist.get_world_size()
    return total.item()


def _train(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    data_parallel: bool,
) -> dict[str, list[float]]:
    """Run one optimizer and scheduler step per batch; return the global losses and the
    learning rate each step used. With ``data_parallel`` each rank takes its rows of the
    global batch (equal slices, so the mean of the rank means is the global mean)."""
    rank, world = _world()
    rows = BATCH // world if data_parallel else BATCH
    first = rank * rows if data_parallel else 0
    losses, lrs = [], []
    for x, y in batches:
        lrs.append(optim.param_groups[0]["lr"])
        optim.zero_grad()
        loss = F.mse_loss(model(x[first : first + rows]), y[first : first + rows])
        loss.backward()
        optim.step()
        sched.step()
        # Tensor parallel: every rank computed the same loss.
        losses.append(_mean_over_ranks(loss) if data_parallel else loss.item())
    return {"losses": losses, "lrs": lrs}


def _full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as one full tensor (collective for DTensors)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _assert_same_run(resumed: dict[str, Any], reference: dict[str, Any], where: str) -> None:
    assert resumed["lrs"] == reference["lrs"], f"{where}: the LR schedule did not resume"
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]),
        torch.tensor(reference["losses"]),
        **TOLERANCE,
        msg=lambda m: f"{where}: the losses differ from the uninterrupted run\n{m}",
    )
    assert resumed["params"].keys() == reference["params"].keys()
    for name, tensor in reference["params"].items():
        torch.testing.assert_close(resumed["params"][name], tensor, **TOLERANCE)


def _check_load_target(target: dict[str, Any], num_params: int) -> None:
    """What ``get_state_dict`` gives a fresh optimizer: a state entry per parameter. A fresh
    optimizer has no state until its first step; DCP's ``get_state_dict`` takes a step with
    zero gradients and a zero learning rate to create it, so that ``load`` has tensors to fill
    (it fills the target's tensors in place and never invents entries)."""
    state = target["optim"]["state"]
    assert len(state) == num_params, sorted(state)
    assert all({"step", "exp_avg", "exp_avg_sq"} <= entry.keys() for entry in state.values())


def _check_loaded(result: Any, target: dict[str, Any], num_params: int) -> None:
    assert not result.missing_keys, result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    assert target["step"] == SAVED_STEPS
    (group,) = target["optim"]["param_groups"]
    assert group["betas"] == (0.8, 0.95) and isinstance(group["betas"], tuple)
    assert group["initial_lr"] == 2e-2
    assert len(group["params"]) == num_params
    for entry in target["optim"]["state"].values():
        assert entry["step"].item() == SAVED_STEPS


@contextmanager
def _in_this_process() -> Iterator[None]:
    """One thread, as in the harness's workers (so that this process computes like them),
    and the RNG states of this process restored afterwards (the bodies seed them)."""
    assert not dist.is_initialized()
    threads, torch_rng, py_rng = torch.get_num_threads(), torch.get_rng_state(), random.getstate()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)


def _run_plain(body: Callable[..., Any], *args: Any) -> Any:
    """Run a resume body in this process, without a process group."""
    with _in_this_process():
        return body(*args)


# -- FSDP2 -------------------------------------------------------------------------------------

#: Shards are uneven on 4 ranks (10 rows: 3, 3, 3, 1; 3 rows: 1, 1, 1, 0).
FSDP_DIMS = (12, 24, 10, 3)


def _fsdp_setup(
    seed: int,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    """The model (fully sharded over all ranks; plain without a process group), AdamW and a
    StepLR that halves the learning rate every 2 steps."""
    model = _mlp(FSDP_DIMS, seed)
    if dist.is_initialized():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = _adamw(model)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)


def _fsdp_save_and_continue(path: str) -> dict[str, Any]:
    batches = _batches(FSDP_DIMS, SAVED_STEPS + RESUMED_STEPS)
    model, optim, sched = _fsdp_setup(SAVE_SEED)
    _train(model, optim, sched, batches[:SAVED_STEPS], data_parallel=True)
    model_sd, optim_sd = get_state_dict(model, optim)
    # Straight from the training loop: DCP's dicts, the scheduler itself (Stateful), an int.
    ckpt.save({"model": model_sd, "optim": optim_sd, "sched": sched, "step": SAVED_STEPS}, path)
    # The uninterrupted run goes on.
    run = _train(model, optim, sched, batches[SAVED_STEPS:], data_parallel=True)
    return {**run, "params": _full_parameters(model)}


def _fsdp_resume(path: str) -> dict[str, Any]:
    batches = _batches(FSDP_DIMS, SAVED_STEPS + RESUMED_STEPS)
    model, optim, sched = _fsdp_setup(FRESH_SEED)
    num_params = len(list(model.parameters()))
    model_sd, optim_sd = get_state_dict(model, optim)
    target = {"model": model_sd, "optim": optim_sd, "sched": sched, "step": 0}
    _check_load_target(target, num_params)

    result = ckpt.load(target, path)

    _check_loaded(result, target, num_params)
    assert target["sched"] is sched, "a Stateful value is loaded into, not replaced"
    assert sched.last_epoch == SAVED_STEPS and sched.get_last_lr() == [5e-3]
    # get_state_dict hands out the live parameters and optimizer state (FSDP2's sharded
    # DTensors), so load has already filled them in place; set_state_dict is still what
    # applies the loaded param_groups (the learning rate the scheduler left).
    set_state_dict(model, optim, model_state_dict=target["model"], optim_state_dict=target["optim"])
    assert optim.param_groups[0]["lr"] == 5e-3
    run = _train(model, optim, sched, batches[SAVED_STEPS:], data_parallel=True)
    return {**run, "params": _full_parameters(model)}


@pytest.mark.distributed(world_size=WORLD, fresh=False, rpc=False)
def test_fsdp2_training_resumes_on_4_2_and_1_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "fsdp")
    reference = run_on_ranks(_fsdp_save_and_continue, WORLD, args=(path,))
    index = json.loads((tmp_path / "fsdp" / "shardwise.json").read_bytes())
    assert index["format_version"] == 4
    # FSDP2's parameters and their optimizer state are grids, one cell per rank.
    assert any(row[3][0] == "grid" for row in index["tensors"])
    assert all(r["losses"] == reference[0]["losses"] for r in reference), "ranks disagree"
    expected = reference[0]
    assert expected["lrs"] == [5e-3, 5e-3, 2.5e-3]

    for world in (WORLD, 2):
        for rank, resumed in enumerate(run_on_ranks(_fsdp_resume, world, args=(path,))):
            _assert_same_run(resumed, expected, f"FSDP2 on {world} ranks, rank {rank}")
    _assert_same_run(_run_plain(_fsdp_resume, path), expected, "one plain process")


# -- tensor parallel ---------------------------------------------------------------------------

TP_DIMS = (16, 32, 8)
#: Column-wise first layer (weight and bias sharded by rows), row-wise second layer (weight
#: sharded by columns, bias replicated): no communication between them.
TP_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _decay(step: int) -> float:
    return 1 / (1 + step)


def _tp_setup(
    seed: int,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The model (tensor parallel over all ranks; plain without a process group), AdamW and a
    learning rate that decays as 1 / (1 + step)."""
    model = _mlp(TP_DIMS, seed)
    if dist.is_initialized():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = parallelize_module(model, mesh, TP_PLAN)
    optim = _adamw(model)
    return model, optim, torch.optim.lr_scheduler.LambdaLR(optim, _decay)


def _tp_save_and_continue(path: str) -> dict[str, Any]:
    batches = _batches(TP_DIMS, SAVED_STEPS + RESUMED_STEPS)
    model, optim, sched = _tp_setup(SAVE_SEED)
    _train(model, optim, sched, batches[:SAVED_STEPS], data_parallel=False)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "sched": sched.state_dict(),
        "step": SAVED_STEPS,
    }
    ckpt.save(state, path)
    run = _train(model, optim, sched, batches[SAVED_STEPS:], data_parallel=False)
    return {**run, "params": _full_parameters(model)}


def _tp_resume(path: str) -> dict[str, Any]:
    batches = _batches(TP_DIMS, SAVED_STEPS + RESUMED_STEPS)
    model, optim, sched = _tp_setup(FRESH_SEED)
    num_params = len(list(model.parameters()))
    model_sd, optim_sd = get_state_dict(model, optim)
    target = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "step": 0}
    _check_load_target(target, num_params)

    result = ckpt.load(target, path)

    _check_loaded(result, target, num_params)
    assert target["sched"]["last_epoch"] == SAVED_STEPS
    set_state_dict(model, optim, model_state_dict=target["model"], optim_state_dict=target["optim"])
    sched.load_state_dict(target["sched"])
    assert sched.get_last_lr() == [2e-2 * _decay(SAVED_STEPS)]
    run = _train(model, optim, sched, batches[SAVED_STEPS:], data_parallel=False)
    return {**run, "params": _full_parameters(model)}


@pytest.mark.distributed(world_size=WORLD, fresh=False, rpc=False)
def test_tensor_parallel_training_resumes_on_2_and_1_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "tp")
    reference = run_on_ranks(_tp_save_and_continue, WORLD, args=(path,))
    assert all(r["losses"] == reference[0]["losses"] for r in reference), "ranks disagree"
    expected = reference[0]

    for rank, resumed in enumerate(run_on_ranks(_tp_resume, 2, args=(path,))):
        _assert_same_run(resumed, expected, f"tensor parallel on 2 ranks, rank {rank}")
    _assert_same_run(_run_plain(_tp_resume, path), expected, "one plain process")


# -- one process, no process group -------------------------------------------------------------

PLAIN_DIMS = (12, 24, 3)
PLAIN_STEP = 7
PLAIN_RESUMED_STEPS = 5


def _plain_setup(
    seed: int,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    model = _mlp(PLAIN_DIMS, seed, dropout=0.25)  # dropout: the torch RNG state matters
    optim = _adamw(model)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)


def _plain_train(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    steps: int,
) -> list[float]:
    """Each step draws its batch from a pool with Python's RNG and drops units with torch's,
    so that resuming identically needs both RNG states."""
    pool = _batches(PLAIN_DIMS, 6)
    losses = []
    for _ in range(steps):
        x, y = pool[random.randrange(len(pool))]
        optim.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Create the state of a fresh optimizer (it has none until its first step), as DCP's
    ``get_state_dict`` does: one step with zero gradients and a zero learning rate, which
    changes no parameter. ``load`` then has tensors of the right shapes to fill."""
    lrs = [group["lr"] for group in optim.param_groups]
    for group in optim.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    for group, lr in zip(optim.param_groups, lrs, strict=True):
        group["lr"] = lr


def _fresh_plain(
    init_optimizer: bool,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR, dict[str, Any]]:
    """Fresh objects and fresh RNG states (nothing of the saved run is left in memory), and
    the load target a training loop builds from them."""
    model, optim, sched = _plain_setup(FRESH_SEED)
    random.seed(FRESH_SEED)
    if init_optimizer:
        _init_optimizer_state(optim)
    target = {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "sched": sched,
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "step": 0,
    }
    return model, optim, sched, target


def test_single_process_training_state_round_trips(tmp_path: Path) -> None:
    with _in_this_process():
        _check_single_process_round_trip(tmp_path / "plain")


def _check_single_process_round_trip(path: Path) -> None:
    model, optim, sched = _plain_setup(SAVE_SEED)
    random.seed(SAVE_SEED)
    _plain_train(model, optim, sched, PLAIN_STEP)
    num_params = len(list(model.parameters()))

    state = {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "sched": sched,
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "step": PLAIN_STEP,
    }
    expected = copy.deepcopy({k: v for k, v in state.items() if k != "sched"})
    expected_sched = copy.deepcopy(sched.state_dict())
    ckpt.save(state, path)
    reference = _plain_train(model, optim, sched, PLAIN_RESUMED_STEPS)

    # An optimizer that never stepped has an empty state: load grows it from the checkpoint,
    # with int keys as saved, so Optimizer.load_state_dict matches it to the parameters.
    *_, probe = _fresh_plain(init_optimizer=False)
    assert probe["optim"]["state"] == {}
    result = ckpt.load(probe, path)
    assert not result.missing_keys and not result.unexpected_keys
    assert sorted(probe["optim"]["state"]) == list(range(num_params))
    for index, entry in expected["optim"]["state"].items():
        for name, tensor in entry.items():
            assert torch.equal(probe["optim"]["state"][index][name], tensor), (index, name)

    model, optim, sched, target = _fresh_plain(init_optimizer=True)
    assert sorted(target["optim"]["state"]) == list(range(num_params))
    result = ckpt.load(target, path)

    assert not result.missing_keys and not result.unexpected_keys
    assert target["step"] == PLAIN_STEP
    assert target["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(target["model"][name], tensor), name
    # Integer keys stay integers: Optimizer.load_state_dict matches state to parameters by
    # them and silently drops entries it cannot match.
    assert sorted(target["optim"]["state"]) == list(range(num_params))
    for index, entry in expected["optim"]["state"].items():
        loaded = target["optim"]["state"][index]
        assert loaded.keys() == entry.keys()
        for key, tensor in entry.items():
            assert torch.equal(loaded[key], tensor), (index, key)
    # lr, betas (a tuple), params (a list of ints) ...: equal, types included.
    assert target["optim"]["param_groups"] == expected["optim"]["param_groups"]
    assert isinstance(target["optim"]["param_groups"][0]["betas"], tuple)
    assert target["sched"] is sched and sched.state_dict() == expected_sched
    assert torch.equal(target["rng"], expected["rng"])
    assert target["py_rng"] == expected["py_rng"] and isinstance(target["py_rng"], tuple)

    model.load_state_dict(target["model"])
    optim.load_state_dict(target["optim"])
    torch.set_rng_state(target["rng"])
    random.setstate(target["py_rng"])
    resumed = _plain_train(model, optim, sched, PLAIN_RESUMED_STEPS)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(reference), rtol=0, atol=0)
