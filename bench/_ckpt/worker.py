"""Rank-side half of ``bench/checkpoint.py``: every measurement, run on each rank of a gloo world.

Each measurement is collective: all ranks meet at a barrier, run the operation, meet at a
barrier again; the time reported is the largest of the ranks' barrier-to-barrier times. Peak
memory is the process high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
minus the resident size just before the operation, the largest over the ranks.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import shardwise as sw
import shardwise.checkpoint as swckpt
from _launch import freeze_gc, fresh_dir, remove_dir, rotate, run_rank
from shardwise.checkpoint.loading.reader import CheckpointReader

WORLD_SIZE = 2
RAW = "raw"
SHARDWISE = "shardwise"


def dcp_name(threads: int) -> str:
    """Method name of DCP's FileSystemWriter with ``thread_count=threads``."""
    return f"dcp-t{threads}"


@dataclass
class Config:
    """What to run; pickled to the workers."""

    size_mib: int
    reps: int
    small: int
    storages: dict[str, str]
    dcp_threads: list[int]
    results: str
    port: int
    verify: bool = True
    cases: list[str] = field(default_factory=lambda: ["big", "small", "async"])


@dataclass
class Record:
    """One timed operation on all ranks."""

    storage: str
    case: str
    method: str
    rep: int
    seconds: float
    mem_mib: float
    extra: dict[str, float] = field(default_factory=dict)


# -- memory --------------------------------------------------------------------------------------

_LIBC = ctypes.CDLL("libc.so.6")
_FIELD = re.compile(r"^(VmHWM|VmRSS):\s+(\d+) kB", re.MULTILINE)


def _status_kib() -> dict[str, int]:
    with open("/proc/self/status") as file:
        return {name: int(value) for name, value in _FIELD.findall(file.read())}


def reset_peak() -> int:
    """Release freed heap, reset the high-water mark; returns the resident KiB now."""
    gc.collect()
    _LIBC.malloc_trim(0)
    # Writing 5 resets VmHWM to the current RSS (Linux >= 4.0, own process, no privileges).
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")
    return _status_kib()["VmRSS"]


def peak_kib() -> int:
    """The resident high-water mark since the last :func:`reset_peak`."""
    return _status_kib()["VmHWM"]


# -- timing --------------------------------------------------------------------------------------


def _max_over_ranks(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def measure(operation: Callable[[], object]) -> tuple[float, float]:
    """Collective wall time (s) and peak extra memory (MiB) of ``operation`` on every rank."""
    base = reset_peak()
    dist.barrier()
    start = time.perf_counter()
    operation()
    dist.barrier()
    seconds = time.perf_counter() - start
    extra_mib = (peak_kib() - base) / 1024
    seconds, extra_mib = _max_over_ranks([seconds, extra_mib])
    return seconds, extra_mib


def measure_async(start_save: Callable[[], Any]) -> tuple[float, float, float]:
    """Blocked time, total time (s) and peak extra memory (MiB) of an asynchronous save."""
    base = reset_peak()
    dist.barrier()
    start = time.perf_counter()
    future = start_save()
    blocked = time.perf_counter() - start
    future.result()
    dist.barrier()
    total = time.perf_counter() - start
    extra_mib = (peak_kib() - base) / 1024
    blocked, total, extra_mib = _max_over_ranks([blocked, total, extra_mib])
    return blocked, total, extra_mib


# -- data ----------------------------------------------------------------------------------------


def fill_pattern(out: torch.Tensor, row0: int, col0: int) -> None:
    """Fill the 2-D ``out`` with the global pattern (exact in float32) at ``(row0, col0)``:
    element ``(i, j)`` is ``(7 i + 13 j) mod 1021``."""
    rows, cols = out.shape
    columns = ((torch.arange(col0, col0 + cols, dtype=torch.int64) * 13) % 1021).float()
    block = 256
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        bases = ((torch.arange(row0 + start, row0 + stop, dtype=torch.int64) * 7) % 1021).float()
        piece = out[start:stop]
        torch.add(columns.unsqueeze(0), bases.unsqueeze(1), out=piece)
        piece.remainder_(1021)


def check_pattern(tensor: torch.Tensor, row0: int, col0: int, what: str) -> None:
    """Raise unless ``tensor`` holds the pattern at ``(row0, col0)``."""
    expected = torch.empty_like(tensor)
    fill_pattern(expected, row0, col0)
    if not torch.equal(expected, tensor):
        raise AssertionError(f"{what}: loaded data differs from what was saved")


def small_shapes(count: int) -> list[tuple[int, ...]]:
    """A mix of small parameter shapes (biases, norms, small matrices): 0.25-4 KiB each."""
    cycle: list[tuple[int, ...]] = [(64,), (256,), (16, 16), (1024,), (8, 32)]
    return [cycle[i % len(cycle)] for i in range(count)]


def small_state_dict(count: int, fill: bool) -> dict[str, torch.Tensor]:
    """``count`` small float32 tensors (the same on every rank: replicated)."""
    state = {}
    for i, shape in enumerate(small_shapes(count)):
        tensor = torch.zeros(shape)
        if fill:
            tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).view(shape) + i)
        state[f"layers.{i // 10}.param{i % 10}"] = tensor
    return state


class Data:
    """Every tensor the benchmark saves from or loads into, created once per rank.

    The ShardedTensor (for shardwise) and the DTensor (for DCP) of one layout share one local
    tensor, so both libraries move exactly the same bytes to and from the same memory.
    """

    def __init__(self, config: Config, mesh: DeviceMesh, rank: int) -> None:
        elements = config.size_mib * (1 << 20) // 4
        side = int(elements**0.5)
        while elements % side:
            side -= 1
        self.rows_total, self.cols_total = elements // side, side
        assert self.rows_total % WORLD_SIZE == 0 and self.cols_total % WORLD_SIZE == 0
        self.rank = rank
        self.row_part = self.rows_total // WORLD_SIZE
        self.col_part = self.cols_total // WORLD_SIZE
        placements = [f"rank:{r}/cpu" for r in range(WORLD_SIZE)]
        by_rows = sw.ChunkShardingSpec(dim=0, placements=placements)
        by_cols = sw.ChunkShardingSpec(dim=1, placements=placements)
        size = (self.rows_total, self.cols_total)

        self.source = torch.empty(self.row_part, self.cols_total)
        fill_pattern(self.source, rank * self.row_part, 0)
        self.rows_target = torch.zeros(self.row_part, self.cols_total)
        self.cols_target = torch.zeros(self.rows_total, self.col_part)
        self.full_target = torch.zeros(size) if rank == 0 else None
        # Every rank's copy of the whole tensor (DDP-style: each loads all of it); rank 0's
        # is the 2 -> 1 target, not used by both cases at once.
        self.whole_target = self.full_target if rank == 0 else torch.zeros(size)

        self.st_source = sw.init_from_local_tensor(self.source, by_rows, *size)
        self.st_rows = sw.init_from_local_tensor(self.rows_target, by_rows, *size)
        self.st_cols = sw.init_from_local_tensor(self.cols_target, by_cols, *size)
        self.dt_source = _dtensor(self.source, mesh, 0, size)
        self.dt_rows = _dtensor(self.rows_target, mesh, 0, size)
        self.dt_cols = _dtensor(self.cols_target, mesh, 1, size)
        self.local_bytes = self.source.numel() * self.source.element_size()

        self.small = small_state_dict(config.small, fill=True)
        self.small_target = small_state_dict(config.small, fill=False)
        self.small_bytes = sum(t.numel() * t.element_size() for t in self.small.values())
        # A one-rank group for the 2 -> 1 load (shardwise is always collective over a group).
        self.solo = dist.new_group([0])

    def verify_rows(self, what: str) -> None:
        check_pattern(self.rows_target, self.rank * self.row_part, 0, what)

    def verify_cols(self, what: str) -> None:
        check_pattern(self.cols_target, 0, self.rank * self.col_part, what)

    def verify_full(self, what: str) -> None:
        if self.full_target is not None:
            check_pattern(self.full_target, 0, 0, what)

    def verify_whole(self, what: str) -> None:
        check_pattern(self.whole_target, 0, 0, what)

    def verify_small(self, what: str) -> None:
        for key, tensor in self.small.items():
            if not torch.equal(tensor, self.small_target[key]):
                raise AssertionError(f"{what}: {key} differs from what was saved")

    def clear_targets(self) -> None:
        self.rows_target.zero_()
        self.cols_target.zero_()
        self.whole_target.zero_()  # rank 0's is full_target
        for tensor in self.small_target.values():
            tensor.zero_()


def _dtensor(local: torch.Tensor, mesh: DeviceMesh, dim: int, size: tuple[int, int]) -> DTensor:
    return DTensor.from_local(
        local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(size), stride=(size[1], 1)
    )


# -- the operations ------------------------------------------------------------------------------


def raw_save(data: Data, path: str) -> None:
    """The limit for a save: this rank's bytes written with os.write and fsynced."""
    os.makedirs(path, exist_ok=True)
    view = memoryview(data.source.view(-1).view(torch.uint8).numpy())
    fd = os.open(f"{path}/rank-{data.rank}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_load(data: Data, path: str) -> None:
    """The limit for a load: this rank's bytes read with os.preadv straight into the target."""
    view = memoryview(data.rows_target.view(-1).view(torch.uint8).numpy())
    fd = os.open(f"{path}/rank-{data.rank}.bin", os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            count = os.preadv(fd, [view[done:]], done)
            if count == 0:
                raise OSError("short read")
            done += count
    finally:
        os.close(fd)


def _dcp_writer(path: str, threads: int) -> dcp.FileSystemWriter:
    # Defaults otherwise (sync_files=True, single_file_per_rank=True, torch_save format).
    return dcp.FileSystemWriter(path, thread_count=threads)


@dataclass
class Step:
    """One named operation of a method."""

    case: str
    run: Callable[[], object]
    check: Callable[[], None] | None = None


def big_steps(method: str, data: Data, path: str, loads: bool = True) -> list[Step]:
    """Save, load, rows->columns load, 2->1 load and a load of the whole tensor on every rank
    (DDP-style) of the big tensor with ``method``
    (for DCP, only the save unless ``loads``: its reader has no settings to compare)."""
    if method == RAW:
        return [
            Step("save", lambda: raw_save(data, path)),
            Step("load", lambda: raw_load(data, path), lambda: data.verify_rows("raw load")),
        ]
    solo = data.solo
    if method == SHARDWISE:

        def to_one() -> None:
            if data.full_target is not None:
                swckpt.load({"w": data.full_target}, path, process_group=solo)

        return [
            Step("save", lambda: swckpt.save({"w": data.st_source}, path)),
            Step(
                "load",
                lambda: swckpt.load({"w": data.st_rows}, path),
                lambda: data.verify_rows("shardwise load"),
            ),
            Step(
                "reshard-cols",
                lambda: swckpt.load({"w": data.st_cols}, path),
                lambda: data.verify_cols("shardwise rows->cols load"),
            ),
            Step("reshard-2to1", to_one, lambda: data.verify_full("shardwise 2->1 load")),
            Step(
                "load-whole",
                lambda: swckpt.load({"w": data.whole_target}, path),
                lambda: data.verify_whole("shardwise load of the whole tensor on every rank"),
            ),
        ]
    threads = int(method.removeprefix("dcp-t"))

    def dcp_to_one() -> None:
        if data.full_target is not None:
            dcp.load(
                {"w": data.full_target},
                storage_reader=dcp.FileSystemReader(path),
                no_dist=True,
            )

    save = Step(
        "save", lambda: dcp.save({"w": data.dt_source}, storage_writer=_dcp_writer(path, threads))
    )
    if not loads:
        return [save]
    return [
        save,
        Step(
            "load",
            lambda: dcp.load({"w": data.dt_rows}, storage_reader=dcp.FileSystemReader(path)),
            lambda: data.verify_rows(f"{method} load"),
        ),
        Step(
            "reshard-cols",
            lambda: dcp.load({"w": data.dt_cols}, storage_reader=dcp.FileSystemReader(path)),
            lambda: data.verify_cols(f"{method} rows->cols load"),
        ),
        Step("reshard-2to1", dcp_to_one, lambda: data.verify_full(f"{method} 2->1 load")),
        Step(
            "load-whole",
            lambda: dcp.load({"w": data.whole_target}, storage_reader=dcp.FileSystemReader(path)),
            lambda: data.verify_whole(f"{method} load of the whole tensor on every rank"),
        ),
    ]


def small_steps(method: str, data: Data, path: str, loads: bool = True) -> list[Step]:
    """Save and load of the many small tensors with ``method`` (see :func:`big_steps`)."""
    check = lambda: data.verify_small(f"{method} small load")  # noqa: E731
    if method == SHARDWISE:
        return [
            Step("small-save", lambda: swckpt.save(data.small, path)),
            Step("small-load", lambda: swckpt.load(data.small_target, path), check),
        ]
    threads = int(method.removeprefix("dcp-t"))
    save = Step(
        "small-save", lambda: dcp.save(data.small, storage_writer=_dcp_writer(path, threads))
    )
    if not loads:
        return [save]
    return [
        save,
        Step(
            "small-load",
            lambda: dcp.load(data.small_target, storage_reader=dcp.FileSystemReader(path)),
            check,
        ),
    ]


# -- driver --------------------------------------------------------------------------------------


class Runner:
    """Runs the interleaved repetitions on one rank and collects records on rank 0."""

    def __init__(self, config: Config, data: Data, rank: int) -> None:
        self.config = config
        self.data = data
        self.rank = rank
        self.records: list[Record] = []
        # DCP's FileSystemReader has no thread count: loads are timed from the checkpoint of
        # the first --dcp-threads value only (1, the default, unless told otherwise).
        self.loading_dcp = dcp_name(config.dcp_threads[0])

    def _fresh_dir(self, root: str, name: str) -> str:
        return fresh_dir(os.path.join(root, name), self.rank)

    def _remove(self, path: str) -> None:
        remove_dir(path, self.rank)

    def _run_steps(self, storage: str, method: str, rep: int, steps: list[Step]) -> None:
        for step in steps:
            if rep == 0 and self.config.verify and step.check is not None:
                self.data.clear_targets()
            extra: dict[str, float] = {}
            if method == SHARDWISE and step.case == "reshard-cols":
                with _ReadBytes() as counted:
                    seconds, mem = measure(step.run)
                # What this rank read from the data files against what it needed (its
                # column block): the checksummed blocks its reads touch, each once.
                needed = self.data.cols_target.numel() * self.data.cols_target.element_size()
                extra = {"read": counted.total / needed}
            else:
                seconds, mem = measure(step.run)
            if rep == 0 and self.config.verify and step.check is not None:
                step.check()
            self.records.append(Record(storage, step.case, method, rep, seconds, mem, extra))

    def big(self, storage: str, root: str, rep: int, methods: list[str]) -> None:
        for method in methods:
            path = self._fresh_dir(root, f"big-{method}")
            loads = method == self.loading_dcp or not method.startswith("dcp")
            self._run_steps(storage, method, rep, big_steps(method, self.data, path, loads))
            self._remove(path)

    def small(self, storage: str, root: str, rep: int, methods: list[str]) -> None:
        for method in methods:
            path = self._fresh_dir(root, f"small-{method}")
            loads = method == self.loading_dcp or not method.startswith("dcp")
            self._run_steps(storage, method, rep, small_steps(method, self.data, path, loads))
            self._remove(path)

    def asynchronous(self, storage: str, root: str, rep: int, methods: list[str]) -> None:
        data = self.data
        for method in methods:
            if method == "memcpy":
                # What staging must at least cost: a fresh copy of this rank's state dict.
                seconds, mem = measure(lambda: torch.empty_like(data.source).copy_(data.source))
                self.records.append(Record(storage, "async", "memcpy", rep, seconds, mem))
                continue
            path = self._fresh_dir(root, f"async-{method}")
            if method == SHARDWISE:
                blocked, total, mem = measure_async(
                    lambda: swckpt.async_save({"w": data.st_source}, path)  # noqa: B023
                )
            else:
                blocked, total, mem = measure_async(
                    lambda: dcp.async_save(
                        {"w": data.dt_source},
                        storage_writer=dcp.FileSystemWriter(path),  # noqa: B023
                    )
                )
            self.records.append(
                Record(storage, "async", method, rep, blocked, mem, {"total": total})
            )
            self._remove(path)

    def run(self) -> None:
        config = self.config
        dcps = [dcp_name(n) for n in config.dcp_threads]
        storages = list(config.storages.items())
        began = time.perf_counter()
        for rep in range(config.reps + 1):  # rep 0 is the warm-up
            # Interleave: alternate the storage order and rotate the method order every rep.
            order = storages if rep % 2 == 0 else storages[::-1]
            for storage, root in order:
                if "big" in config.cases:
                    self.big(storage, root, rep, rotate([RAW, SHARDWISE, *dcps], rep))
                if "small" in config.cases:
                    self.small(storage, root, rep, rotate([SHARDWISE, *dcps], rep))
                if "async" in config.cases:
                    self.asynchronous(
                        storage, root, rep, rotate(["memcpy", SHARDWISE, self.loading_dcp], rep)
                    )
            if self.rank == 0:
                label = "warm-up" if rep == 0 else f"rep {rep}/{config.reps}"
                print(
                    f"  {label} done at {time.perf_counter() - began:6.1f} s",
                    file=sys.stderr,
                    flush=True,
                )


class _ReadBytes:
    """The bytes this process's checkpoint readers read from data files while in the ``with``
    (summed when each reader closes)."""

    def __init__(self) -> None:
        self.total = 0
        self._close = CheckpointReader.close

    def __enter__(self) -> _ReadBytes:
        close = self._close

        def counting_close(reader: CheckpointReader) -> None:
            self.total += reader.files.bytes_read
            close(reader)

        CheckpointReader.close = counting_close  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        CheckpointReader.close = self._close  # type: ignore[method-assign]


def main(rank: int, config: Config) -> None:
    """Entry point of one rank (spawned by ``bench/checkpoint.py``)."""

    def body() -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        data = Data(config, mesh, rank)
        freeze_gc()
        runner = Runner(config, data, rank)
        runner.run()
        return {
            "records": [asdict(record) for record in runner.records],
            "local_bytes": data.local_bytes,
            "small_bytes": data.small_bytes,
            "shape": [data.rows_total, data.cols_total],
        }

    run_rank(rank, config, WORLD_SIZE, 600, body)
