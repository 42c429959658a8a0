"""``dcp.save``/``dcp.load`` with shardwise's storage plugins against DCP's own backend.

Run ``python bench/dcp_plugins.py`` (``--quick``: a smaller model, fewer repetitions). The state
is the training-state bench's (``bench/training_state.py``): a GPT-like decoder of about 106M
parameters under FSDP2 (each block its own unit) on 4 gloo ranks on CPU, AdamW after two real
steps, ``{"model": ..., "optim": ...}`` from ``get_state_dict``. Both tools run through DCP's
own ``dcp.save``/``dcp.load`` with its default planners; only the storage layer differs:

* DCP: ``FileSystemWriter`` / ``FileSystemReader`` with their defaults (both fsync);
* shardwise: ``StorageWriter`` / ``StorageReader`` (fsync; every block checksummed on write and
  verified on read).

Saves are timed twice: to the same path every time (DCP overwrites its files in place there;
shardwise writes new files, the previous checkpoint intact until the commit, and removes the
old ones after), and to a new directory each time, as a training run saves each step (the
directory before removed after each save, untimed, as retention would).

Every method is interleaved in one run (the order rotates each repetition) on tmpfs
(``/dev/shm``) and on the disk of the working directory (``--dir``); times are collective
(barrier to barrier), the median of ``--reps`` repetitions after one warm-up. Before each load
every value is overwritten, and after the warm-up load every value is checked, so a fast wrong
load cannot pass. The ratio is DCP's time over shardwise's (above 1: shardwise is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from _launch import (
    collective_time,
    free_port,
    freeze_gc,
    fresh_dir,
    remove_dir,
    rotate,
    run_rank,
    run_world,
)
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


class _NewDirectories:
    """A new directory for each save (``<root>/<name>-<n>``), as a training run saves each
    step to its own path; the one before is removed after each save, untimed (retention)."""

    def __init__(self, root: str, name: str, rank: int) -> None:
        self._root, self._name, self._rank = root, name, rank
        self._count = 0

    def next(self) -> str:
        self._count += 1
        return os.path.join(self._root, f"{self._name}-{self._count}")

    def remove_older(self) -> None:
        if self._count > 1:
            remove_dir(os.path.join(self._root, f"{self._name}-{self._count - 1}"), self._rank)


@dataclass(frozen=True, slots=True)
class _Method:
    operation: Callable[[], object]
    loads: bool = False
    after: Callable[[], None] | None = None  # untimed, after each repetition


def _methods(state: training.TrainingState, root: str, rank: int) -> dict[str, _Method]:
    dcp_path, ours = os.path.join(root, "dcp"), os.path.join(root, "shardwise")
    dcp_new, ours_new = (_NewDirectories(root, name, rank) for name in ("dcp-new", "ours-new"))
    return {
        "dcp save": _Method(
            lambda: dcp.save(state.state, storage_writer=dcp.FileSystemWriter(dcp_path))
        ),
        "shardwise save": _Method(
            lambda: dcp.save(state.state, storage_writer=StorageWriter(ours))
        ),
        "dcp save new": _Method(
            lambda: dcp.save(state.state, storage_writer=dcp.FileSystemWriter(dcp_new.next())),
            after=dcp_new.remove_older,
        ),
        "shardwise save new": _Method(
            lambda: dcp.save(state.state, storage_writer=StorageWriter(ours_new.next())),
            after=ours_new.remove_older,
        ),
        "dcp load": _Method(
            lambda: dcp.load(state.state, storage_reader=dcp.FileSystemReader(dcp_path)), True
        ),
        "shardwise load": _Method(
            lambda: dcp.load(state.state, storage_reader=StorageReader(ours)), True
        ),
    }


def _body(rank: int, config: Config) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    state = training.build(QUICK_BIG if config.quick else BIG, mesh, per_layer=True, steps=2)
    state.fill()
    freeze_gc()
    results: dict[str, Any] = {"bytes": state.global_bytes}
    for directory in config.directories:
        root = fresh_dir(os.path.join(directory, "dcp-plugins-bench"), rank)
        methods = _methods(state, root, rank)
        # Warm-up: every method once, each load checked (the saves come first).
        for name, method in methods.items():
            if method.loads:
                state.clear()
            collective_time(method.operation)
            if method.loads:
                state.check(name)
            if method.after is not None:
                method.after()
        times: dict[str, list[float]] = {name: [] for name in methods}
        for repetition in range(config.reps):
            for name in rotate(list(methods), repetition):
                method = methods[name]
                if method.loads:
                    state.clear()
                times[name].append(collective_time(method.operation))
                if method.after is not None:
                    method.after()
        state.fill()
        results[directory] = {name: statistics.median(values) for name, values in times.items()}
        fresh_dir(root, rank)
    return results


def _rank(rank: int, config: Config) -> None:
    run_rank(rank, config, WORLD, 600, lambda: _body(rank, config))


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
            free_port(),
            results.name,
            tuple(directories),
            args.reps or (2 if args.quick else 5),
            args.quick,
        )
        found = run_world(_rank, config, WORLD)
    print(f"dcp.save / dcp.load, {WORLD} gloo ranks, FSDP2 state of {found['bytes'] / MIB:.0f} MiB")
    print(f"{'where':<20}{'case':<34}{'DCP (s)':>10}{'shardwise (s)':>15}{'DCP / shardwise':>17}")
    cases = (("save", "save"), ("save new", "save, a new directory each time"), ("load", "load"))
    for directory in directories:
        timing = found[directory]
        for case, label in cases:
            theirs, ours = timing[f"dcp {case}"], timing[f"shardwise {case}"]
            print(f"{directory:<20}{label:<34}{theirs:>10.3f}{ours:>15.3f}{theirs / ours:>16.2f}x")


if __name__ == "__main__":
    main()
