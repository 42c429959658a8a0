"""shardwise.checkpoint against Meta's torch_checkpointing and torch.distributed.checkpoint (DCP).

Run ``python bench/vs_torch_checkpointing.py`` (``--quick``: a smaller model and 2
repetitions, about a minute; ``--reps N``; ``--profile``: cProfile of each library's save and
load on rank 0). It needs torch_checkpointing in the same environment (``pip install -e
".[bench]"``, or ``pip install --no-deps torch-checkpointing==0.1.1``); without it the script
says so and compares shardwise with DCP only.

The state is the training-state bench's (``bench/training_state.py``): a GPT-like decoder of
about 106M parameters (``--quick``: 7M), each block and the root sharded with FSDP2 over 4 gloo
ranks on CPU, AdamW after two real steps, ``{"model": ..., "optim": ...}`` from
``get_state_dict``. Every library saves and loads that same state dict, on tmpfs
(``--tmpfs-dir``, default ``/dev/shm``), each checkpoint into a new directory:

* save: ``shardwise.checkpoint.save``; ``dcp.save`` with ``FileSystemWriter``;
  torch_checkpointing's ``CheckpointManager.save`` with a synchronous saver;
* load into the same world size: ``shardwise.checkpoint.load`` (checks every block);
  ``dcp.load`` with ``FileSystemReader``; ``CheckpointManager.load(path, into=state)``;
* async save: ``shardwise.checkpoint.async_save``; ``dcp.async_save`` (its defaults: the copy in
  the call, the write on a thread); ``CheckpointManager.save`` with its asynchronous saver. Three
  times from the call: until it returns; until the state may be changed again (the snapshot is
  taken: shardwise and DCP copy it before they return, torch_checkpointing copies it on a
  thread after, and ``with manager.lock():`` waits for that copy); until the checkpoint is
  committed on every rank (the future done, then a barrier).

torch_checkpointing on CPU: its async staging is configured explicitly for CPU (no pinned
memory, no non-blocking device copies: those need CUDA; shared memory for the hand-over to its
writer process and staging on a thread, as by default); the storage is its local filesystem
backend with its defaults. Items get no resharder, so each rank writes and reads its own
``torch.save`` files: a checkpoint that loads only into the same layout. Its
resharding-capable configuration (``ItemSpec(resharder=DefaultResharder())``, whose saves
record the global layout as shardwise and DCP always do) is tried in the warm-up and reported
as unavailable if it fails (in 0.1.1 the metadata all-gather allocates on ``cuda``).
torch_checkpointing writes without fsync (shardwise and DCP fsync; on tmpfs that costs little).

Times are collective (barrier to barrier, the slowest rank), the median of ``--reps``
repetitions after one warm-up; the order of the libraries rotates every repetition. The
warm-up overwrites every value before each load and checks every loaded value after it, and
loads back what each async save wrote (checked), so a fast wrong load cannot pass. Peak memory
is the largest rank's resident high-water mark above its resident size before the operation
(writer processes are not counted, nor staging buffers a library keeps from its earlier saves).
Ratios are the other library's time / shardwise's (above 1: shardwise is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import shardwise.checkpoint as ckpt
from _ckpt.worker import measure, peak_kib, reset_peak
from _launch import (
    free_port,
    freeze_gc,
    fresh_dir,
    remove_dir,
    rotate,
    run_rank,
    run_world,
    work_dir,
)
from _training import state as training
from _training.model import BIG, QUICK_BIG, ModelShape
from _training.worker import LOAD_PHASES, SAVE_PHASES, cprofiled, phase_times
from checkpoint import _fs_type, _source_state

WORLD = 4
MIB = 1 << 20
GIB = 1 << 30
SHARDWISE = "shardwise"
DCP = "dcp"
TC = "torch_checkpointing"
TC_RESHARD = "torch_checkpointing+resharder"
LIBRARY = "torch_checkpointing"
VERSION = "0.1.1"


# -- the library --------------------------------------------------------------------------------


def _library() -> Any:
    """The installed torch_checkpointing package, or None."""
    if importlib.util.find_spec(LIBRARY) is None:
        return None
    return importlib.import_module(LIBRARY)


def _library_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-checkpointing")
    except PackageNotFoundError:
        return None


def _quiet_device_mesh() -> None:
    """Silence torch's warning on unpickling a DeviceMesh (torch_checkpointing's load, and its
    writer process, unpickle one with each DTensor): in the ranks and in the writer processes
    (``subprocess_init_fn``)."""
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)


class Library:
    """torch_checkpointing's managers on one rank: synchronous, asynchronous, and synchronous
    with a resharder (None if that configuration failed)."""

    def __init__(self) -> None:
        tc = _library()
        from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
        from torch_checkpointing.default_resharder import DefaultResharder
        from torch_checkpointing.staging import CheckpointStagerConfig

        manager = tc.CheckpointManager
        self.sync = manager(manager.Config(save=SyncCheckpointSaverConfig()))
        # CPU staging: no pinned memory and no non-blocking copies (both need CUDA); shared
        # memory for the writer process and a staging thread, as the defaults have them.
        staging = CheckpointStagerConfig(
            use_pinned_memory=False,
            use_non_blocking_copy=False,
            use_shared_memory=True,
            use_async_staging=True,
        )
        self.asynchronous = manager(
            manager.Config(
                save=AsyncCheckpointSaverConfig(staging_config=staging),
                subprocess_init_fn=_quiet_device_mesh,
            )
        )
        self.reshard: Any = manager(
            manager.Config(
                save=SyncCheckpointSaverConfig(),
                default=tc.ItemSpec(resharder=DefaultResharder()),
            )
        )
        self.reshard_error: str | None = None

    def close(self) -> None:
        for manager in (self.sync, self.asynchronous, self.reshard):
            if manager is not None:
                manager.close()


# -- rank side ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Config:
    port: int
    results: str
    root: str
    shape: ModelShape
    reps: int
    library: bool
    verify: bool
    profile: bool
    profile_top: int


def _max_over_ranks(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def _measure_async(
    start: Callable[[], Any], wait_snapshot: Callable[[Any], None]
) -> tuple[float, float, float, float]:
    """Seconds from the call until it returns, until the snapshot is taken, until the save is
    committed on every rank, and peak extra MiB (the largest rank's)."""
    base = reset_peak()
    dist.barrier()
    began = time.perf_counter()
    future = start()
    returned = time.perf_counter() - began
    wait_snapshot(future)
    snapshot = time.perf_counter() - began
    future.result()
    dist.barrier()
    committed = time.perf_counter() - began
    mem = (peak_kib() - base) / 1024
    returned, snapshot, committed, mem = _max_over_ranks([returned, snapshot, committed, mem])
    return returned, snapshot, committed, mem


class Runner:
    """The repetitions on one rank; rank 0's records are the result."""

    def __init__(self, config: Config, rank: int, state: training.TrainingState) -> None:
        self.config = config
        self.rank = rank
        self.state = state
        self.records: list[dict[str, Any]] = []
        self.checks: list[str] = []
        self.notes: list[str] = []
        self.library = Library() if config.library else None

    # the operations of each library

    def _manager(self, method: str) -> Any:
        """torch_checkpointing's synchronous manager for ``method`` (with a resharder or not)."""
        assert self.library is not None
        return self.library.sync if method == TC else self.library.reshard

    def save(self, method: str, path: str) -> None:
        state = self.state.state
        if method == SHARDWISE:
            ckpt.save(state, path)
        elif method == DCP:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
        else:
            self._manager(method).save(path, state)

    def load(self, method: str, path: str) -> None:
        state = self.state.state
        if method == SHARDWISE:
            ckpt.load(state, path)
        elif method == DCP:
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
        else:
            self._manager(method).load(path, into=state)

    def start_async(self, method: str, path: str) -> Any:
        state = self.state.state
        if method == SHARDWISE:
            return ckpt.async_save(state, path)
        if method == DCP:
            return dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path))
        assert self.library is not None
        return self.library.asynchronous.save(path, state)

    def wait_snapshot(self, method: str, future: Any) -> None:
        """Until the state may change again: the library's own guard for it."""
        if method == TC:
            assert self.library is not None
            # The documented guard around an in-place update (optimizer.step()): it waits
            # while the save is still copying the state.
            with self.library.asynchronous.lock():
                pass
        elif hasattr(future, "staging_completion"):
            # dcp.async_save with a stager that copies in the background
            future.staging_completion.result()

    # the cases

    def _dir(self, name: str) -> str:
        return fresh_dir(os.path.join(self.config.root, name), self.rank)

    def _record(self, case: str, method: str, rep: int, seconds: float, mem: float) -> None:
        self.records.append(
            {"case": case, "method": method, "rep": rep, "seconds": seconds, "mem_mib": mem}
        )

    def sync_methods(self) -> list[str]:
        methods = [SHARDWISE, DCP]
        if self.library is not None:
            methods.append(TC)
            if self.library.reshard is not None:
                methods.append(TC_RESHARD)
        return methods

    def save_load(self, rep: int) -> None:
        checking = rep == 0 and self.config.verify
        for method in rotate(self.sync_methods(), rep):
            path = self._dir(f"sync-{method}")
            seconds, mem = measure(functools.partial(self.save, method, path))
            self._record("save", method, rep, seconds, mem)
            if checking:
                self.state.clear()
            seconds, mem = measure(functools.partial(self.load, method, path))
            if checking:
                self.state.check(f"{method} load")
                self.checks.append(f"{method} load")
            self._record("load", method, rep, seconds, mem)
            remove_dir(path, self.rank)

    def asynchronous(self, rep: int) -> None:
        methods = [SHARDWISE, DCP] + ([TC] if self.library is not None else [])
        for method in rotate(methods, rep):
            path = self._dir(f"async-{method}")
            returned, snapshot, committed, mem = _measure_async(
                functools.partial(self.start_async, method, path),
                functools.partial(self.wait_snapshot, method),
            )
            if rep == 0 and self.config.verify:
                # What the background save wrote must load back (checked, untimed).
                self.state.clear()
                self.load(method, path)
                self.state.check(f"{method} async save, loaded back")
                self.checks.append(f"{method} async save")
            for case, seconds in (
                ("async-returned", returned),
                ("async-snapshot", snapshot),
                ("async-committed", committed),
            ):
                self._record(case, method, rep, seconds, mem)
            remove_dir(path, self.rank)

    def try_reshard(self) -> None:
        """Save once with the resharding configuration (every rank): dropped, with its
        error, if that fails on any rank."""
        assert self.library is not None
        error = ""
        path = self._dir("reshard-probe")
        try:
            self.library.reshard.save(path, self.state.state)
        except Exception as caught:  # reported below, not hidden
            error = f"{type(caught).__name__}: {caught}".splitlines()[0]
        failed = torch.tensor([1 if error else 0])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            self.library.reshard_error = error or "failed on another rank"
            self.notes.append(
                f"{TC} with ItemSpec(resharder=DefaultResharder()) (the configuration whose "
                f"checkpoints load into another layout): its save failed on CPU: "
                f"{self.library.reshard_error}; not timed"
            )
            with contextlib.suppress(Exception):
                self.library.reshard.close()
            self.library.reshard = None
        remove_dir(path, self.rank)
        # torch_checkpointing writes into tmp_<name> beside the path, then renames it
        remove_dir(os.path.join(self.config.root, "tmp_reshard-probe"), self.rank)

    def profile(self) -> dict[str, str]:
        """Each library's save and load once more on every rank, rank 0 under cProfile (and,
        for shardwise, its phase timers first)."""
        texts: dict[str, str] = {}
        top = self.config.profile_top
        for method in self.sync_methods():
            path = os.path.join(self.config.root, f"profile-{method}")
            for case, run, phases in (
                ("save", self.save, SAVE_PHASES),
                ("load", self.load, LOAD_PHASES),
            ):
                operation = functools.partial(run, method, path)
                tools = [functools.partial(cprofiled, operation, top)]
                if method == SHARDWISE:
                    tools.insert(0, functools.partial(phase_times, operation, phases))
                out = []
                for tool in tools:
                    if case == "save":
                        fresh_dir(path, self.rank)
                    dist.barrier()
                    if self.rank == 0:
                        out.append(tool())
                    else:
                        operation()
                    dist.barrier()
                texts[f"{method} {case}"] = "\n\n".join(out)
            remove_dir(path, self.rank)
        return texts


def _progress(rank: int, label: str, began: float) -> None:
    if rank == 0:
        print(
            f"  {label} done at {time.perf_counter() - began:6.1f} s", file=sys.stderr, flush=True
        )


def _body(rank: int, config: Config) -> dict[str, Any]:
    _quiet_device_mesh()
    began = time.perf_counter()
    mesh = init_device_mesh("cpu", (WORLD,))
    state = training.build(config.shape, mesh, per_layer=True, steps=2)
    state.fill()
    runner = Runner(config, rank, state)
    freeze_gc()
    _progress(rank, "building the model", began)
    try:
        if runner.library is not None:
            runner.try_reshard()
        for rep in range(config.reps + 1):
            # rep 0 is the warm-up (it checks every value, and starts the writer processes)
            runner.save_load(rep)
            runner.asynchronous(rep)
            _progress(rank, "warm-up" if rep == 0 else f"rep {rep}/{config.reps}", began)
        profiles = runner.profile() if config.profile else {}
    finally:
        if runner.library is not None:
            runner.library.close()
    return {
        "records": runner.records,
        "checks": runner.checks,
        "notes": runner.notes,
        "profiles": profiles,
        "tensors": len(state.leaves),
        "global_bytes": state.global_bytes,
        "local_bytes": state.local_bytes,
    }


def _rank(rank: int, config: Config) -> None:
    run_rank(rank, config, WORLD, 900, lambda: _body(rank, config))


# -- report -------------------------------------------------------------------------------------

ROWS = [
    ("save", "save"),
    ("load", "load"),
    ("async: returns", "async-returned"),
    ("async: state free", "async-snapshot"),
    ("async: committed", "async-committed"),
]


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 0.01:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


class Report:
    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.times: dict[tuple[str, str], dict[int, float]] = {}
        self.mems: dict[tuple[str, str], list[float]] = {}
        # The warm-up's async save: a library's first, which starts its writer process.
        self.first = {
            r["method"]: r["seconds"]
            for r in records
            if r["rep"] == 0 and r["case"] == "async-returned"
        }
        for record in records:
            if record["rep"] > 0:  # rep 0 is the warm-up
                key = (record["case"], record["method"])
                self.times.setdefault(key, {})[record["rep"]] = record["seconds"]
                self.mems.setdefault(key, []).append(record["mem_mib"])

    def median(self, case: str, method: str) -> float | None:
        times = self.times.get((case, method))
        return statistics.median(times.values()) if times else None

    def mem(self, case: str, method: str) -> float | None:
        mems = self.mems.get((case, method))
        return statistics.median(mems) if mems else None

    def ratio_range(self, case: str, method: str) -> str:
        """The range over the reps of ``method``'s time / shardwise's in the same rep."""
        ours, theirs = self.times.get((case, SHARDWISE), {}), self.times.get((case, method), {})
        ratios = [theirs[rep] / ours[rep] for rep in theirs if rep in ours and ours[rep] > 0]
        return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"

    def first_async(self, methods: list[str]) -> str:
        times = ", ".join(f"{m} {_time(self.first[m])}" for m in methods if m in self.first)
        return (
            f"first async save (the warm-up, not in the medians; torch_checkpointing starts its "
            f"writer process when its manager is made, before the warm-up), time to return: "
            f"{times}"
        )

    def table(self, methods: list[str]) -> list[str]:
        others = [m for m in methods if m != SHARDWISE]
        names = {
            DCP: ("DCP", "DCP/sw"),
            TC: ("torch_ckpt", "tc/sw"),
            TC_RESHARD: ("tc+reshard", "tcr/sw"),
        }
        header = f"{'case':<19}{'shardwise':>10}"
        for method in others:
            name, ratio = names[method]
            header += f"{name:>12}{ratio:>9}{'per rep':>11}"
        header += "   peak MiB (" + ", ".join(["sw", *(names[m][0] for m in others)]) + ")"
        lines = [header, "-" * len(header)]
        for label, case in ROWS:
            ours = self.median(case, SHARDWISE)
            if ours is None:
                continue
            line = f"{label:<19}{_time(ours):>10}"
            for method in others:
                theirs = self.median(case, method)
                ratio = f"{theirs / ours:.2f}x" if theirs is not None and ours > 0 else "-"
                line += f"{_time(theirs):>12}{ratio:>9}{self.ratio_range(case, method):>11}"
            mems = [self.mem(case, m) for m in methods]
            line += "   " + ", ".join("-" if m is None else f"{m:.0f}" for m in mems)
            lines.append(line)
        return lines


# -- driver -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 7M-parameter model, 2 reps")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5)")
    parser.add_argument("--tmpfs-dir", default="/dev/shm", help="directory on tmpfs")
    parser.add_argument("--no-verify", action="store_true", help="skip checking loaded values")
    parser.add_argument(
        "--profile", action="store_true", help="then cProfile each save and load on rank 0"
    )
    parser.add_argument("--profile-top", type=int, default=20, help="functions per listing")
    args = parser.parse_args()
    reps = args.reps or (2 if args.quick else 5)
    shape = QUICK_BIG if args.quick else BIG
    # On SIGTERM, unwind normally: the ranks are stopped and the work directory removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if _fs_type(args.tmpfs_dir) != "tmpfs":
        print(f"warning: --tmpfs-dir {args.tmpfs_dir} is not on tmpfs", file=sys.stderr)
    installed = _library() is not None
    version = _library_version() if installed else None
    if not installed:
        print(
            f"{LIBRARY} is not installed (pip install --no-deps torch-checkpointing=={VERSION}):"
            " comparing shardwise with DCP only",
            file=sys.stderr,
        )
    elif version != VERSION:
        print(f"note: {LIBRARY} {version} installed; written for {VERSION}", file=sys.stderr)
    print(
        f"shardwise vs DCP{f' vs {LIBRARY} ' + str(version) if installed else ''}: "
        f"{shape.num_params() / 1e6:.0f}M params, {WORLD} ranks (gloo), {reps} reps + 1 "
        f"warm-up, {os.cpu_count()} CPUs",
        file=sys.stderr,
    )
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    with (
        work_dir(args.tmpfs_dir, "shardwise-bench-tc-") as root,
        tempfile.NamedTemporaryFile(suffix=".json") as out,
    ):
        config = Config(
            port=free_port(),
            results=out.name,
            root=root,
            shape=shape,
            reps=reps,
            library=installed,
            verify=not args.no_verify,
            profile=args.profile,
            profile_top=args.profile_top,
        )
        result = run_world(_rank, config, WORLD)
    seconds = time.perf_counter() - began

    methods = [SHARDWISE, DCP]
    if installed:
        methods.append(TC)
        if any(r["method"] == TC_RESHARD for r in result["records"]):
            methods.append(TC_RESHARD)
    print(
        f"# shardwise.checkpoint vs torch.distributed.checkpoint"
        f"{f' vs {LIBRARY} ' + str(version) if installed else ''} — torch {torch.__version__}, "
        f"FSDP2 on {WORLD} gloo ranks, {os.cpu_count()} CPUs, tmpfs {args.tmpfs_dir}"
    )
    print(
        f"state: {shape.num_params() / 1e6:.1f}M params ({asdict(shape)}), "
        f"{result['tensors']} tensors, {result['global_bytes'] / GIB:.2f} GiB "
        f"({result['local_bytes'] / MIB:.0f} MiB per rank)"
    )
    print(
        f"Median of {reps} reps after a warm-up, collective times; X/sw: X's time / shardwise's "
        f"(>1: shardwise faster); per rep: that ratio's range over the reps. async: returns = "
        f"the call returns; state free = the state may change again; committed = on every "
        f"rank. {_source_state()}; 1-min load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after."
    )
    if not installed:
        print(f"{LIBRARY}: not installed, not compared")
    for note in result["notes"]:
        print(f"note: {note}")
    print()
    report = Report(result["records"])
    for line in report.table(methods):
        print(line)
    print(report.first_async(methods))
    if result["checks"]:
        print(f"values checked after: {'; '.join(result['checks'])}")
    print(f"\n(took {seconds:.0f} s)")
    for title, text in result["profiles"].items():
        print(f"\n## Profile of {title} (rank 0)\n{text}")


if __name__ == "__main__":
    main()
