"""``dcp.save``/``dcp.load`` with shardwise's storage plugins against DCP's own backend.

Run ``python bench/dcp_plugins.py`` (``--quick``: a smaller model, fewer repetitions). The state
is the training-state bench's (``bench/training_state.py``): a GPT-like decoder of about 106M
parameters under FSDP2 (each block its own unit) on 4 gloo ranks on CPU, AdamW after two real
steps, ``{"model": ..., "optim": ...}`` from ``get_state_dict``. Both tools run through DCP's
own ``dcp.save``/``dcp.load`` with its default planners; only the storage layer differs:

* DCP: ``FileSystemWriter`` / ``FileSystemReader`` with their defaults (both fsync);
* shardwise: ``StorageWriter`` / ``StorageReader`` (fsync; every block checksummed on write and
  verified on read).

Every method is interleaved in one run (the order rotates each repetition) on tmpfs
(``/dev/shm``) and on the disk of the working directory (``--dir``); times are collective
(barrier to barrier), the median of ``--reps`` repetitions after one warm-up. Before each load
every value is overwritten, and after the warm-up load every value is checked, so a fast wrong
load cannot pass. The ratio is DCP's time over shardwise's (above 1: shardwise is faster).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from _launch import freeze_gc, fresh_dir, rotate, run_rank, run_world
from _training import state as training
from _training.model import BIG, QUICK_BIG
from shardwise.checkpoint.dcp import StorageReader, StorageWriter

WORLD = 4
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Config:
    port: int
    results: str
    directories: tuple[str, ...]
    reps: int
    quick: bool


def _timed(operation: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    operation()
    dist.barrier()
    return time.perf_counter() - start


def _methods(
    state: training.TrainingState, root: str
) -> dict[str, tuple[Callable[[], object], bool]]:
    dcp_path, ours = os.path.join(root, "dcp"), os.path.join(root, "shardwise")
    return {
        "dcp save": (
            lambda: dcp.save(state.state, storage_writer=dcp.FileSystemWriter(dcp_path)),
            False,
        ),
        "shardwise save": (
            lambda: dcp.save(state.state, storage_writer=StorageWriter(ours)),
            False,
        ),
        "dcp load": (
            lambda: dcp.load(state.state, storage_reader=dcp.FileSystemReader(dcp_path)),
            True,
        ),
        "shardwise load": (lambda: dcp.load(state.state, storage_reader=StorageReader(ours)), True),
    }


def _body(rank: int, config: Config) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    state = training.build(QUICK_BIG if config.quick else BIG, mesh, per_layer=True, steps=2)
    state.fill()
    freeze_gc()
    results: dict[str, Any] = {"bytes": state.global_bytes}
    for directory in config.directories:
        root = fresh_dir(os.path.join(directory, "dcp-plugins-bench"), rank)
        methods = _methods(state, root)
        # Warm-up: every method once, each load checked (the saves come first).
        for name in ("dcp save", "shardwise save", "dcp load", "shardwise load"):
            operation, loads = methods[name]
            if loads:
                state.clear()
            _timed(operation)
            if loads:
                state.check(name)
        times: dict[str, list[float]] = {name: [] for name in methods}
        for repetition in range(config.reps):
            for name in rotate(list(methods), repetition):
                operation, loads = methods[name]
                if loads:
                    state.clear()
                times[name].append(_timed(operation))
        state.fill()
        results[directory] = {name: statistics.median(values) for name, values in times.items()}
        fresh_dir(root, rank)
    return results


def _rank(rank: int, config: Config) -> None:
    run_rank(rank, config, WORLD, 600, lambda: _body(rank, config))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, 2 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5)")
    parser.add_argument("--dir", default=os.getcwd(), help="the disk directory (default: cwd)")
    parser.add_argument("--no-disk", action="store_true", help="tmpfs only")
    args = parser.parse_args()
    directories = ["/dev/shm"] + ([] if args.no_disk else [os.path.abspath(args.dir)])
    with tempfile.NamedTemporaryFile(suffix=".json") as results:
        config = Config(
            _free_port(),
            results.name,
            tuple(directories),
            args.reps or (2 if args.quick else 5),
            args.quick,
        )
        found = run_world(_rank, config, WORLD)
    print(f"dcp.save / dcp.load, {WORLD} gloo ranks, FSDP2 state of {found['bytes'] / MIB:.0f} MiB")
    print(f"{'where':<32}{'case':<8}{'DCP (s)':>10}{'shardwise (s)':>15}{'DCP / shardwise':>17}")
    for directory in directories:
        timing = found[directory]
        for case in ("save", "load"):
            theirs, ours = timing[f"dcp {case}"], timing[f"shardwise {case}"]
            print(f"{directory:<32}{case:<8}{theirs:>10.3f}{ours:>15.3f}{theirs / ours:>16.2f}x")


if __name__ == "__main__":
    main()
