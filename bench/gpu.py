"""Checkpoints of CUDA tensors on one GPU: shardwise against DCP, measured in the same run.

Run ``python bench/gpu.py`` on a machine with a GPU (``--quick``: 1 GiB, 2 repetitions;
``--device cpu`` runs the same on the CPU, to check the bench itself). One process, a group of
one over ``cpu:gloo,cuda:nccl`` (as torchtitan makes it; DCP's ``async_save`` needs the CPU
backend), a state of ``--gib`` GiB in 32 tensors (half bf16, half fp32) on the GPU, saved into
``--dir`` (default /dev/shm) and loaded back into GPU targets:

* save: ``shardwise.checkpoint.save`` against ``dcp.save`` (FileSystemWriter defaults);
* load: ``shardwise.checkpoint.load`` (every byte verified) against ``dcp.load``;
* async: ``async_save``, the time the caller is blocked and the time until the save is
  committed, shardwise's against DCP's;
* restore: ``CheckpointManager.restore`` onto the GPU from the local tier (its directory
  under ``--dir``) against the durable tier in ``--dir``.

Times are medians over ``--reps`` repetitions after a warm-up whose loaded values are checked
(``torch.cuda.synchronize`` before each clock reading); the methods alternate within each
repetition. ``bench/gpu_check.sh`` runs this and the ``cuda``-marked tests on a GPU machine.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardwise.checkpoint as ckpt

TENSORS = 32
GIB = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state(nbytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``TENSORS`` tensors of ``nbytes`` together, every other one bf16, values from a seed."""
    generator = torch.Generator(device=device).manual_seed(0)
    state = {}
    for number in range(TENSORS):
        dtype = torch.bfloat16 if number % 2 else torch.float32
        count = nbytes // TENSORS // dtype.itemsize
        state[f"layer{number}.weight"] = torch.randn(
            count, generator=generator, device=device, dtype=torch.float32
        ).to(dtype)
    return state


def _blank(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: torch.zeros_like(value) for key, value in state.items()}


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for key, value in want.items():
        if got[key].device != value.device or not torch.equal(got[key], value):
            raise AssertionError(f"{what}: {key} differs from what was saved")


def _timed(device: torch.device, operation: Callable[[], object]) -> float:
    _sync(device)
    started = time.perf_counter()
    operation()
    _sync(device)
    return time.perf_counter() - started


def _save(method: str, state: dict[str, torch.Tensor], path: str) -> None:
    if method == "shardwise":
        ckpt.save(state, path)
    else:
        dcp.save(state, checkpoint_id=path)


def _load(method: str, target: dict[str, torch.Tensor], path: str) -> None:
    if method == "shardwise":
        ckpt.load(target, path)
    else:
        dcp.load(target, checkpoint_id=path)


class _Run:
    def __init__(self, root: str, state: dict[str, torch.Tensor], device: torch.device) -> None:
        self.root, self.state, self.device = root, state, device
        self.target = _blank(state)
        self.times: dict[str, list[float]] = {}

    def path(self, name: str) -> str:
        path = os.path.join(self.root, name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def record(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def save_load(self, method: str, check: bool) -> None:
        path = self.path(method)
        self.record(f"save {method}", _timed(self.device, lambda: _save(method, self.state, path)))
        self.target = _blank(self.state)
        self.record(f"load {method}", _timed(self.device, lambda: _load(method, self.target, path)))
        if check:
            _check(self.target, self.state, f"{method} load")
        shutil.rmtree(path)

    def asynchronous(self, method: str, check: bool) -> None:
        path = self.path(f"async-{method}")
        _sync(self.device)
        started = time.perf_counter()
        if method == "shardwise":
            future: Any = ckpt.async_save(self.state, path)
        else:
            future = dcp.async_save(self.state, checkpoint_id=path)
        blocked = time.perf_counter() - started
        future.result()
        self.record(f"async blocked {method}", blocked)
        self.record(f"async committed {method}", time.perf_counter() - started)
        if check:
            target = _blank(self.state)
            _load(method, target, path)
            _check(target, self.state, f"{method} async_save")
        shutil.rmtree(path)

    def restores(self, check: bool) -> None:
        tier = ckpt.LocalTier(
            every_steps=1,
            replicas=0,
            job_id="gpu-bench",
            directory=self.path("tier"),
            min_free_bytes=0,
        )
        durable, tiered = self.path("durable"), self.path("tiered")
        with ckpt.CheckpointManager(durable, async_save=False) as manager:
            manager.save(1, self.state)
        never = ckpt.SavePolicy(every_steps=10**9)
        with ckpt.CheckpointManager(
            tiered, save_policy=never, async_save=False, local_tier=tier
        ) as manager:
            manager.save(1, self.state)
        for name, root, local, source in (
            ("restore durable", durable, None, "durable"),
            ("restore local", tiered, tier, "local"),
        ):
            manager = ckpt.CheckpointManager(root, async_save=False, local_tier=local)
            target = _blank(self.state)
            self.record(name, _timed(self.device, functools.partial(manager.restore, None, target)))
            if manager.restored_from != source:
                raise AssertionError(f"{name}: restored from {manager.restored_from}")
            manager.close()
            if check:
                _check(target, self.state, name)


def _init(device: torch.device, store: str) -> None:
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    options: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=600),
        **options,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 GiB, 2 repetitions")
    parser.add_argument("--gib", type=float, default=None, help="the state's size (default 4)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5)")
    parser.add_argument("--dir", default="/dev/shm", help="where checkpoints go")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (--device cpu checks the bench on the CPU)")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gib = args.gib if args.gib is not None else (1.0 if args.quick else 4.0)
    reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    root = tempfile.mkdtemp(prefix="shardwise-gpu-bench-", dir=args.dir)
    _init(device, os.path.join(root, "store"))
    try:
        run = _Run(root, _state(int(gib * GIB), device), device)
        methods = ["shardwise", "dcp"]
        for repetition in range(reps + 1):  # the first: a warm-up, every value checked
            check = repetition == 0
            order = methods if repetition % 2 == 0 else methods[::-1]
            for method in order:
                run.save_load(method, check)
            for method in order:
                run.asynchronous(method, check)
            run.restores(check)
            if check:
                run.times.clear()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    _print(run.times, gib, device, args.dir)


def _print(times: dict[str, list[float]], gib: float, device: torch.device, where: str) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    medians = {key: statistics.median(values) for key, values in times.items()}
    print(f"{gib:g} GiB in {TENSORS} tensors on {name}, checkpoints in {where}; medians:")
    for case in ("save", "load", "async blocked", "async committed"):
        ours, theirs = medians[f"{case} shardwise"], medians[f"{case} dcp"]
        print(
            f"  {case:<16} shardwise {ours:7.3f} s ({gib / ours:5.2f} GiB/s)  "
            f"dcp {theirs:7.3f} s  dcp/shardwise {theirs / ours:5.2f}x"
        )
    durable, local = medians["restore durable"], medians["restore local"]
    print(
        f"  restore          local tier {local:7.3f} s  durable tier {durable:7.3f} s  "
        f"durable/local {durable / local:5.2f}x"
    )


if __name__ == "__main__":
    main()
