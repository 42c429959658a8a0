"""What the verified read pass of a load costs beyond the raw bytes: one process, tmpfs.

Three states, each saved once, then loaded ``--repeat`` times (median), with and without
verification, beside the raw limit (one ``preadv`` per saved chunk into the destination
tensors, on the same threads as a load, from the page cache):

- ``big``: ``--big-mib`` of float32 tensors of 4 to 16 MiB (the share of one rank of a large
  training state);
- ``small``: ``--small`` tensors of 64 to 1,024 floats (per-tensor cost);
- ``resharded``: 8 tensors of 64 MiB saved as 2 row shards each (as 2 ranks save them),
  loaded as the column shard of one of 2 ranks (a ``LocalShardsWrapper`` of the left half of
  each tensor), with the bytes read against the bytes needed; rows of ``--row-kib`` KiB
  (default 16: runs of 8 KiB; from 32, runs of 16 KiB and more are scattered straight into
  the destination).

    python bench/load_passes.py [--repeat 5] [--quick] [--row-kib 16]
                                [--profile big|small|resharded]

The machine may be shared: repeat, and compare medians of runs made under the same load.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.loading.reader import CheckpointReader
from shardwise.checkpoint.storage import run_concurrently
from shardwise.local_shards import LocalShardsWrapper

_MIB = 1 << 20


def _big_state(total_mib: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {}
    sizes = [4, 8, 16, 12, 6]
    used = 0
    number = 0
    while used < total_mib:
        mib = min(sizes[number % len(sizes)], total_mib - used)
        state[f"layer{number}.weight"] = torch.randn(mib * _MIB // 4, generator=generator)
        used += mib
        number += 1
    return state


def _small_state(count: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"block{n // 10}.param{n % 10}": torch.randn(64 + (n * 97) % 961, generator=generator)
        for n in range(count)
    }


_TENSOR_BYTES, _TENSORS = 64 * _MIB, 8  # float32 tensors of 64 MiB, rows of --row-kib


def _shape(row_kib: int) -> tuple[int, int]:
    cols = row_kib * 1024 // 4
    return _TENSOR_BYTES // 4 // cols, cols


def _resharded_save_state(row_kib: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {}
    rows, cols = _shape(row_kib)
    half = rows // 2
    for number in range(_TENSORS):
        full = torch.randn(rows, cols, generator=generator)
        state[f"w{number}"] = LocalShardsWrapper(
            [full[:half].clone(), full[half:].clone()], [(0, 0), (half, 0)]
        )
    return state


def _resharded_target(row_kib: int) -> dict[str, Any]:
    rows, cols = _shape(row_kib)
    return {
        f"w{number}": LocalShardsWrapper([torch.zeros(rows, cols // 2)], [(0, 0)])
        for number in range(_TENSORS)
    }


def _like(state: dict[str, Any]) -> dict[str, Any]:
    return {key: torch.empty_like(value) for key, value in state.items()}


class _Counted:
    """The bytes read by the readers that loads open (summed at close), and the time spent in
    the read pass (``fill``)."""

    _TIMED = ("fill",)

    def __init__(self) -> None:
        self.read = 0
        self.seconds = dict.fromkeys(self._TIMED, 0.0)
        self._originals = {
            name: getattr(CheckpointReader, name) for name in (*self._TIMED, "close")
        }

    def __enter__(self) -> _Counted:
        close = self._originals["close"]

        def counting(reader: CheckpointReader) -> None:
            self.read += reader.files.bytes_read
            close(reader)

        def timed(name: str) -> Callable[..., None]:
            method = self._originals[name]

            def run(reader: CheckpointReader, *args: Any, **kwargs: Any) -> None:
                start = time.perf_counter()
                try:
                    method(reader, *args, **kwargs)
                finally:
                    self.seconds[name] += time.perf_counter() - start

            return run

        CheckpointReader.close = counting  # type: ignore[method-assign]
        for name in self._TIMED:
            setattr(CheckpointReader, name, timed(name))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, method in self._originals.items():
            setattr(CheckpointReader, name, method)


def _raw(path: str, state: dict[str, Any]) -> Callable[[], None]:
    """One preadv per saved chunk straight into the tensors (no checks, no planning)."""
    with CheckpointReader.open(path) as reader:
        plan = []
        for key, tensor in state.items():
            (chunk,) = reader.index.tensors[key].chunks
            plan.append((reader.files.path(chunk.file), chunk.begin, tensor))
    files = {name: os.open(name, os.O_RDONLY) for name, _, _ in plan}

    def read() -> None:
        def one(item: tuple[str, int, torch.Tensor]) -> None:
            name, offset, tensor = item
            view = memoryview(tensor.numpy()).cast("B")
            os.preadv(files[name], [view], offset)

        run_concurrently(plan, lambda item: item[2].nbytes, one)

    return read


def _time(work: Callable[[], object], repeat: int) -> tuple[float, float, float]:
    """Median wall time, fastest wall time and median CPU time of this process (all its
    threads) of ``work``: on a shared machine, the fastest run and the CPU time move less with
    the other processes' load than the median."""
    work()  # warm: the page cache, the threads, the allocator
    walls, cpus = [], []
    for _ in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        work()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), min(walls), statistics.median(cpus)


def _profile(work: Callable[[], object]) -> None:
    work()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        work()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/dev/shm/shardwise-load-passes")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--big-mib", type=int, default=300)
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument(
        "--row-kib",
        type=int,
        default=16,
        help="resharded: bytes of a saved row in KiB (half of each is loaded)",
    )
    parser.add_argument("--quick", action="store_true", help="smaller states, 3 repetitions")
    parser.add_argument("--only", choices=["big", "small", "resharded"], action="append")
    parser.add_argument("--profile", choices=["big", "small", "resharded"])
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.big_mib, args.small = 3, 64, 2_000
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    torch.set_num_threads(1)
    cases = args.only or ["big", "small", "resharded"]
    if args.profile:
        cases = [args.profile]
    try:
        for case in cases:
            path = os.path.join(args.dir, case)
            if case == "resharded":
                ckpt.save(_resharded_save_state(args.row_kib), path)
                target = _resharded_target(args.row_kib)
                needed = sum(t.local_shards()[0].nbytes for t in target.values())
            else:
                saved = _big_state(args.big_mib) if case == "big" else _small_state(args.small)
                ckpt.save(saved, path)
                target = _like(saved)
                needed = sum(t.nbytes for t in target.values())
                del saved

            def load(verify: bool, path: str = path, target: dict[str, Any] = target) -> None:
                ckpt.load(target, path, verify=verify)

            if args.profile:
                _profile(lambda: load(True))
                continue
            print(f"{case}: {len(target)} tensors, {needed / _MIB:.1f} MiB needed")
            if case != "resharded":
                raw, fastest, raw_cpu = _time(_raw(path, target), args.repeat)
                print(
                    f"  raw preadv          {raw * 1e3:8.1f} ms   min {fastest * 1e3:7.1f} ms   "
                    f"cpu {raw_cpu * 1e3:7.1f} ms"
                )
            for verify in (True, False):
                with _Counted() as counted:
                    seconds, fastest, cpu = _time(lambda v=verify: load(v), args.repeat)  # type: ignore[misc]
                runs = args.repeat + 1
                ratio = counted.read / runs / needed
                passes = "  ".join(
                    f"{name} {total / runs * 1e3:.1f} ms" for name, total in counted.seconds.items()
                )
                print(
                    f"  load(verify={verify!s:5}) {seconds * 1e3:8.1f} ms   "
                    f"min {fastest * 1e3:7.1f} ms   cpu {cpu * 1e3:7.1f} ms   "
                    f"read {ratio:.2f}x needed   (mean {passes})"
                )
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
